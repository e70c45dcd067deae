"""
The real model learns a multi-turn tool task on 2 cores: SmolLM2-135M-Instruct (`--model smollm2-135m`) on the
calculator, SFT + RL against SFT alone given the same wall time (docs/results.md, notebook 06).

  SFT + RL:   30 SFT steps on a weak agent's demonstrations (each miscopies a number with probability 0.5), then
              20 GRPO steps (4 problems x 4 samples, lr 2e-5), held-out success on 64 problems at steps 0, 10, 20.
  SFT alone:  the same demonstrations for --sft_alone_steps steps (120: about the same wall time on one thread),
              held-out success at its end (train.py's step-0 evaluation; the run stops there).

Each run is one process with one thread, as two runs share a 2-core machine; a seed warms up anew (the cache keys
the warm-up by its seed). Then the runs' curves and a sample each of what the model writes after SFT and after RL
go to docs/smollm2_calculator.json, which notebook 06 reads:

    python bench/real_model_recipe.py --seeds 0 1 2           # about 45 minutes a seed on 2 cores
    python bench/real_model_recipe.py --collect --seeds 0 1 2  # only gather runs/real_model/ into the json
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = ["--model", "smollm2-135m", "--env", "calculator", "--warmup_clean_steps", "0", "--warmup_steps", "30",
          "--warmup_mistake_rate", "0.5", "--warmup_lr", "5e-5", "--warmup_batch_size", "8", "--steps", "20",
          "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "48", "--max_turns", "3",
          "--max_total_tokens", "640", "--lr", "2e-5", "--eval_every", "10", "--eval_episodes", "64"]


def train(runs, name, flags, stop_after_step_0=False):
    """train.py with the recipe and `flags` into runs/NAME, one thread; its wall time in seconds."""
    command = [sys.executable, "train.py", *RECIPE, *flags, "--out_dir", str(runs / name)]
    start = time.time()
    process = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    while process.poll() is None:
        metrics = runs / name / "metrics.jsonl"
        if stop_after_step_0 and metrics.exists() and metrics.read_text().strip():
            process.kill()  # the step-0 evaluation is SFT alone's result
        time.sleep(5)
    (runs / name / "wall_s.txt").write_text(f"{time.time() - start:.0f}\n")


def collected(runs, name):
    """{step: held-out success}, the wall time, and the first member of the first and last kept groups."""
    history = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    groups = [json.loads(line) for line in (runs / name / "trajectories.jsonl").read_text().splitlines()] \
        if (runs / name / "trajectories.jsonl").exists() else []
    samples = {f"step {g['step']}": [turn["text"] for turn in g["turns"]] for g in (groups[:1] + groups[-1:])}
    return {"held_out": {h["step"]: h["eval_success"] for h in history if "eval_success" in h},
            "wall_s": int((runs / name / "wall_s.txt").read_text()), "samples": samples}


def main():
    parser = argparse.ArgumentParser(description="SmolLM2-135M on the calculator: SFT + RL against SFT alone")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft_alone_steps", type=int, default=120)
    parser.add_argument("--runs", default=str(REPO / "runs" / "real_model"))
    parser.add_argument("--collect", action="store_true", help="only gather the runs into the json")
    parser.add_argument("--out", default=str(REPO / "docs" / "smollm2_calculator.json"))
    args = parser.parse_args()
    runs = Path(args.runs)
    if not args.collect:
        for seed in args.seeds:
            train(runs, f"sft_rl_seed{seed}", ["--seed", str(seed)])
            train(runs, f"sft_alone_seed{seed}", ["--seed", str(seed), "--warmup_steps", str(args.sft_alone_steps),
                                                "--steps", "1", "--eval_every", "1000"], stop_after_step_0=True)
    result = {"command": "python train.py " + " ".join(RECIPE) + " --seed S", "sft_alone_steps": args.sft_alone_steps,
              "runs": {f"{arm}_seed{seed}": collected(runs, f"{arm}_seed{seed}") for seed in args.seeds
                       for arm in ("sft_rl", "sft_alone")}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
