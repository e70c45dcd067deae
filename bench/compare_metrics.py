"""
Does a refactor change what training computes? Run the same short jobs at two commits and compare every
logged number.

    python bench/compare_metrics.py 94d5212            # that commit against the working tree
    python bench/compare_metrics.py 94d5212 HEAD       # two commits
    python bench/compare_metrics.py 94d5212 --algo grpo --steps 3
    python bench/compare_metrics.py 94d5212 --env frozen_lake --algo gigpo --model DIR   # a game

For each commit (checked out with `git worktree` into a scratch folder; "." is the working tree as it is),
`train.py --steps 5 --eval_every 5` runs for GRPO and for PPO from one warmed-up checkpoint
(`--model DIR --warmup_steps 0`, the main job's cached warm-up unless --model is given) with one thread
(OMP_NUM_THREADS=1), so the float order is fixed. The two metrics.jsonl must agree on every field both
have, to --tolerance, except wall-clock fields; a field renamed since the old commit is compared under its
new name (RENAMED). Fields only one side has are listed, not failed: a refactor may add a metric.

Run it on one machine: float results differ between CPU kinds, so no numbers are stored.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WALL_CLOCK = {"elapsed_s"}
RENAMED = {}  # old name -> new name, for metrics renamed since the older commit


def checkout(ref, scratch, side):
    """A directory holding `ref`'s tree: the working tree itself for ".", else a detached git worktree."""
    if ref == ".":
        return ROOT
    path = Path(scratch) / f"tree-{side}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), ref], check=True)
    return path


def run_job(tree, task, algo, model, steps, out_dir):
    """train.py --env task in `tree` with one thread; returns its metrics.jsonl as a list of dicts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "train.py", "--env", task, "--algo", algo, "--steps", str(steps),
               "--eval_every", str(steps),
               "--model", model, "--warmup_steps", "0", "--out_dir", str(out_dir)]
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed in {tree}:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def differences(old_history, new_history, tolerance):
    """(mismatches, fields only one side logs) between two metrics histories, step by step."""
    mismatches, one_sided = [], set()
    assert len(old_history) == len(new_history), f"{len(old_history)} vs {len(new_history)} logged steps"
    for old, new in zip(old_history, new_history):
        old = {RENAMED.get(key, key): value for key, value in old.items()}
        one_sided |= set(old) ^ set(new)
        for key in sorted((set(old) & set(new)) - WALL_CLOCK):
            a, b = old[key], new[key]
            same = (math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)
                    if isinstance(a, (int, float)) and isinstance(b, (int, float)) else a == b)
            if not same:
                mismatches.append(f"step {new.get('step')}: {key} {a!r} -> {b!r}")
    return mismatches, one_sided


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="a commit (or '.' for the working tree)")
    parser.add_argument("new", nargs="?", default=".", help="a commit, or '.' for the working tree (default)")
    parser.add_argument("--algo", nargs="+", default=["grpo", "ppo"])
    parser.add_argument("--env", default="synthetic_qa", help="the task (a game: --env frozen_lake --algo gigpo)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default=None, help="a checkpoint to start from (default: the main job's warm-up)")
    parser.add_argument("--tolerance", type=float, default=0.0, help="allowed difference, relative or absolute")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        trees = [checkout(ref, scratch, side) for side, ref in enumerate((args.old, args.new))]
        try:
            model = args.model or subprocess.run(  # the old tree's warm-up: built once, then cached
                [sys.executable, "-c", "import sys, train; print(train.starting_weights(train.get_args(sys.argv[1:])))",
                 "--env", args.env],
                cwd=trees[0], check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            failed = False
            for algo in args.algo:
                histories = [run_job(tree, args.env, algo, model, args.steps, Path(scratch) / f"{algo}-{side}")
                             for side, tree in enumerate(trees)]
                mismatches, one_sided = differences(*histories, args.tolerance)
                print(f"{algo}: {len(histories[1])} log lines, "
                      f"{'identical' if not mismatches else f'{len(mismatches)} differences'}"
                      + (f"; logged on one side only: {', '.join(sorted(one_sided))}" if one_sided else ""))
                for line in mismatches[:20]:
                    print("   ", line)
                failed |= bool(mismatches)
        finally:
            for tree in trees:
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
