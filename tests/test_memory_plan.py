"""bench/memory_plan.py: the planned bytes against tensor sizes measured on CPU (float32, one process)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import memory_plan  # noqa: E402


@pytest.mark.parametrize("shape", [(64, 2, 4, 2, 256, 1024, True), (256, 3, 8, 2, 704, 8192, False)],
                         ids=["tiny", "mid"])
def test_planned_memory_matches_measured_tensor_sizes(shape):
    tokens, kept = 512, 128
    planned = memory_plan.plan(shape, "grpo", 1, tokens, kept, compute_bytes=4, sharded=False)
    measured = memory_plan.measure(shape, tokens, kept)
    for part in ("parameters", "gradients", "optimizer"):  # exact: these are counts times bytes
        assert planned[part] == measured[part], part
    # Activations follow HF's implementation details (which tensors autograd saves): within 20%.
    assert planned["activations"] + planned["logits"] == pytest.approx(measured["activations + logits"], rel=0.2)


def test_the_plan_says_what_to_change_when_it_does_not_fit():
    shape = memory_plan.QWEN25["Qwen/Qwen2.5-7B-Instruct"]
    one_gpu = memory_plan.plan(shape, "ppo", 1, 8 * 4096, 8 * 1024, vllm_memory=0.3)
    eight = memory_plan.plan(shape, "ppo", 8, 8 * 4096, 8 * 1024, checkpointing=True, vllm_memory=0.3)
    assert "does NOT fit" in memory_plan.advice(one_gpu, 80)
    assert eight["optimizer"] == one_gpu["optimizer"] / 8 and eight["activations"] < one_gpu["activations"] / 10
    # 7B PPO model state (policy + critic, fp32 master + grads + AdamW) is the 219 GiB on one GPU.
    model_state = one_gpu["parameters"] + one_gpu["gradients"] + one_gpu["optimizer"] + one_gpu["critic"]
    assert 200 * memory_plan.GiB < model_state < 240 * memory_plan.GiB


def test_vllm_asleep_frees_its_share_during_the_update_but_not_during_the_rollout():
    # The case: 0.5B GRPO on 8 GPUs without activation checkpointing does not fit with vLLM awake (82.4 GiB);
    # asleep, the update's peak has no vLLM share. With checkpointing the update is small, and the rollout (the
    # models' states, no gradients, activations or logits, vLLM awake) is the step's peak: the plan counts that.
    shape, share = memory_plan.QWEN25["Qwen/Qwen2.5-0.5B-Instruct"], 0.3 * 80 * memory_plan.GiB
    awake = memory_plan.plan(shape, "grpo", 8, 8 * 4096, 8 * 1024, vllm_memory=0.3)
    asleep = memory_plan.plan(shape, "grpo", 8, 8 * 4096, 8 * 1024, vllm_memory=0.3, vllm_sleep=True)
    assert awake["vLLM"] == share and asleep["vLLM"] == 0
    assert "does NOT fit" in memory_plan.advice(awake, 80) and memory_plan.advice(asleep, 80).startswith("fits")
    assert sum(awake.values()) - sum(asleep.values()) == share
    small = memory_plan.plan(shape, "grpo", 8, 8 * 4096, 8 * 1024, checkpointing=True, vllm_memory=0.3,
                             vllm_sleep=True)
    assert 0 < small["vLLM"] < share
    assert sum(small.values()) == pytest.approx(small["parameters"] + small["optimizer"] + share)


def test_lora_and_the_torch_sampler_are_counted():
    # The adapters' count against peft's own, on a model whose maps all differ in size (kv heads < heads).
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanoagent.lora import add_lora
    shape = (64, 2, 4, 2, 96, 1024, True)
    hidden, layers, heads, kv_heads, intermediate, vocab, tied = shape
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, tie_word_embeddings=tied))
    add_lora(model, 4)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert memory_plan.lora_parameters(shape, 4) == trained
    policy = memory_plan.parameter_counts(shape)[0]
    full = memory_plan.plan(shape, "grpo", 1, 512, 128)
    lora = memory_plan.plan(shape, "grpo", 1, 512, 128, lora_rank=4, torch_sampler=True)
    assert lora["gradients"] == 4 * trained and lora["optimizer"] == 8 * trained
    assert lora["parameters"] == full["parameters"] + 4 * trained  # the frozen base keeps its fp32 masters
    assert lora["sampler"] == 2 * policy and full["sampler"] == 0
