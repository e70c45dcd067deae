"""
Benchmark: what each isolation layer of nanoagent/sandbox.py costs a call, for `print(1)`.

Rows: our interpreter bare (subprocess.run of `python -I -S -c "print(1)"`, no sandbox), then run_python with
the layers added one at a time: a plain process (the program runs as us, as a normal user's does without
bubblewrap), + an unprivileged uid (needs root), + bubblewrap (needs bwrap). Each is timed sequentially
(--calls calls one after another: the median latency is the per-call cost) and from a thread pool of
os.cpu_count() workers (--calls calls at once, as a GRPO step's 64 tool calls arrive: calls per second),
--repeats times; the table shows medians. Run from the repository root (as root for every row):

    python bench/bench_sandbox.py
    python bench/bench_sandbox.py --calls 128 --repeats 5
    python bench/bench_sandbox.py --trainer_mb 1500   # the caller as big as a trainer

--trainer_mb fills that much of this process's memory first: a trainer calls the sandbox from a process of
gigabytes, and a spawn that forks it copies its page tables (Popen forks when given user=, vfork otherwise).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanoagent/ lives at the repository root
from nanoagent import sandbox  # noqa: E402

parser = argparse.ArgumentParser(description="sandbox.run_python: per-call cost and calls/s of each layer")
parser.add_argument("--calls", type=int, default=64, help="calls per measurement (a GRPO step makes 64+ at once)")
parser.add_argument("--repeats", type=int, default=3, help="measurements per row; the table shows medians")
parser.add_argument("--trainer_mb", type=int, default=0, help="resident memory to hold first, as a trainer's")
args = parser.parse_args()
ballast = [bytearray(b"\1" * 2**20) for _ in range(args.trainer_mb)]  # touched: resident, not just reserved


def bare_interpreter(code):
    subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, check=True)
    return "1\n", True


def timed(call):
    start = time.perf_counter()
    text, ok = call("print(1)")
    assert (text, ok) == ("1\n", True), text
    return time.perf_counter() - start


def measure(call, workers):
    """(median seconds a call, calls per second) over args.calls calls, run by `workers` threads."""
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        latencies = list(pool.map(lambda _: timed(call), range(args.calls)))
    return statistics.median(latencies), args.calls / (time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------------------
found = sandbox.layers()  # the probe (and its warning, if any) happens here, untimed
rows = [("bare interpreter, no sandbox", None), ("process", ["process"])]
if "unprivileged uid" in found:
    rows.append(("+ unprivileged uid", ["process", "unprivileged uid"]))
if "bubblewrap" in found:
    rows.append(("+ bubblewrap", found))
workers = os.cpu_count()
print(f"{args.calls} calls of print(1), medians of {args.repeats} runs; pool: {workers} threads; layers here: {found}; "
      f"holding {args.trainer_mb} MB")
print()
print(f"| layers | sequential: ms a call | sequential: calls/s | pool of {workers}: calls/s | pool: ms a call |")
print("|---|---:|---:|---:|---:|")
for name, layers in rows:
    sandbox.layers = (lambda chosen=layers: chosen)  # run_python reads its layers through this function
    call = bare_interpreter if layers is None else sandbox.run_python
    sequential = [measure(call, 1) for _ in range(args.repeats)]
    pooled = [measure(call, workers) for _ in range(args.repeats)]
    print(f"| {name} | {statistics.median(s[0] for s in sequential) * 1000:.1f} "
          f"| {statistics.median(s[1] for s in sequential):.1f} | {statistics.median(p[1] for p in pooled):.1f} "
          f"| {statistics.median(p[0] for p in pooled) * 1000:.1f} |")
