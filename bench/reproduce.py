"""
Reproduce the papers' findings at laptop scale: Agent-R1's table, RAGEN's Echo Trap and rollout shaping, the
action-mask ablation, and which signals lead a collapse (RAGEN-2), on the tiny model, on CPU. One command per
study (docs/papers.md):

    python bench/reproduce.py agent_r1        # GRPO / PPO / REINFORCE++ vs Base Tool Call, Naive RAG, No Retrieval
    python bench/reproduce.py echo_trap       # vanilla GRPO and PPO vs StarPO-S and --on_echo_trap stabilize
    python bench/reproduce.py shaping         # responses per prompt at 64 trajectories a step; Online-k
    python bench/reproduce.py mask_ablation   # the loss on agent tokens only, or on every token
    python bench/reproduce.py collapse_signals --seeds 8   # which logged signal leads a collapse, and the rescue
    python bench/reproduce.py games --seeds 5  # FrozenLake (and slippery), Sokoban: GRPO vs GiGPO vs PPO
    python bench/reproduce.py all             # all six, one after another
    python bench/reproduce.py agent_r1 --quick   # tiny settings: checks the pipeline in a minute (the notebook test)

Every method of a study gets the same budget (steps x trajectories per step) and the same seeds. Seeds vary the
RL run (sampling, batches); all runs of a study start from one warmed-up model (sft.py, cached), so the spread
is the RL's own. Each study writes runs/reproduce/<study>/: table.md (mean ± standard deviation over seeds, the
paper's numbers beside ours), results.json (every run's numbers) and PNG plots. A finished run is kept under
runs/reproduce/runs/ and not trained again, so an interrupted study continues where it stopped.
"""
import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

import envs  # noqa: E402
import eval as evaluation  # noqa: E402
import train  # noqa: E402

# The papers' headline numbers, printed beside ours.
AGENT_R1 = {"PPO": 0.3719, "REINFORCE++": 0.3300, "GRPO": None, "Naive RAG": 0.1328, "Base Tool Call": 0.0847,
            "No Retrieval": None}  # average EM over the multi-hop QA sets (Agent-R1, Table 2)
RAGEN_COLLAPSE = "GRPO collapsed near step 20 on Bandit, PPO near step 100; StarPO-S delayed or removed it (RAGEN)"
RAGEN_SHAPING = "4 responses per prompt generalised best and 1-2 worst; Online-1 beat reusing a batch (RAGEN)"

EVALUATIONS = Path("runs/reproduce/evaluations.json")  # held_out's memory (main() puts it under --out)


def warm_model():
    """The warmed-up checkpoint every study starts from: the main job's (synthetic QA, train.py's default warm-up),
    trained once, then cached by sft.py."""
    return str(train.starting_weights(train.get_args([])))


def run(out, name, flags, seed, steps, save_every=None, start_from=None):
    """One training run, or its saved result: {"history": train.main's per-step metrics, "checkpoint": path}.
    start_from: a checkpoint directory to continue from (--resume), as a branch of that run."""
    run_dir = out / "runs" / f"{name}-seed{seed}"
    result_file = run_dir / "result.json"
    if result_file.exists():
        return json.loads(result_file.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts over
    if start_from:
        shutil.copytree(start_from, run_dir / Path(start_from).name)
        flags = flags + ["--resume"]
    started = time.time()
    _, history = train.main(flags + ["--warmup_steps", "0", "--steps", str(steps), "--seed", str(seed),
                                     "--save_every", str(save_every or steps), "--out_dir", str(run_dir)])
    result = {"history": history, "checkpoint": str(run_dir / f"step_{steps:06d}"), "seconds": time.time() - started}
    result_file.write_text(json.dumps(result))
    return result


def held_out(model, env, env_options, episodes, setting="tools", temperature=1.0, max_total_tokens=512):
    """eval.py's row for `model` on held-out seeds: success, EM, F1, ... Sampled at temperature 1 by default, as
    training and train.py's held-out evaluation sample: the tiny model's greedy choice flips between nearly tied
    names after a few updates (the warmed-up model: 0% greedy, 2% sampled; 4 GRPO steps later: 62% and 3%).
    Remembered in EVALUATIONS (a JSON file), so a study run again only evaluates what is new."""
    key = json.dumps([str(model), env, env_options, episodes, setting, temperature]
                     + ([max_total_tokens] if max_total_tokens != 512 else []))
    saved = json.loads(EVALUATIONS.read_text()) if EVALUATIONS.exists() else {}
    if key not in saved:
        saved[key] = evaluate_now(model, env, env_options, episodes, setting, temperature, max_total_tokens)
        EVALUATIONS.write_text(json.dumps(saved, indent=1))
    return saved[key]


def evaluate_now(model, env, env_options, episodes, setting, temperature, max_total_tokens=512):
    """held_out without the memory."""
    sampler, tokenizer = evaluation.make_sampler("torch", model, max_total_tokens=max_total_tokens)
    make_env = envs.env_factory(env, env_options)
    return evaluation.evaluate(sampler, tokenizer, lambda: evaluation.SETTINGS[setting](make_env()),
                               envs.eval_seeds(episodes), temperature=temperature, max_new_tokens=32,
                               max_total_tokens=max_total_tokens, progress=False)


def spread(values):
    """'mean ± sd' over seeds (sd 0 for one value)."""
    values = [value for value in values if value is not None]
    if not values:
        return "-"
    return f"{statistics.fmean(values):.3f} ± {statistics.pstdev(values):.3f}"


def training_success(history):
    """The per-step training success of a run's history (held-out evaluations are entries of their own)."""
    return [h["success"] for h in history if "success" in h]


def collapse_step(history, window=5, drop=0.5, floor=0.2):
    """The first step at which training success, averaged over `window` steps, falls below `drop` x its best
    earlier average (after the best reached `floor`): RAGEN's collapse, read off the reward curve. None: none."""
    success = training_success(history)
    best = 0.0
    for end in range(window, len(success) + 1):
        average = statistics.fmean(success[end - window:end])
        if best >= floor and average < drop * best:
            return end
        best = max(best, average)
    return None


def write_table(path, title, header, rows, notes=()):
    """A markdown table, with notes under it."""
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    path.write_text("\n".join(lines + [""] + [f"- {note}" for note in notes]) + "\n")
    print(path.read_text())


def plot_curves(path, curves, keys, mark_warnings=False):
    """One panel per metric key, one line per run, a colour per method (a collapse is one seed's event, which a
    mean over seeds would hide); with mark_warnings, an x where the Echo-Trap monitor warned in that run."""
    figure, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for axis, key in zip(axes[0], keys):
        for colour, (method, histories) in enumerate(curves.items()):
            for seed, history in enumerate(histories):
                steps = [h for h in history if "grad_norm" in h]  # training steps only
                axis.plot([h["step"] for h in steps], [h[key] for h in steps], color=f"C{colour}", linewidth=0.8,
                          label=method if seed == 0 else None)
                if mark_warnings:
                    warned = [h for h in steps if h.get("echo_trap_warnings")]
                    axis.plot([h["step"] for h in warned], [h[key] for h in warned], "x", color=f"C{colour}",
                              markersize=4)
        axis.set_title(key)
        axis.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def agent_r1(out, seeds, steps, episodes):
    """Agent-R1's table on synthetic multi-hop QA (2 hops, and 3 hops as the harder setting)."""
    model = warm_model()
    results, rows = {}, []
    for label, options in (("2 hops", {}), ("3 hops", {"hops": 3})):
        env_flags = ["--model", model, "--env_options", json.dumps(options)]
        def scores(checkpoint, setting="tools"):  # sampled, as in training, and greedy
            return {**held_out(checkpoint, "synthetic_qa", options, episodes, setting),
                    "greedy_em": held_out(checkpoint, "synthetic_qa", options, episodes, setting,
                                          temperature=0.0)["em"]}
        table = [("Base Tool Call (warmed up, before RL)", scores(model)), ("Naive RAG", scores(model, "naive_rag")),
                 ("No Retrieval", scores(model, "no_retrieval"))]
        curves = {}
        for algo, paper_name in (("grpo", "GRPO"), ("ppo", "PPO"), ("reinforce_pp", "REINFORCE++")):
            runs = [run(out, f"agent_r1-{label.replace(' ', '')}-{algo}",
                        env_flags + ["--algo", algo, "--eval_every", "0"], seed, steps) for seed in seeds]
            table.append((paper_name, [scores(r["checkpoint"]) for r in runs]))
            curves[paper_name] = [r["history"] for r in runs]
        results[label] = {name: score for name, score in table}
        for name, score in table:
            per_seed = score if isinstance(score, list) else [score]
            paper = AGENT_R1.get(name.split(" (")[0])
            rows.append((label, name, spread([s["em"] for s in per_seed]), spread([s["f1"] for s in per_seed]),
                         spread([s["greedy_em"] for s in per_seed]), "-" if paper is None else f"{paper:.4f}"))
        plot_curves(out / f"agent_r1_{label.replace(' ', '')}.png", curves, ["success", "entropy"])
    write_table(out / "table.md", f"Agent-R1 on synthetic multi-hop QA: held-out EM and F1 ({episodes} episodes, "
                f"sampled at temperature 1) after {steps} RL steps, {len(seeds)} seeds",
                ["setting", "method", "EM", "F1", "greedy EM", "paper EM"], rows,
                ["baselines use the warmed-up model, so they have no seed spread",
                 "paper EM: average over Agent-R1's multi-hop QA sets, Qwen2.5-3B"])
    return results


def echo_trap(out, seeds, steps, episodes):
    """RAGEN's Echo Trap on the main job (2-hop QA) with PPO's usual mini-batches: vanilla GRPO and PPO, StarPO-S,
    and PPO with --on_echo_trap stabilize."""
    # Each step's 64 trajectories serve 4 updates of 16 (as RAGEN's and verl's PPO mini-batches do), the only change
    # from train.py's defaults. With one update a step, 1 PPO run of 5 collapsed within 100 steps, none of 3 GRPO runs;
    # four updates a step move the policy further from the one that sampled, and collapses come within 60 steps.
    common = ["--model", warm_model(), "--minibatch_size", "16", "--eval_every", "0"]
    methods = {"GRPO": ["--algo", "grpo"], "PPO": ["--algo", "ppo"], "StarPO-S (PPO)": ["--starpo_s"],
               "PPO + on_echo_trap stabilize": ["--algo", "ppo", "--on_echo_trap", "stabilize"]}
    curves, rows, results = {}, [], {}
    for method, flags in methods.items():
        name = "echo_trap-qa-" + method.split(" ")[0] + ("-stabilize" if "stabilize" in method else "")
        runs = [run(out, name, common + flags, seed, steps) for seed in seeds]
        histories = [r["history"] for r in runs]
        curves[method] = histories
        collapses = [collapse_step(history) for history in histories]
        first_warnings = [next((h["step"] for h in history if h.get("echo_trap_warnings")), None)
                          for history in histories]
        last = [statistics.fmean(training_success(history)[-10:]) for history in histories]
        finals = [held_out(r["checkpoint"], "synthetic_qa", {}, episodes)["success"] for r in runs]
        results[method] = {"collapse_step": collapses, "first_warning": first_warnings, "last_10_steps_success": last,
                           "held_out_success": finals}
        rows.append((method, spread(finals), spread(last), ", ".join(str(c) if c else "none" for c in collapses),
                     ", ".join(str(w) if w else "none" for w in first_warnings)))
    plot_curves(out / "echo_trap.png", curves, ["success", "group_reward_std", "entropy", "grad_norm"],
                mark_warnings=True)
    write_table(out / "table.md", f"Echo Trap on synthetic QA: {steps} steps of 8 prompts x 8, 4 updates of 16 a step, "
                f"{len(seeds)} seeds", ["method", "held-out success", "training success, last 10 steps",
                                       "collapse step per seed", "first monitor warning per seed"], rows,
                [RAGEN_COLLAPSE,
                 "collapse: the 5-step training success falls below half its best (once that reached 0.2)"])
    return results


def shaping(out, seeds, steps, episodes):
    """RAGEN's rollout shaping with PPO: responses per prompt at 64 trajectories a step, then Online-k."""
    model = warm_model()
    transfer = {"distractor_facts": 3}  # the variant: the same questions, a knowledge base with more noise
    ppo = ["--model", model, "--algo", "ppo", "--eval_every", "0"]
    # (row label, results key, run name, flags, rollout steps): responses per prompt at 64 trajectories a step,
    # then Online-k, where each rollout batch of 32 serves k updates of 32 (the same number of updates in all).
    setups = [(f"{prompts} prompts x {group}", f"{prompts}x{group}", f"shaping-{prompts}x{group}",
               ["--prompts_per_step", str(prompts), "--group_size", str(group)], steps)
              for prompts, group in ((64, 1), (32, 2), (16, 4), (8, 8), (4, 16))]
    for k in (1, 2, 4):
        rollouts = max(1, steps // k)  # --quick's 2 steps still make one rollout
        setups.append((f"Online-{k} ({rollouts} rollouts x {k} updates)", f"online-{k}", f"online-{k}",
                       ["--prompts_per_step", "8", "--group_size", "4", "--ppo_epochs", str(k)], rollouts))
    rows, results = [], {}
    for label, key, name, flags, run_steps in setups:
        runs = [run(out, name, ppo + flags, seed, run_steps) for seed in seeds]
        own = [held_out(r["checkpoint"], "synthetic_qa", {}, episodes)["success"] for r in runs]
        moved = [held_out(r["checkpoint"], "synthetic_qa", transfer, episodes)["success"] for r in runs]
        results[key] = {"held_out": own, "transfer": moved}
        rows.append((label, spread(own), spread(moved)))
    write_table(out / "table.md", f"Rollout shaping (PPO, synthetic QA, {steps} updates, {len(seeds)} seeds)",
                ["rollout", "held-out success", f"transfer success ({json.dumps(transfer)})"], rows,
                [RAGEN_SHAPING, "64 trajectories a step for the responses-per-prompt rows; 32 for Online-k"])
    return results


def mask_ablation(out, seeds, steps, episodes):
    """The action mask: GRPO's loss on the agent's tokens only (the default), or on every token."""
    model = warm_model()
    rows, results, curves = [], {}, {}
    for name, flags in (("agent tokens only (action mask)", []),
                        ("every token (--no_action_mask)", ["--no_action_mask"])):
        runs = [run(out, "mask-" + ("off" if flags else "on"), ["--model", model, "--eval_every", "0", *flags],
                    seed, steps) for seed in seeds]
        scores = [held_out(r["checkpoint"], "synthetic_qa", {}, episodes) for r in runs]
        curves[name] = [r["history"] for r in runs]
        results[name] = scores
        rows.append((name, spread([s["em"] for s in scores]), spread([s["f1"] for s in scores])))
    plot_curves(out / "mask_ablation.png", curves, ["success", "entropy"])
    write_table(out / "table.md", f"Action-mask ablation (GRPO, synthetic QA, {steps} steps, {len(seeds)} seeds)",
                ["loss on", "EM", "F1"], rows,
                ["Agent-R1 and Search-R1: masking the environment's tokens is what makes it train"])
    return results


# -----------------------------------------------------------------------------
# Which signals lead a collapse: each signal train.py logs, with the direction that warns and a threshold fitted
# on one set of seeds, then counted on fresh ones (docs/papers.md, "Which signals lead a collapse").

SIGNALS = {"retrieval_accuracy": -1, "mutual_information": -1, "zero_variance_groups": +1,  # metric -> +1: a rise
           "response_tokens_change": +1, "turns_change": -1, "void_turns": +1, "invalid_call_rate": +1,  # warns,
           "approx_kl_max": +1, "clip_fraction_max": +1, "logprob_mismatch": +1, "grad_norm": +1,  # -1: a fall
           "group_reward_std": -1, "entropy": -1}
SMOOTH, FIRST_STEP = 3, 6  # 3-step means, from step 6 (the first means are noise)


def signal_steps(history, key):
    """[(step, the SMOOTH-step mean of `key` up to it)] for the training steps from FIRST_STEP on."""
    values = [h[key] for h in history if "grad_norm" in h]  # training steps (held-out evaluations have their own)
    return [(end, statistics.fmean(values[end - SMOOTH:end])) for end in range(FIRST_STEP, len(values) + 1)]


def first_firing(history, key, threshold):
    """The first step at which `key`'s mean is past `threshold` in its warning direction; None: never."""
    return next((step for step, value in signal_steps(history, key) if SIGNALS[key] * (value - threshold) > 0), None)


def lead_record(collapses, firings):
    """Per run its collapse step and first firing (None: none). A collapse is caught when the signal fired before
    it (the lead: how many steps before); a firing in a run that does not collapse is a false alarm."""
    leads = [c - f for c, f in zip(collapses, firings) if c is not None and f is not None and f < c]
    return {"collapses": sum(c is not None for c in collapses), "caught": len(leads), "leads": leads,
            "healthy": sum(c is None for c in collapses),
            "false_alarms": sum(c is None and f is not None for c, f in zip(collapses, firings))}


def fit_threshold(histories, collapses, key):
    """The threshold on `key`, among the values these runs took, with the best Youden's J (the share of collapses
    caught minus the share of healthy runs alarmed), fewer false alarms breaking ties; of the equally good, the
    middle one, as far from both kinds of error as these runs allow. Returns (threshold, J)."""
    def score(threshold):
        record = lead_record(collapses, [first_firing(h, key, threshold) for h in histories])
        return (record["caught"] / max(record["collapses"], 1) - record["false_alarms"] / max(record["healthy"], 1),
                -record["false_alarms"])
    values = sorted({value for history in histories for _, value in signal_steps(history, key)}) or [0.0]
    scores = {value: score(value) for value in values[::max(1, len(values) // 200)]}
    top = [value for value, result in scores.items() if result == max(scores.values())]
    return top[len(top) // 2], scores[top[len(top) // 2]][0]


def describe(record):
    """'caught / collapses, lead median (range); false alarms / healthy' for a table cell."""
    leads = record["leads"]
    lead = f", lead {statistics.median(leads):g} ({min(leads)}-{max(leads)})" if leads else ""
    return f"{record['caught']}/{record['collapses']}{lead}; {record['false_alarms']}/{record['healthy']} false"


def branch(out, source, at, flags, seed, steps, response):
    """Continue the run `source` from its checkpoint at step `at`, with `--on_echo_trap response`: two branches
    from one checkpoint (same weights, optimizer, RNG) differ by the response (and CPU float noise)."""
    return run(out, f"{Path(source).name}-from{at}-{response}", flags + ["--on_echo_trap", response], seed, steps,
               start_from=Path(source) / f"step_{at:06d}")


def ragen_rules(history, window=5):
    """RAGEN's own rules, as train.py's monitor had them when this study ran: the `window`-step mean in-group
    reward std below 0.2x its peak while success < 0.9, or the gradient norm above 10x its median of 20 steps."""
    smoothed = lambda key, end: statistics.fmean(h[key] for h in history[max(0, end - window):end])
    if len(history) >= 2 * window:
        peak = max(smoothed("group_reward_std", end) for end in range(window, len(history) + 1))
        now = smoothed("group_reward_std", len(history))
        if peak > 0.05 and now < 0.2 * peak and smoothed("success", len(history)) < 0.9:
            return True
    recent = [h["grad_norm"] for h in history[-21:-1]]
    median = statistics.median(recent) if len(recent) >= 10 else 0.0
    return median > 1e-6 and history[-1]["grad_norm"] > 10 * median


def ragen_rules_firing(history):
    """The first step at which RAGEN's rules (ragen_rules) fire; None: never."""
    steps = [h for h in history if "grad_norm" in h]
    return next((end for end in range(1, len(steps) + 1) if ragen_rules(steps[:end])), None)


def collapse_signals(out, seeds, steps, episodes):
    """Which logged signal leads a collapse: the Echo-Trap setting (the main job, 4 updates of 16 a step) with
    vanilla GRPO, PPO and StarPO-S; thresholds fitted on `seeds`, counted on as many fresh seeds and at 3x the lr;
    then the rescue, from the checkpoint where the best signal fired, continued with and without the response."""
    common = ["--model", warm_model(), "--minibatch_size", "16", "--eval_every", "0"]
    methods = {"GRPO": ["--algo", "grpo"], "PPO": ["--algo", "ppo"], "StarPO-S": ["--starpo_s"]}
    settings = {"main": [], "lr3": ["--lr", "3e-3"]}  # the main job, and at 3x its learning rate
    fresh = [seed + len(seeds) for seed in seeds]

    def histories(setting, seed_list, save_every=steps):  # {method: [history per seed]}
        return {method: [run(out, f"signals-{setting}-{method}", common + settings[setting] + flags, seed, steps,
                             save_every)["history"] for seed in seed_list] for method, flags in methods.items()}
    by_method = {"fit": histories("main", seeds), "fresh": histories("main", fresh, save_every=1),  # to branch
                 "lr3": histories("lr3", seeds)}
    sets = {name: [h for runs in groups.values() for h in runs] for name, groups in by_method.items()}
    fitting, collapses = sets["fit"], {name: [collapse_step(h) for h in runs] for name, runs in sets.items()}
    rows, results = [("RAGEN's rules (train.py's monitor before)", "-", "-", *(describe(lead_record(
        collapses[name], [ragen_rules_firing(h) for h in runs])) for name, runs in sets.items()))], {}
    for key in SIGNALS:
        threshold, j = fit_threshold(fitting, collapses["fit"], key)
        records = {name: lead_record(collapses[name], [first_firing(h, key, threshold) for h in runs])
                   for name, runs in sets.items()}
        results[key] = {"threshold": threshold, "j_fit": j, **records}
        rows.append((key, f"{'>' if SIGNALS[key] > 0 else '<'} {threshold:.3g}", f"{j:.2f}",
                     *(describe(record) for record in records.values())))
    notes = []  # what became of each method's runs
    for name, groups in by_method.items():
        for method, runs in groups.items():
            success = [training_success(history) for history in runs]
            notes.append(f"{name}, {method}: {sum(collapse_step(h) is not None for h in runs)} of {len(runs)} "
                         f"collapsed, {sum(max(s) < 0.2 for s in success)} never passed 0.2 training success; "
                         f"last 10 steps {spread([statistics.fmean(s[-10:]) for s in success])}")
    # The rescue: from each fresh main-job run's checkpoint at the step the best signal fired, on twice.
    best = max(results, key=lambda key: (results[key]["j_fit"], statistics.fmean(results[key]["fit"]["leads"] or [0])))
    pairs, fired_at = [], lambda source: first_firing(json.loads((source / "result.json").read_text())["history"],
                                                      best, results[best]["threshold"])
    for seed in fresh:
        for method, flags in methods.items():
            source = out / "runs" / f"signals-main-{method}-seed{seed}"
            fired = fired_at(source)
            if results[best]["j_fit"] <= 0 or fired is None or fired >= steps:
                continue  # no signal beats chance on the fitting seeds, or this one never fired
            branches = {response: branch(out, source, fired, common + flags, seed, steps, response)
                        for response in ("warn", "stabilize")}
            lr = branches["warn"]["history"][0]["lr"]  # the branch that only warns keeps its learning rate
            acted = next((h["step"] for h in branches["stabilize"]["history"] if h.get("lr", lr) < lr), None)
            pairs.append({"run": source.name, "fired": fired, "acted": acted, **{response: {
                "collapse_step": collapse_step(result["history"]), "seconds": result["seconds"],
                "held_out_success": held_out(result["checkpoint"], "synthetic_qa", {}, episodes)["success"]}
                for response, result in branches.items()}})
    results["rescue"] = {"signal": best, "pairs": pairs}
    would_collapse = [pair for pair in pairs if pair["warn"]["collapse_step"] is not None]
    notes.append(f"rescue, --on_echo_trap stabilize on {best}: it fired in {len(pairs)} fresh runs; of the "
                 f"{len(would_collapse)} whose branch without the response collapsed, "
                 f"{sum(pair['stabilize']['collapse_step'] is None for pair in would_collapse)} did not with it")
    for pair in pairs:
        notes.append(f"rescue, {pair['run']} from step {pair['fired']} (stabilize acted at step {pair['acted']}): "
                     + "; ".join(
            f"{response}: collapse step {pair[response]['collapse_step']}, held-out success "
            f"{pair[response]['held_out_success']:.3f}, {pair[response]['seconds']:.0f} s"
            for response in ("warn", "stabilize")))
    write_table(out / "table.md", f"Which signals lead a collapse ({steps} steps, 4 updates of 16 a step; GRPO, PPO, "
                f"StarPO-S x {len(seeds)} seeds a set)", ["signal (3-step mean)", "fires when", "J (fit)",
                f"fit: main job, seeds {seeds[0]}-{seeds[-1]}", f"fresh: seeds {fresh[0]}-{fresh[-1]}",
                f"fresh: lr 3e-3, seeds {seeds[0]}-{seeds[-1]}"], rows,
                ["each cell: collapses caught ahead / collapses, lead in steps median (range); false alarms / "
                 "runs that did not collapse", "collapse: the 5-step training success falls below half its best",
                 *notes])
    return results


GAMES = {"FrozenLake": ("frozen_lake", {}), "FrozenLake, slippery": ("frozen_lake", {"slippery": True}),
         "Sokoban": ("sokoban", {})}
CREDIT = {"GRPO": ["--algo", "grpo"], "GiGPO": ["--algo", "gigpo"], "PPO (GAE)": ["--algo", "ppo"]}
RAGEN_GAMES = ("RAGEN (Qwen2.5-0.5B, its harder levels): StarPO-S ~20% on Sokoban, ~22% on FrozenLake; "
               "SFT on BFS expert data 74.6% on Sokoban")


def evaluations(history):
    """[(step, held-out success)] of a run's history."""
    return [(h["step"], h["eval_success"]) for h in history if "eval_success" in h]


def first_step_at(history, level):
    """The first evaluated step whose held-out success reaches `level` (None: never)."""
    return next((step for step, success in evaluations(history) if success >= level), None)


def optimal_success(env_options, episodes):
    """The optimal policy's chance on the held-out slippery maps, within the env's turns of one move
    each (value iteration): the ceiling."""
    total = 0.0
    for seed in envs.eval_seeds(episodes):
        lake = envs.FrozenLakeEnv(**env_options)
        lake.reset(seed)
        total += lake.reach_probabilities(lake.max_turns)[0][lake.start]
    return total / episodes


def games(out, seeds, steps, episodes):
    """RAGEN's games from their bare commands' recipes: GRPO vs GiGPO vs PPO over seeds, each seed's
    runs from its own warm-up; the SFT-only row warms up on correct demonstrations alone (its
    clean and flawed phases both correct)."""
    results, rows, curves = {}, [], {}
    for game, (env, options) in GAMES.items():
        env_flags = ["--env", env, "--env_options", json.dumps(options), "--eval_every", "10",
                     "--eval_episodes", str(episodes)]
        def warm_up(seed, *flags):
            return str(train.warm_up(train.get_args(env_flags + ["--seed", str(seed), *flags])))
        runs = {}  # seed by seed, each seed's methods together: a study cut short has whole seeds
        for seed in seeds:
            for method, flags in CREDIT.items():
                name = f"games-{env}{'-slippery' if options else ''}-{flags[1]}"
                runs[method, seed] = run(out, name, env_flags + flags + ["--model", warm_up(seed)],
                                         seed, steps)
        # two seeds: a warm-up costs as much as an RL run
        clean = [warm_up(seed, "--warmup_mistake_rate", "0") for seed in seeds[:2]]
        args = train.get_args(env_flags)
        sft_only = [held_out(model, env, {**options, "max_turns": args.max_turns}, episodes,
                             max_total_tokens=args.max_total_tokens)["success"] for model in clean]
        results[game] = {"SFT only (correct demonstrations)": {"held_out_success": sft_only}}
        rows.append((game, "SFT only (correct demonstrations)", "-", spread(sft_only), "-", "-", "-",
                     "-"))
        for method in CREDIT:
            histories = [runs[method, seed]["history"] for seed in seeds]
            curves.setdefault(game, {})[method] = histories
            starts = [evaluations(h)[0][1] for h in histories]
            finals = [evaluations(h)[-1][1] for h in histories]
            results[game][method] = {"start": starts, "final": finals, "evaluations":
                                     [evaluations(h) for h in histories], "seconds_per_step":
                                     [runs[method, seed]["seconds"] / steps for seed in seeds],
                                     "anchor_group_size":
                                     [statistics.fmean(h["anchor_group_size"] for h in history
                                                       if "anchor_group_size" in h)
                                      for history in histories]}
        grpo_final = statistics.fmean(results[game]["GRPO"]["final"])
        for method in CREDIT:
            record, histories = results[game][method], curves[game][method]
            record["steps_to_grpo_final"] = [first_step_at(h, grpo_final) for h in histories]
            climbed = sum(final > start for start, final in zip(record["start"], record["final"]))
            rows.append((game, method, spread(record["start"]), spread(record["final"]),
                         f"{climbed} of {len(seeds)}",
                         ", ".join(str(s) if s else "-" for s in record["steps_to_grpo_final"]),
                         spread(record["anchor_group_size"]), spread(record["seconds_per_step"])))
        if options.get("slippery"):
            results[game]["optimal"] = optimal_success(options, episodes)
    plot_games(out / "games.png", curves)
    notes = [RAGEN_GAMES, "steps to GRPO's final: the first evaluation (every 10 steps) at or above "
             "GRPO's mean held-out success at the last step; '-': never"]
    if "optimal" in results.get("FrozenLake, slippery", {}):
        notes.append("slippery FrozenLake, the optimal policy on the same maps (the ceiling): "
                     f"{results['FrozenLake, slippery']['optimal']:.3f}")
    write_table(out / "table.md", f"RAGEN's games: {steps} steps of 8 levels x 8, {len(seeds)} seeds, "
                f"held-out success over {episodes} levels", ["game", "method", "step 0", f"step {steps}",
                                                             "RL climbed", "steps to GRPO's final",
                                                             "anchor group size", "s / step"],
                rows, notes)
    return results


def plot_games(path, curves):
    """Held-out success per step, one panel per game, one line per run, a colour per method."""
    figure, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.2), squeeze=False)
    for axis, (game, methods) in zip(axes[0], curves.items()):
        for colour, (method, histories) in enumerate(methods.items()):
            for seed, history in enumerate(histories):
                steps, success = zip(*evaluations(history))
                axis.plot(steps, success, color=f"C{colour}", linewidth=0.8,
                          label=method if seed == 0 else None)
        axis.set_title(game)
        axis.set_xlabel("step")
        axis.set_ylim(0, 1)
    axes[0][0].set_ylabel("held-out success")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


STUDIES = {"agent_r1": (agent_r1, 40), "echo_trap": (echo_trap, 60), "shaping": (shaping, 40),
           "mask_ablation": (mask_ablation, 40), "collapse_signals": (collapse_signals, 60),
           "games": (games, 60)}


def main(argv=None):
    """Run the studies named on the command line; returns {study: results}."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=[*STUDIES, "all"])
    parser.add_argument("--seeds", type=int, default=3, help="RL seeds per method")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the study's own)")
    parser.add_argument("--episodes", type=int, default=256, help="held-out episodes per evaluation")
    parser.add_argument("--out", default="runs/reproduce")
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 2 steps, 8 episodes: the pipeline, not the findings")
    args = parser.parse_args(argv)
    global EVALUATIONS
    EVALUATIONS = Path(args.out) / "evaluations.json"
    if args.quick:
        args.seeds, args.steps, args.episodes = 1, args.steps or 2, 8
    results = {}
    for name in STUDIES if args.study == "all" else [args.study]:
        study, default_steps = STUDIES[name]
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        started = time.time()
        results[name] = study(out, list(range(args.seeds)), args.steps or default_steps, args.episodes)
        results[name]["wall_s"] = time.time() - started
        (out / "results.json").write_text(json.dumps(results[name], indent=1))
        print(f"{name}: {results[name]['wall_s']:.0f} s; wrote {out}")
    return results


if __name__ == "__main__":
    main()
