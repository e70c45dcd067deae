"""
Benchmark: nanoagent's training step on this machine, with a FLOP cost model (CPU or GPU).

Runs `train.py` (GRPO by default, any train.py flags pass through) for a few steps after its cached
warm-up and reports seconds per step, tokens per second, peak memory, and achieved FLOP/s against a
matmul ceiling measured on the same device:

    python bench/bench_train.py                      # tiny model, synthetic QA, 20 GRPO steps
    python bench/bench_train.py --algo ppo           # + the critic's forward and backward

Cost model, per step (N = parameters of the policy, T = tokens of all trajectories of the step):
  policy:  2N T (old log-probs, no grad) + 6N T (forward + backward of the update), per PPO epoch
  critic:  2N T (values) + 6N T (forward + backward), PPO only (the critic has the policy's size)
  rollout: not counted; it is mostly small decode steps, bound by memory and Python, not by FLOPs.
Attention's T^2 term is left out: at these lengths (about 150 tokens) it is a few percent of 2N.
"""

import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the concept files live at the repository root
import train  # noqa: E402


def matmul_ceiling(device, size=1024, repeats=50):
    """FLOP/s of a square float32 matmul on `device`: the ceiling the training step is measured against."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
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


def main():
    steps = 20
    with tempfile.TemporaryDirectory() as out_dir:
        argv = ["--steps", str(steps), "--eval_every", "0", "--save_every", str(steps), "--out_dir", out_dir,
                *sys.argv[1:]]
        args = train.get_args(argv)
        policy, history = train.main(argv)
    device = next(policy.parameters()).device
    parameters = sum(p.numel() for p in policy.parameters())
    measured = history[2:]  # the first steps pay for one-time start-up work
    seconds = (measured[-1]["elapsed_s"] - history[1]["elapsed_s"]) / len(measured)
    episodes = args.prompts_per_step * args.group_size
    tokens = sum(h["trajectory_tokens"] for h in measured) / len(measured) * episodes  # per step
    flops = (2 + 6 * args.ppo_epochs) * parameters * tokens * (2 if args.algo == "ppo" else 1)
    ceiling = matmul_ceiling(device)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"model {args.model} ({parameters / 1e6:.2f}M parameters), {args.algo}, {episodes} episodes/step, "
          f"{torch.get_num_threads()} threads, device {device}")
    print(f"seconds/step {seconds:.2f} | tokens/step {tokens:.0f} | tokens/s {tokens / seconds:.0f} | "
          f"peak memory {peak_mb:.0f} MB (process RSS)")
    print(f"training FLOP/step {flops / 1e9:.2f} G | achieved {flops / seconds / 1e9:.2f} GFLOP/s | "
          f"matmul ceiling {ceiling / 1e9:.1f} GFLOP/s | {100 * flops / seconds / ceiling:.1f}% of it "
          "(the step's time includes the rollout, which the FLOP count leaves out)")


if __name__ == "__main__":
    main()
