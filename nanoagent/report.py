"""
See a run: the trajectories it kept and the curves it logged, on one HTML page that
opens offline.

    python -m nanoagent.report runs/default  # writes runs/default/report.html

Agent RL fails in ways a mean hides: the agent stops calling tools, repeats one
query, answers before searching. People find these by reading trajectories beside
the curves, so a run keeps both:

  - `metrics.jsonl`, one line per step (train.py's end_of_step);
  - `trajectories.jsonl`, one line per trajectory (`trajectory_records`): train.py
    writes one group per step, eval.py --trajectories every episode. Every token has
    its id, its text, its author (prompt, agent or env: the action mask made
    visible), its reward, and, from training, its advantage and the old policy's
    log-prob beside the sampler's; every turn its reward, tool calls and answers.

The page (`report_html`, template `report.html.jinja`): the run's flags and summary,
the metrics as curves (matplotlib, inline PNGs) with Echo-Trap warnings marked by
signal, and a trajectory browser: a step's group, its members side by side, tokens
coloured by author, agent tokens shaded by advantage (green above 0, red below).
Notebooks show trajectories with the same template (`trajectories_html`). A missing
file, a half-written last line or a run still going make a page that says so, never
a traceback.
"""

import argparse
import base64
import io
import json
import sys
from pathlib import Path

import jinja2
from matplotlib.figure import Figure  # the object API: no pyplot, no global backend

TRAJECTORIES = "trajectories.jsonl"
# The curves, grouped as a reader asks: did it work, what does the agent do, is the
# update sane, is there signal?
CURVES = {
    "outcome": ["reward", "success", "eval_success"],
    "behaviour": [
        "turns", "tool_calls", "invalid_call_rate", "void_turns", "response_tokens",
        "truncated"
    ],
    "optimisation": [
        "policy_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm",
        "explained_variance", "value_loss"
    ],
    "signal": [
        "group_reward_std", "zero_variance_groups", "retrieval_accuracy",
        "mutual_information", "kept_trajectories"
    ]
}
MAX_GROUPS = 50  # groups on one page, evenly spaced: a long run's page stays a few MB
TEMPLATE = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent), autoescape=True,
    trim_blocks=True, lstrip_blocks=True
).get_template("report.html.jinja")

# -----------------------------------------------------------------------------
# Writing: trajectories as JSON lines


def trajectory_records(trajectories, tokenizer, step, advantages=None, old_logprobs=None):
    """trajectories.jsonl's lines (dicts) for rollout.Trajectory objects, a group's
    members in order; `step` labels them (a training step, or eval.py's row).
    advantages and old_logprobs: one list per trajectory, aligned with token_ids[1:]
    as the trainer computes them (nanoagent/models.py: token_logprobs), or None."""
    records, members = [], {}
    for row, trajectory in enumerate(trajectories):
        ids, prompt_length = trajectory.token_ids, trajectory.prompt_length
        members[trajectory.group_id] = members.get(trajectory.group_id, -1) + 1
        # Who wrote each token: the action mask, with the opening prompt (the env's
        # too) named apart.
        authors = ["prompt"] * prompt_length + ["agent" if agent else "env"
                                                for agent in trajectory.action_mask[prompt_length:]]
        rewards = [0.0] * len(ids)
        for position, reward in zip(trajectory.turn_end_positions, trajectory.turn_rewards):
            # on the turn's last agent token, as masks.place_rewards puts it
            rewards[position] += reward
        turns = []  # each assistant message and the messages the env answered it with
        for message in trajectory.messages:
            if message["role"] == "assistant":
                turns.append({"text": message["content"], "answers": []})
            elif turns:
                turns[-1]["answers"].append(message["content"])
        for turn, reward, info in zip(turns, trajectory.turn_rewards, trajectory.turn_infos):
            turn.update(reward=reward, calls=info.get("calls", []))
        records.append({
            "step": step, "group": trajectory.group_id,
            "member": members[trajectory.group_id], "seed": trajectory.seed,
            "score": trajectory.score, "success": bool(trajectory.info["success"]),
            "truncated": trajectory.truncated, "info": trajectory.info, "turns": turns,
            "tokens": {
                "id": ids, "text": tokenizer.batch_decode([[token] for token in ids]),
                "author": authors, "reward": rewards,
                "sampler_logprob": rounded(trajectory.logprobs),
                "advantage": trainer_row(advantages, row, len(ids)),
                "old_logprob": trainer_row(old_logprobs, row, len(ids))
            }
        })
    return records


def rounded(values):
    """Numbers as the file keeps them: 4 decimals are plenty, and a line stays short."""
    return [round(value, 4) for value in values]


def trainer_row(values, row, length):
    """Row `row` of the trainer's (B, T-1) numbers as one number per token (T,):
    token 0 has no prediction, so 0.0. None (eval.py has no trainer) stays None."""
    return None if values is None else [0.0] + rounded(values[row][:length - 1])


def append_jsonl(path, records):
    """Append one JSON line per record, in one write (a kill leaves one partial line)."""
    with open(path, "a") as file:
        file.write("".join(json.dumps(record, default=str) + "\n" for record in records))

# -----------------------------------------------------------------------------
# Reading: whatever a run left, with what is missing said


def read_jsonl(path, problems):
    """The dict lines of a JSONL file; a missing file or a broken line goes to `problems`."""
    if not path.is_file():
        problems.append(f"no {path.name} in this directory")
        return []
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            problems.append(
                f"{path.name} line {number} is not a complete JSON object (a run killed"
                " mid-write?): skipped"
            )
    return records


def curves_png(history, names, warned_steps):
    """One row of small plots, one per metric of `names` (each logged at some step),
    as base64 PNG; a dotted red line at every step with an Echo-Trap warning."""
    figure = Figure(figsize=(2.2 * len(names), 1.9), dpi=90, layout="constrained")
    for axes, name in zip(figure.subplots(1, len(names), squeeze=False)[0], names):
        steps, values = zip(
            *[(metrics.get("step"), metrics[name]) for metrics in history if name in metrics]
        )
        axes.plot(steps, values, marker="o" if len(steps) < 3 else None, markersize=3)
        for step in warned_steps:
            axes.axvline(step, color="red", linestyle=":", linewidth=1)
        axes.set_title(name, fontsize=9)
        axes.set_xlabel("step", fontsize=8)
        axes.tick_params(labelsize=7)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode()


def trajectory_groups(records):
    """[(step, group, members)] in the order written, at most MAX_GROUPS evenly
    spaced ones. A step written twice (a resumed run re-runs the steps after its
    checkpoint) shows its last writing."""
    groups = {}
    for record in records:
        key = (record.get("step"), record.get("group"))
        groups[key] = [] if record.get("member") == 0 else groups.get(key, [])
        groups[key].append(record)
    keys, count = list(groups), min(len(groups), MAX_GROUPS)
    return [
        (*key, groups[key])
        for key in (keys[i * (len(keys) - 1) // max(1, count - 1)] for i in range(count))
    ]


def report_html(run_dir):
    """The page for a run (or eval) directory: it says what is missing, never fails."""
    run_dir, problems = Path(run_dir), []
    args_file = run_dir / "args.json"
    args = json.loads(args_file.read_text()) if args_file.is_file() else {}
    history = read_jsonl(run_dir / "metrics.jsonl", problems)
    records = read_jsonl(run_dir / TRAJECTORIES, problems)
    last_step = max([metrics.get("step", 0) for metrics in history], default=0)
    if args.get("steps") and last_step < args["steps"]:
        problems.append(
            f"step {last_step} of {args['steps']} logged: the run is still going, or stopped early"
        )
    fired = {}  # signal -> the steps it warned at ("unnamed": a run from before names)
    for metrics in history:
        signals = metrics.get("echo_trap_warnings") or []
        for signal in signals if isinstance(signals, list) else ["unnamed"]:
            fired.setdefault(signal, []).append(metrics.get("step"))
    warned = sorted({step for steps in fired.values() for step in steps})
    # A curve at 0 every step is left out and named (often 0 by construction).
    logged = {name for metrics in history for name in metrics}
    flat = [name for names in CURVES.values() for name in names
            if name in logged and all(metrics.get(name, 0) == 0 for metrics in history)]
    plotted = {title: [name for name in names if name in logged and name not in flat]
               for title, names in CURVES.items()}
    curves = {
        title: curves_png(history, names, warned) for title, names in plotted.items() if names
    }
    return TEMPLATE.render(
        page=True, run_dir=run_dir.resolve().name, args=args, problems=problems,
        curves=curves, fired=fired, flat=flat,
        evals=[
            (metrics.get("step"), metrics["eval_success"])
            for metrics in history if "eval_success" in metrics
        ],
        wall_s=max([metrics.get("elapsed_s", 0) for metrics in history], default=None),
        groups=trajectory_groups(records),
        group_count=len({(record.get("step"), record.get("group")) for record in records})
    )


def trajectories_html(records):
    """Some trajectory records side by side, as HTML (a notebook: IPython's HTML)."""
    return TEMPLATE.render(page=False, groups=[(None, None, records)])


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Write RUN_DIR/report.html: a run's curves and trajectories."
    )
    parser.add_argument(
        "run_dir", help="a directory train.py (--out_dir) or eval.py (--trajectories) wrote"
    )
    run_dir = Path(parser.parse_args(argv).run_dir)
    if not run_dir.is_dir():
        sys.exit(f"nanoagent.report: error: {run_dir} is not a directory")
    (run_dir / "report.html").write_text(report_html(run_dir))
    print(f"wrote {run_dir / 'report.html'}")


if __name__ == "__main__":
    main()
