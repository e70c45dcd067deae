"""
GFLOP/s of one float32 linear layer on the CPU, three ways, at SmolLM2-135M-Instruct's shapes: torch's own
F.linear (MKL), oneDNN's `_linear_pointwise` on the plain weight, and on the weight prepacked into oneDNN's
blocked layout (`_reorder_linear_weight`), as TorchSampler.generate runs them (sampler.linears_through_onednn).

    python bench/bench_linear.py                                                   # docs/performance.md
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/bench_linear.py   # an AVX2-only CPU's kernels

Rows 32: a decode step of 32 rows; rows 256: a prefill. Each figure is the median of --repeats timed loops of
--calls calls on the same input, after a warm-up, one thread; the three ways alternate within each repeat.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--calls", type=int, default=50)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
torch.set_num_threads(args.threads)
onednn = torch.ops.mkldnn

# (out, in): the MLP's gate/up and down, the query/output, the key/value projections, the tied output head
SHAPES = [(1536, 576), (576, 1536), (576, 576), (192, 576), (49152, 576)]


def seconds_a_call(function):
    start = time.perf_counter()
    for _ in range(args.calls):
        function()
    return (time.perf_counter() - start) / args.calls


print(f"float32, {torch.get_num_threads()} thread(s), torch {torch.__version__}; GFLOP/s, median of {args.repeats}")
print(f"{'rows':>4} {'out x in':>12} {'F.linear':>9} {'oneDNN':>7} {'oneDNN prepacked':>17}")
with torch.inference_mode():
    for rows in (32, 256):
        for out_features, in_features in SHAPES:
            x = torch.randn(rows, in_features)
            weight = torch.randn(out_features, in_features) * 0.02
            packed = onednn._reorder_linear_weight(weight, rows)
            ways = {
                "F.linear": lambda: F.linear(x, weight),
                "oneDNN": lambda: onednn._linear_pointwise(x, weight, None, "none", [], ""),
                "prepacked": lambda: onednn._linear_pointwise(x, packed, None, "none", [], ""),
            }
            for way in ways.values():  # the same product every way, to float32's noise
                assert torch.allclose(way(), x @ weight.T, atol=1e-4)
                seconds_a_call(way)  # warm-up
            times = {name: [] for name in ways}
            for _ in range(args.repeats):
                for name, way in ways.items():
                    times[name].append(seconds_a_call(way))
            rates = [2 * rows * out_features * in_features / statistics.median(times[name]) / 1e9 for name in ways]
            shape = f"{out_features} x {in_features}"
            print(f"{rows:>4} {shape:>12} {rates[0]:>9.0f} {rates[1]:>7.0f} {rates[2]:>17.0f}")
