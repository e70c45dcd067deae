"""nanoagent/sampler.py: log-probs equal a teacher-forced pass, batching is invisible, stops, top-p, the canary."""

import copy
import math
import subprocess
import sys

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from nanoagent.models import tiny_model, tiny_tokenizer
from transformers.cache_utils import DynamicLayer

import nanoagent.sampler as sampler_module
from nanoagent.sampler import (
    Generation, PreallocatedLayer, TorchSampler, grouped_decode_attention, linears_through_onednn, onednn_linear,
    own_columns_decode_attention, sample_tokens,
)

PROMPTS = [[5, 6, 7], list(range(10, 30)), list(range(100, 109)), [42]]  # different lengths on purpose


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_tokenizer(), seed=0)


def teacher_forced_logprobs(model, prompt, generated, temperature):
    """Slow reference: one forward pass over the finished sequence, no padding, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()  # (T, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]  # rows predicting each new token
    return logprobs.gather(1, torch.tensor(generated)[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9), (1.0, 1.0), (0.0, 1.0)])
def test_logprobs_equal_teacher_forced_forward(model, temperature, top_p):
    generations = TorchSampler(model).generate(PROMPTS, [12, 20, 7, 15], temperature, top_p, seed=[3, 1, 4, 1])
    for prompt, generation, limit in zip(PROMPTS, generations, [12, 20, 7, 15]):
        assert len(generation.token_ids) == len(generation.logprobs) == limit and generation.finish_reason == "length"
        reference = teacher_forced_logprobs(model, prompt, generation.token_ids, temperature or 1.0)  # greedy: T=1
        assert (reference - torch.tensor(generation.logprobs)).abs().max() <= 1e-4


def test_greedy_is_the_argmax_of_the_teacher_forced_pass(model):
    generation = TorchSampler(model).generate([PROMPTS[1]], 10, temperature=0.0)[0]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1] + generation.token_ids])).logits[0]
    assert logits[len(PROMPTS[1]) - 1:-1].argmax(-1).tolist() == generation.token_ids


def test_batching_is_invisible_greedy(model):
    sampler = TorchSampler(model)
    batched = sampler.generate(PROMPTS, 10, temperature=0.0)
    for prompt, generation in zip(PROMPTS, batched):
        assert sampler.generate([prompt], 10, temperature=0.0)[0].token_ids == generation.token_ids
    in_pairs = TorchSampler(model, batch_size=2).generate(PROMPTS, 10, temperature=0.0)
    assert [g.token_ids for g in in_pairs] == [g.token_ids for g in batched]


def test_batching_is_invisible_with_per_row_seeds(model):
    # Temperature 0.2: the untrained model is nearly uniform over ~1000 tokens, so at temperature 1 the
    # CDF has a boundary every ~1e-3 and the float noise of a differently shaped (batched) matmul, ~1e-6,
    # flips a draw now and then. A trained policy is peaked; 0.2 makes this one peaked too.
    sampler = TorchSampler(model)
    seeds = [11, 22, 33, 44]
    batched = sampler.generate(PROMPTS, 12, temperature=0.2, top_p=0.95, seed=seeds)
    for prompt, seed, generation in zip(PROMPTS, seeds, batched):
        alone = sampler.generate([prompt], 12, temperature=0.2, top_p=0.95, seed=seed)[0]
        assert alone.token_ids == generation.token_ids
    reversed_batch = sampler.generate(PROMPTS[::-1], 12, temperature=0.2, top_p=0.95, seed=seeds[::-1])
    assert [g.token_ids for g in reversed_batch[::-1]] == [g.token_ids for g in batched]
    # Same prompt, different seeds: different samples (a seed that did nothing would fail here).
    twins = sampler.generate([PROMPTS[0]] * 2, 12, temperature=1.0, seed=[1, 2])
    assert twins[0].token_ids != twins[1].token_ids


def input_shapes(model):
    """Records the input_ids shape of every forward pass (the prefill's is the first), and the hook's handle."""
    shapes = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                             with_kwargs=True)
    return shapes, handle


def test_rows_sharing_a_prompt_are_prefilled_once_and_sampled_independently(model):
    # A GRPO group: the same prompts several times, mixed with others, in one batch. The prompt is
    # prefilled once and its cache copied; every row must still be what it would be alone.
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[1], PROMPTS[0]]
    seeds = [5, 6, 7, 8, 9, 10]
    shapes, hook = input_shapes(model)
    try:
        batched = TorchSampler(model).generate(prompts, 8, temperature=0.2, seed=seeds)
    finally:
        hook.remove()
    assert shapes[0] == (3, 20)  # the prefill: 3 distinct prompts, the longest 20 tokens
    for prompt, seed, generation in zip(prompts, seeds, batched):
        alone = TorchSampler(model).generate([prompt], 8, temperature=0.2, seed=seed)[0]
        assert alone.token_ids == generation.token_ids
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(generation.logprobs), atol=1e-5)


def test_stop_tokens_and_per_row_lengths(model):
    sampler = TorchSampler(model)
    greedy = sampler.generate(PROMPTS, 8, temperature=0.0)
    stop = greedy[0].token_ids[3]  # row 0 must stop at the first occurrence of this token
    generations = sampler.generate(PROMPTS, [8, 5, 1, 3], temperature=0.0, stop_token_ids=[stop])
    first = greedy[0].token_ids.index(stop)
    assert generations[0] == Generation(greedy[0].token_ids[:first + 1], generations[0].logprobs, "stop")
    for row, limit in [(1, 5), (2, 1), (3, 3)]:
        if stop in greedy[row].token_ids[:limit]:
            cut = greedy[row].token_ids.index(stop) + 1
            expected = (greedy[row].token_ids[:cut], "stop")
        else:
            expected = (greedy[row].token_ids[:limit], "length")
        assert (generations[row].token_ids, generations[row].finish_reason) == expected


def test_prompts_of_unlike_lengths_are_prefilled_in_buckets_and_sampled_as_alone(model):
    # 1,180 pad tokens in one pass: the rows are prefilled in buckets of like length (the longest at most 1.25x the
    # shortest), each cut to its own width, and every row still samples what it would alone.
    prompts = [list(range(5, 405)), list(range(7, 47)), list(range(9, 309)), list(range(11, 51)), list(range(3, 403)),
               list(range(13, 53))]
    shapes, hook = input_shapes(model)
    try:
        batched = TorchSampler(model).generate(prompts, 6, temperature=0.7, seed=[1, 2, 3, 4, 5, 6])
    finally:
        hook.remove()
    assert [shape for shape in shapes if shape[1] > 1] == [(2, 400), (1, 300), (3, 40)]  # rows 0, 4; 2; 1, 3, 5
    for row, prompt in enumerate(prompts):
        alone = TorchSampler(model).generate([prompt], 6, temperature=0.7, seed=row + 1)[0]
        assert alone.token_ids == batched[row].token_ids
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(batched[row].logprobs), atol=1e-5)
    one_pass = TorchSampler(model)  # the same prompts in one padded pass: the same samples
    with mock.patch("nanoagent.sampler.PREFILL_MIN_PADS", 10**9):
        assert [g.token_ids for g in one_pass.generate(prompts, 6, temperature=0.7, seed=[1, 2, 3, 4, 5, 6])] == [
            g.token_ids for g in batched]


def test_finished_rows_leave_the_batch_and_positions_skip_padding(model):
    calls = []
    hook = model.register_forward_pre_hook(  # copies: the sampler updates its decode inputs in place
        lambda module, args, kwargs: calls.append({name: value.clone() for name, value in kwargs.items()
                                                   if torch.is_tensor(value)}), with_kwargs=True)
    try:
        TorchSampler(model).generate(PROMPTS[:3], [1, 3, 6], temperature=1.0)
    finally:
        hook.remove()
    # prefill with 3 rows; row 0 is done after 1 token, row 1 after 3, row 2 after 6 (6 tokens = 6 forwards)
    assert [call["input_ids"].shape[0] for call in calls] == [3, 2, 2, 1, 1, 1]
    # Left padding: each row's real tokens are at positions 0, 1, 2, ... wherever its padding ends.
    prefill = calls[0]
    for row in range(3):
        real = prefill["attention_mask"][row].bool()
        assert prefill["position_ids"][row][real].tolist() == list(range(int(real.sum())))
    assert calls[-1]["position_ids"].tolist() == [[len(PROMPTS[2]) + 4]]  # the last forward feeds row 2's 5th token


def test_sample_tokens_distribution_and_logprob_convention():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0]).repeat(4000, 1)  # (B, V)
    uniforms = torch.rand(4000, generator=torch.Generator().manual_seed(0))  # (B,)
    tokens, logprobs = sample_tokens(logits, 1.0, 0.7, uniforms)
    # top_p 0.7: p = softmax = [.032, .087, .237, .644]; token 3 alone (.644) is short of .7, so {3, 2} is kept.
    probs = torch.softmax(logits[0], -1)
    assert set(tokens.tolist()) == {2, 3}
    assert abs((tokens == 3).float().mean().item() - (probs[3] / (probs[2] + probs[3])).item()) < 0.03
    # The log-prob is that of the untruncated distribution at this temperature.
    assert torch.allclose(logprobs, torch.log_softmax(logits[0], -1)[tokens])
    tokens, logprobs = sample_tokens(logits, 0.5, 1.0, uniforms)
    sharpened = torch.softmax(logits[0] / 0.5, -1)
    frequencies = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert (frequencies - sharpened).abs().max() < 0.03
    assert torch.allclose(logprobs, sharpened.log()[tokens])
    # Inverse CDF by hand: p = [.25, .25, 0, .5]; u = 0.5 lands past token 1, token 2 has no mass.
    tokens, _ = sample_tokens(torch.tensor([[0.0, 0.0, -float("inf"), 0.6931472]] * 4), 1.0, 1.0,
                              torch.tensor([0.0, 0.3, 0.5, 0.99]))
    assert tokens.tolist() == [0, 1, 3, 3]


def test_tiny_top_p_is_greedy(model):
    sampler = TorchSampler(model)
    nucleus_of_one = sampler.generate(PROMPTS, 10, temperature=1.0, top_p=1e-6, seed=[5, 6, 7, 8])
    greedy = sampler.generate(PROMPTS, 10, temperature=0.0)
    assert [g.token_ids for g in nucleus_of_one] == [g.token_ids for g in greedy]



def test_update_weights_copies_the_policy_into_the_samplers_own_model():
    # Sampled, not greedy: an untrained tiny model greedily repeats the prompt's last token whatever its seed.
    policy = tiny_model(tiny_tokenizer(), seed=1)
    own = tiny_model(tiny_tokenizer(), seed=0)
    sampler = TorchSampler(own)
    before = sampler.generate(PROMPTS, 8, temperature=1.0, seed=[1, 2, 3, 4])
    sampler.update_weights(policy, torch.float32)
    assert sampler.model is own and sampler.saved == {}
    for name, tensor in policy.state_dict().items():
        assert torch.equal(own.state_dict()[name], tensor), name
    after = sampler.generate(PROMPTS, 8, temperature=1.0, seed=[1, 2, 3, 4])
    fresh = TorchSampler(policy).generate(PROMPTS, 8, temperature=1.0, seed=[1, 2, 3, 4])
    assert [g.token_ids for g in after] == [g.token_ids for g in fresh]
    assert [g.token_ids for g in after] != [g.token_ids for g in before]


def test_update_weights_on_the_policy_itself_drops_the_prefix_cache():
    policy = tiny_model(tiny_tokenizer(), seed=0)
    sampler = TorchSampler(policy)
    first = sampler.generate(PROMPTS, 6, temperature=0.0)
    with torch.no_grad():  # a write through .data: PyTorch's version counters do not see it, update_weights must
        for parameter in policy.parameters():
            parameter.data.add_(0.05 * torch.randn_like(parameter))
    sampler.update_weights(policy, torch.float32)
    assert sampler.model is policy and sampler.saved == {}
    assert_next_turn_prefills_everything_again(sampler, policy, first)


def assert_next_turn_prefills_everything_again(sampler, model, first):
    """The turn after `first` on changed weights: no kept keys are reused, and it samples as a fresh sampler."""
    second_turn = [prompt + generation.token_ids + [200] for prompt, generation in zip(PROMPTS, first)]
    shapes, handle = input_shapes(model)
    after = sampler.generate(second_turn, 6, temperature=0.0)
    handle.remove()
    assert shapes[0][1] == max(len(prompt) for prompt in second_turn)  # everything prefilled again
    fresh = TorchSampler(model).generate(second_turn, 6, temperature=0.0)
    assert [g.token_ids for g in after] == [g.token_ids for g in fresh]


def test_next_turn_reuses_the_kept_cache_and_scores_like_a_fresh_pass(model):
    sampler = TorchSampler(model)
    first = sampler.generate(PROMPTS, 6, temperature=1.0, seed=[1, 2, 3, 4])
    # The next turn: each prompt, its sampled turn, then "environment" tokens of different lengths.
    second_turn = [prompt + generation.token_ids + list(range(200, 200 + extra))
                   for prompt, generation, extra in zip(PROMPTS, first, (3, 5, 1, 4))]
    shapes, handle = input_shapes(model)
    reused = sampler.generate(second_turn, 8, temperature=0.7, seed=[5, 6, 7, 8])
    handle.remove()
    assert shapes[0][1] == 5 + 1  # only the new tokens: the env's (at most 5) and the last sampled one
    fresh = TorchSampler(model).generate(second_turn, 8, temperature=0.7, seed=[5, 6, 7, 8])
    for prompt, generation, reference in zip(second_turn, reused, fresh):
        assert generation.token_ids == reference.token_ids
        expected = teacher_forced_logprobs(model, prompt, generation.token_ids, 0.7)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-5)
    # Asking for a sequence the last call kept: everything but its last token comes from the cache.
    kept = second_turn[1] + reused[1].token_ids[:-1]
    shapes, handle = input_shapes(model)
    again = sampler.generate([kept], 4, temperature=0.0)[0]
    handle.remove()
    assert shapes[0][1] == 1
    assert again.token_ids == TorchSampler(model).generate([kept], 4, temperature=0.0)[0].token_ids


def test_the_cache_appends_in_place_and_holds_what_concatenation_would():
    # A PreallocatedLayer against transformers' DynamicLayer (torch.cat at every append): a prefill of 5 tokens,
    # decode steps, rows leaving the batch, a prefill of 4 more, up to its width of 14 columns; then one too many.
    written, concatenated = PreallocatedLayer(width=14), DynamicLayer()
    generator = torch.Generator().manual_seed(0)
    for step, new in enumerate([5, 1, 1, "rows 0 and 2", 1, 1, 4, 1]):
        if new == "rows 0 and 2":
            for layer in (written, concatenated):
                layer.batch_select_indices(torch.tensor([0, 2]))
            buffer = written.buffers[0].data_ptr()
            continue
        keys, values = torch.randn(2, len(concatenated.keys) if step else 3, 2, new, 4, generator=generator)
        assert all(torch.equal(a, b) for a, b in zip(written.update(keys, values), concatenated.update(keys, values)))
        assert torch.equal(written.keys, concatenated.keys) and torch.equal(written.values, concatenated.values)
        assert written.keys.data_ptr() == written.buffers[0].data_ptr()  # a view of the buffer, not a copy
        buffer = written.buffers[0].data_ptr() if step == 0 else buffer
        assert written.buffers[0].data_ptr() == buffer  # written in place: the same buffer since the prefill
    assert written.get_seq_length() == 14
    with pytest.raises(AssertionError, match="15 columns in a cache made for 14"):
        written.update(*torch.randn(2, 2, 2, 1, 4))  # a slice past the end would take it silently


def test_generations_are_bitwise_those_of_transformers_cache(model, monkeypatch):
    sampler = TorchSampler(model)
    first = sampler.generate(PROMPTS, [6, 9, 3, 7], temperature=1.0, seed=[1, 2, 3, 4])
    second_turn = [prompt + generation.token_ids + [200, 201] for prompt, generation in zip(PROMPTS, first)]
    second = sampler.generate(second_turn, 8, temperature=1.0, seed=[5, 6, 7, 8])  # from the kept cache
    monkeypatch.setattr("nanoagent.sampler.PreallocatedLayer", lambda width: DynamicLayer())
    reference = TorchSampler(model)
    assert reference.generate(PROMPTS, [6, 9, 3, 7], temperature=1.0, seed=[1, 2, 3, 4]) == first
    assert reference.generate(second_turn, 8, temperature=1.0, seed=[5, 6, 7, 8]) == second


def test_prefix_cache_is_dropped_when_the_weights_change():
    model = tiny_model(tiny_tokenizer(), seed=0)
    sampler = TorchSampler(model)
    first = sampler.generate(PROMPTS, 6, temperature=0.0)
    with torch.no_grad():  # an optimizer step in place, as in training: the kept keys are stale now
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    assert_next_turn_prefills_everything_again(sampler, model, first)


def test_sliding_window_layers_keep_nothing_between_calls():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(**{**tiny_model(tiny_tokenizer(), seed=0).config.to_dict(), "use_sliding_window": True,
                            "sliding_window": 4, "max_window_layers": 1, "layer_types": None})
    model = Qwen2ForCausalLM(config).eval()  # layer 1 attends to the last 4 tokens only
    sampler = TorchSampler(model)
    first = sampler.generate(PROMPTS, 6, temperature=0.0)
    assert sampler.saved == {}
    second_turn = [prompt + generation.token_ids + [200] for prompt, generation in zip(PROMPTS, first)]
    assert ([g.token_ids for g in sampler.generate(second_turn, 6, temperature=0.0)]
            == [g.token_ids for g in TorchSampler(model).generate(second_turn, 6, temperature=0.0)])


def test_training_mode_is_restored(model):
    model.train()
    TorchSampler(model).generate(PROMPTS[:1], 2)
    assert model.training
    model.eval()


def test_vllm_is_imported_lazily():
    code = "import sys; import nanoagent.sampler; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_static_shapes_sample_what_the_eager_loop_samples(model):
    # The CUDA path (fixed shapes, finished rows kept in place until the live ones fit a smaller bucket, the whole
    # cache attended under a mask) run eagerly on the CPU, against the default CPU loop: a GRPO group, stop tokens,
    # per-row limits, then a next turn from the kept cache. Temperature 0.2: see the per-row seeds test. In float64:
    # the two attend in another float order, and float32's noise can move a uniform across a token's boundary.
    model = copy.deepcopy(model).double()
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2], PROMPTS[0]]
    limits, seeds = [20, 3, 11, 17, 9, 6], [1, 2, 3, 4, 5, 6]
    stop = TorchSampler(model).generate(prompts[:1], 20, temperature=0.2, seed=1)[0].token_ids[12]  # row 0 stops
    samplers = [TorchSampler(model, static_shapes=static) for static in (False, True)]
    turns = [[sampler.generate(prompts, limits, temperature=0.2, stop_token_ids=[stop], seed=seeds)
              for sampler in samplers]]
    assert {generation.finish_reason for generation in turns[0][0]} == {"stop", "length"}
    second_turn = [prompt + generation.token_ids + [200] for prompt, generation in zip(prompts, turns[0][0])]
    turns.append([sampler.generate(second_turn, 9, temperature=0.2, seed=[7, 8, 9, 10, 11, 12])
                  for sampler in samplers])
    assert samplers[0].saved.keys() == samplers[1].saved.keys()
    for eager, static in turns:
        for a, b in zip(eager, static):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_static_shapes_pad_to_power_of_two_buckets_and_read_back_every_8_steps(model):
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["attention_mask"].shape),
                                           with_kwargs=True)
    try:
        generations = TorchSampler(model, static_shapes=True).generate(PROMPTS[:3] * 2, [1, 3, 5, 9, 20, 30], 1.0)
    finally:
        hook.remove()
    assert [len(generation.token_ids) for generation in generations] == [1, 3, 5, 9, 20, 30]
    # The live rows are read back after tokens 8, 16, 24: 3 live after 8 (a bucket of 4: one slot pads), 2 after 16,
    # 1 after 24. Every decode step attends to the whole cache, 20 + 30 columns wide (the longest prompt, the limit).
    assert [shape[0] for shape in calls[1:]] == [6] * 7 + [4] * 8 + [2] * 8 + [1] * 6
    assert {tuple(shape[1:]) for shape in calls[1:]} == {(1, 1, 20 + 30)}


# grouped_decode's softmax is in float32 whatever the model's dtype, as transformers' eager attention's
@pytest.mark.parametrize("attention, tolerance", [
    (grouped_decode_attention, 1e-6), (own_columns_decode_attention, 1e-12),
])
def test_the_decode_attentions_are_plain_attention_per_head(attention, tolerance):
    # A plain loop per row and query head against the decode step's attentions: head h reads key/value head h // 3
    # (6 query heads over 2), masked columns (False) count for nothing, whatever they hold. Six rows are two of
    # own_columns' reads, their first columns out of order, one row with a gap (a kept prefix, then padding).
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(shape, generator=generator, dtype=torch.float64)
                         for shape in ((6, 6, 1, 4), (6, 2, 5, 4), (6, 2, 5, 4)))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 0, 1, 1], [0, 0, 0, 0, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1],
                         [1, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    output, weights = attention(None, query, key, value, mask, scaling=0.5)
    assert output.shape == (6, 1, 6, 4) and weights is None
    for row in range(6):
        columns = [column for column in range(5) if mask[row, 0, 0, column]]
        for head in range(6):
            keys, values = key[row, head // 3, columns], value[row, head // 3, columns]  # (n, d) each
            scores = [0.5 * float(query[row, head, 0] @ k) for k in keys]
            exps = [math.exp(score - max(scores)) for score in scores]
            expected = sum(e / sum(exps) * v for e, v in zip(exps, values))
            assert torch.allclose(output[row, 0, head], expected, rtol=0, atol=tolerance)


def test_a_cpu_decode_step_reads_each_group_of_rows_from_its_first_attended_column(model):
    # generate sorts rows by prompt length: the four short prompts' keys are read from the column where the
    # longest of them starts, not from the 40-token prompt's first; each row still samples what it would alone.
    prompts = [list(range(3, 43)), [7, 8], list(range(9, 39)), [5, 6, 7], [1, 2, 3, 4], [11]]
    widths, sdpa = [], F.scaled_dot_product_attention

    def recording(query, key, *args, **kwargs):
        if query.shape[2] == 1:
            widths.append(key.shape[2])
        return sdpa(query, key, *args, **kwargs)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", recording):
        batched = TorchSampler(model).generate(prompts, 2, temperature=0.7, seed=[1, 2, 3, 4, 5, 6])
    assert widths == [4 + 1, 40 + 1] * model.config.num_hidden_layers  # one decode step, 41 columns wide
    for row, prompt in enumerate(prompts):
        alone = TorchSampler(model).generate([prompt], 2, temperature=0.7, seed=row + 1)[0]
        assert alone.token_ids == batched[row].token_ids
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(batched[row].logprobs), atol=1e-5)


def test_the_linears_run_through_onednn_while_sampling_to_the_float_noise_and_are_restored(model, monkeypatch):
    # torch's CPU linear calls MKL, whose float32 kernels on AMD's AVX-512 CPUs are AVX2 ones: the sampler runs
    # oneDNN's instead. Every nn.Linear of the model goes through it, and only while sampling.
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    called = []
    monkeypatch.setattr(sampler_module, "onednn_linear",
                        lambda linear, packed, input: called.append(linear) or onednn_linear(linear, packed, input))
    TorchSampler(model).generate(PROMPTS, 3)
    assert {id(linear) for linear in called} == {id(linear) for linear in linears} and len(linears) >= 3
    assert all("forward" not in vars(linear) for linear in linears)  # nn.Linear's own forward again
    linear = linears[0]
    x = torch.randn(5, 3, linear.in_features, requires_grad=True)
    with linears_through_onednn(model, 15):
        assert "forward" in vars(linear)
        with torch.no_grad():
            assert torch.allclose(linear(x), F.linear(x, linear.weight, linear.bias), atol=1e-5)
        # With a gradient, the plain linear: oneDNN's op has no backward.
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
        linear(x).sum().backward()
    assert torch.allclose(x.grad, linear.weight.sum(0).expand_as(x))
