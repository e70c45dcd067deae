"""GPU-only checks (marked `gpu`; skipped without CUDA): the samplers' log-probs against the trainer's
on the GPU, a short bf16 training run, and, when vLLM is installed, the VLLMSampler and its weight sync.
bench/gpu_check.py runs them with `python -m pytest -m gpu`."""

import warnings

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import masks
import train
from nanoagent.models import load_model, resolve_model_path
from nanoagent.sampler import TorchSampler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPTS = [[5, 6, 7], list(range(10, 30)), list(range(100, 109)), [42]]


def trainer_logprobs(model, prompts, generations, temperature=1.0):
    """The trainer's view: one padded forward pass over prompt + generation, as train.py scores it."""
    rows = [prompt + generation.token_ids for prompt, generation in zip(prompts, generations)]
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long, device="cuda")  # (B, T), right padded
    attention_mask = torch.zeros_like(input_ids)
    sampled = torch.zeros(len(rows), width, device="cuda")  # (B, T): 1 on generated tokens
    sampler_logprobs = torch.zeros(len(rows), width, device="cuda")
    for i, (prompt, generation) in enumerate(zip(prompts, generations)):
        input_ids[i, :len(rows[i])] = torch.tensor(rows[i])
        attention_mask[i, :len(rows[i])] = 1
        sampled[i, len(prompt):len(rows[i])] = 1
        sampler_logprobs[i, len(prompt):len(rows[i])] = torch.tensor(generation.logprobs)
    with torch.no_grad():
        logprobs, _ = train.token_logprobs(model, input_ids, attention_mask, temperature)
    return masks.masked_mean((sampler_logprobs[:, 1:] - logprobs).abs(), sampled[:, 1:]).item()


def test_torch_sampler_on_cuda_float32_matches_the_trainer(monkeypatch):
    # compute_init turns TF32 matmuls on for training; this comparison needs true fp32.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model, _ = load_model("tiny", device="cuda", dtype=torch.float32)
    generations = TorchSampler(model).generate(PROMPTS, 16, temperature=1.0, seed=[1, 2, 3, 4])
    assert trainer_logprobs(model, PROMPTS, generations) <= 1e-3  # fp32, two kernel paths: rounding only


def test_torch_sampler_cuda_graphs_sample_what_the_eager_loop_samples(monkeypatch):
    # The default CUDA path (static shapes, a CUDA graph per bucket, rows read back every 8 steps) against the eager
    # loop, float32: the same tokens and stops, the same log-probs, and the trainer's log-probs to 1e-5.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model, _ = load_model("tiny", device="cuda", dtype=torch.float32)
    prompts, limits, seeds = PROMPTS * 3, [24, 3, 17, 9, 30, 12] * 2, list(range(12))
    stop = TorchSampler(model, static_shapes=False).generate(prompts[:1], 24, 0.7, 0.95, seed=0)[0].token_ids[10]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="decoding without CUDA graphs")  # a failed capture fails the test
        graphed = TorchSampler(model).generate(prompts, limits, 0.7, 0.95, stop_token_ids=[stop], seed=seeds)
    eager = TorchSampler(model, static_shapes=False).generate(prompts, limits, 0.7, 0.95, [stop], seed=seeds)
    assert [(g.token_ids, g.finish_reason) for g in graphed] == [(g.token_ids, g.finish_reason) for g in eager]
    assert "stop" in {g.finish_reason for g in graphed}
    difference = max((torch.tensor(g.logprobs) - torch.tensor(e.logprobs)).abs().max().item()
                     for g, e in zip(graphed, eager))
    mismatch = trainer_logprobs(model, prompts, graphed, temperature=0.7)
    print(f"graphs vs eager: max |delta log-prob| {difference:.2e}; vs the trainer: mean {mismatch:.2e}")
    assert difference <= 1e-5 and mismatch <= 1e-5


def test_short_bf16_training_run_on_cuda(tmp_path):
    argv = ["--device", "cuda", "--warmup_steps", "0", "--steps", "3", "--eval_every", "0", "--out_dir", str(tmp_path),
            "--save_every", "1"]  # three saves: the second and third refill the pinned staging buffers of the first
    policy, history = train.main(argv)
    # One GPU trains sharded too (a 1-rank FSDP2 group): fp32 master weights, bf16 compute.
    assert isinstance(policy, FSDPModule) and next(policy.parameters()).dtype == torch.float32
    assert all(torch.isfinite(torch.tensor(h["policy_loss"])) for h in history)
    # bf16 KV-cache decoding and the bf16 training forward round differently, but only slightly. (The
    # TorchSampler samples from a bf16 copy that gets every update pushed, so this checks rounding and the
    # push; the vLLM test checks staleness.)
    assert max(h["logprob_mismatch"] for h in history) < 0.1


def test_vllm_sampler_matches_the_trainer_and_follows_weight_updates():
    pytest.importorskip("vllm")
    from nanoagent.sampler import VLLMSampler
    model, _ = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    sampler = VLLMSampler(resolve_model_path("tiny"), gpu_memory_utilization=0.2, max_model_len=512)
    generations = sampler.generate(PROMPTS, 16, temperature=1.0, seed=[1, 2, 3, 4])
    assert trainer_logprobs(model, PROMPTS, generations) < 0.1
    with torch.no_grad():  # a very different policy: until the sync, the engine samples from the old one
        model.get_output_embeddings().weight.normal_(0.0, 1.0)
    stale = trainer_logprobs(model, PROMPTS, sampler.generate(PROMPTS, 16, temperature=1.0, seed=[1, 2, 3, 4]))
    sampler.update_weights(model, torch.bfloat16)
    synced = trainer_logprobs(model, PROMPTS, sampler.generate(PROMPTS, 16, temperature=1.0, seed=[1, 2, 3, 4]))
    assert synced < 0.1 < stale
