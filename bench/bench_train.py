"""
Benchmark: nanoagent's training step on this machine, with a FLOP cost model (CPU or GPU).

Runs `train.py` (GRPO by default, any train.py flags pass through) for a few steps after its cached
warm-up and reports seconds per step, tokens per second, peak memory, and achieved FLOP/s against a
matmul ceiling measured on the same device, in the model's dtype. On a GPU it also reports MFU, the
share of the card's datasheet bf16 peak (known cards below, or --peak_tflops):

    python bench/bench_train.py                      # tiny model, synthetic QA, 20 GRPO steps
    python bench/bench_train.py --algo ppo --steps 40  # + the critic's forward and backward
    python bench/bench_train.py --device cuda --model DIR --warmup_steps 0 --peak_tflops 989

Cost model, per step. T = tokens of all trajectories of the step, K = the agent's tokens among them
(the ones the loss reads), N_body = parameters of the transformer body, N_head = the LM head's.
T_p = T less the prompt tokens that the G members of a group share: the policy runs each group's
prompt once (train.shared_prompt_hidden). A policy forward pass costs F = 2 N_body T_p + 2 N_head K:
train.py sends only the loss's positions through the LM head (train.token_logprobs). A backward
pass costs 2F.
  policy:  3F per update pass (forward + backward), per PPO epoch; + F for the old log-probs, unless
           the step is a single update, which reuses its own forward (train.py, step 3)
  critic:  PPO only, 2 N_body T_p (values) + 6 N_body T_p per epoch (its head has one output)
  rollout: not counted; it is mostly small decode steps, bound by memory and Python, not by FLOPs.
With --filter_ratio < 1 the update sees only the kept groups: the count is scaled by their share.
Attention's T^2 term is left out: at these lengths (about 150 tokens) it is a few percent of 2 N_body.
"""

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the concept files live at the repository root
import train  # noqa: E402
from nanoagent.common import autodetect_dtype  # noqa: E402

# Dense bf16 tensor-core peaks from the vendor's datasheets (SXM parts), in FLOP/s.
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def matmul_ceiling(device, dtype, size, repeats=50):
    """FLOP/s of a square matmul in `dtype` on `device`: the ceiling the training step is measured against."""
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(5):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size ** 3 * repeats / (time.perf_counter() - start)


def peak_memory_mb():
    """This process's peak resident memory so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def timed_run(train_argv, steps):
    """train.main for `steps` steps with these train.py flags, in a temporary out_dir, with no evaluation
    and no checkpoint before the end. Returns (args, policy, history, seconds per step, trajectory tokens
    per step), timed over steps 3..N: the first two pay for one-time start-up work."""
    with tempfile.TemporaryDirectory() as out_dir:
        argv = ["--steps", str(steps), "--eval_every", "0", "--save_every", str(steps), "--out_dir", out_dir,
                *train_argv]
        args = train.get_args(argv)
        policy, history = train.main(argv)
    measured = history[2:]
    seconds = (measured[-1]["elapsed_s"] - history[1]["elapsed_s"]) / len(measured)
    tokens = statistics.fmean(h["trajectory_tokens"] for h in measured) * args.prompts_per_step * args.group_size
    return args, policy, history, seconds, tokens


def main():
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--steps", type=int, default=20, help="training steps (at least 3: two are not timed)")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak (default: known cards)")
    own, train_argv = parser.parse_known_args()
    if own.steps < 3:
        parser.error("--steps must be at least 3: the first two steps are not timed")
    args, policy, history, seconds, tokens = timed_run(train_argv, own.steps)
    parameter = next(policy.parameters())
    embedding, head = policy.get_input_embeddings().weight, policy.get_output_embeddings().weight
    total = sum(p.numel() for p in policy.parameters())
    body = total - embedding.numel() - (0 if head is embedding else head.numel())  # a lookup costs no FLOPs
    episodes = args.prompts_per_step * args.group_size
    agent_tokens = statistics.fmean(h["response_tokens"] for h in history[2:]) * episodes  # K, per step (T: tokens)
    shared_prompts = statistics.fmean(h["prompt_tokens"] for h in history[2:]) * (episodes - args.prompts_per_step)
    if args.no_action_mask:  # the loss reads every position: nothing is shared, every position goes through the head
        body_tokens, head_tokens = tokens, tokens
    else:
        body_tokens, head_tokens = tokens - shared_prompts, agent_tokens  # T_p, K
    forward = 2 * body * body_tokens + 2 * head.numel() * head_tokens
    kept = statistics.fmean(h["kept_trajectories"] for h in history[2:])  # StarPO-S filtering may drop groups
    single_update = train.is_single_update(args, round(kept), args.steps - 1)  # no separate old-log-prob pass
    flops = (3 * args.ppo_epochs + (0 if single_update else 1) + (1 if args.kl != "none" else 0)) * forward
    if args.algo == "ppo":
        flops += (2 + 6 * args.ppo_epochs) * body * body_tokens
    flops *= kept / episodes  # the update trains on the kept trajectories only (taken to be of average length)
    dtype = autodetect_dtype(parameter.device.type)  # what the matmuls run in (the stored master weights are float32)
    ceiling = matmul_ceiling(parameter.device, dtype, 8192 if parameter.device.type == "cuda" else 1024)
    achieved = flops / seconds
    peak_mb = peak_memory_mb()
    print(f"model {args.model} ({total / 1e6:.2f}M parameters), {args.algo}, {episodes} episodes/step, "
          f"{torch.get_num_threads()} threads, device {parameter.device}, {dtype}")
    print(f"seconds/step {seconds:.2f} | tokens/step {tokens:.0f} | tokens/s {tokens / seconds:.0f} | "
          f"peak memory {peak_mb:.0f} MB (process RSS)")
    print(f"training FLOP/step {flops / 1e9:.2f} G | achieved {achieved / 1e9:.2f} GFLOP/s | "
          f"matmul ceiling {ceiling / 1e9:.1f} GFLOP/s | {100 * achieved / ceiling:.1f}% of it "
          "(the step's time includes the rollout, which the FLOP count leaves out)")
    if parameter.device.type == "cuda":
        name = torch.cuda.get_device_name(parameter.device)
        peak = own.peak_tflops * 1e12 if own.peak_tflops else next(
            (value for key, value in BF16_PEAK.items() if key in name), None)
        print(f"GPU {name}: peak GPU memory {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB | " + (
            f"MFU {100 * achieved / peak:.2f}% of its {peak / 1e12:.0f} TFLOP/s bf16 peak" if peak
            else "bf16 peak unknown: pass --peak_tflops for MFU"))


if __name__ == "__main__":
    main()
