"""
Where the TorchSampler's time goes on the real model: prefill and decode timed apart, then each under
torch.profiler (its busiest operators), on the fixed-length workload of bench_sampler.py at 135M.

    python bench/profile_sampler.py --threads 2          # docs/performance.md, "Where the TorchSampler's time goes"

32 prompts of 20-300 random token ids (seed 0), sorted by length as TorchSampler.generate sorts its rows, 64 new
tokens each at temperature 1, no stop tokens;
SmolLM2-135M-Instruct in float32 (requirements-smollm2.txt).
"""

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanoagent/ lives at the repository root
from nanoagent.models import load_model  # noqa: E402
from nanoagent.sampler import TorchSampler, linears_through_onednn  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--num-prompts", type=int, default=32)
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()
torch.set_num_threads(args.threads)
model = load_model("smollm2-135m")[0].eval()
rng = random.Random(0)
prompts = sorted(  # as TorchSampler.generate sorts its rows
    ([rng.randrange(100, 40000) for _ in range(rng.randint(20, 300))] for _ in range(args.num_prompts)), key=len)
rows, steps = len(prompts), args.max_new_tokens
sampler = TorchSampler(model)


def prefill():
    return sampler.prefill(prompts, [steps] * rows, 1.0, 1.0, list(range(rows)), {})


def decode(state):
    sampler.decode(state, prompts, 1.0, 1.0, set())


with torch.inference_mode(), linears_through_onednn(model, rows):  # as TorchSampler.generate runs them
    decode(prefill())  # warm-up
    for _ in range(2):
        start = time.perf_counter()
        state = prefill()
        middle = time.perf_counter()
        decode(state)
        end = time.perf_counter()
        slots = rows * max(map(len, prompts))
        print(f"prefill {middle - start:.2f} s ({sum(map(len, prompts))} tokens; one padded pass: {slots} slots), "
              f"decode "
              f"{end - middle:.2f} s ({rows * steps / (end - middle):.0f} tokens/s), "
              f"{rows * steps / (end - start):.0f} generated tokens/s over the call")
    for name, work in [("prefill", prefill), ("decode", lambda: decode(prefill_state))]:
        prefill_state = prefill()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            work()
        print(name)
        print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
