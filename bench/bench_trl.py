"""
Benchmark: nanoagent's GRPO against TRL's GRPOTrainer, side by side, in one run on this machine.

Both train the same warmed-up tiny model (train.py's cached warm-up, loaded for both by nanoagent's load_model,
so both attend with the same kernels: models.sdpa_grouped) on the same synthetic multi-hop
QA env, with the same settings, read from train.py's defaults: the same env seeds in the same order
(8 prompts x 8 samples per step), at most 4 assistant turns of at most 32 tokens and 512 tokens per
episode, temperature 1, lr 1e-3 constant, AdamW betas (0.9, 0.99), gradient clipping 1.0, clip 0.2,
no KL, rewards scaled by the group's std, token-mean loss (TRL's "dapo"), one update per rollout, and
no gradient checkpointing (TRL's default turns it on; nanoagent recomputes nothing, so TRL runs without
it too: the same work, and TRL's faster setting on this model).

    pip install -r bench/requirements-bench.txt     # TRL is a benchmark-only dependency
    python bench/bench_trl.py                       # 3 seeds x (nanoagent, then TRL), 30 steps each
    python bench/bench_trl.py --steps 100 --rounds 1
    python bench/bench_trl.py --profile             # and each run's table of where its steps' time goes
    python bench/bench_trl.py --real --steps 6 --rounds 2   # SmolLM2-135M-Instruct on the calculator

How the env reaches TRL (its `environment_factory` interface, TRL >= 1.x):
  - `reset(seed=...)` receives the dataset row, whose prompt is the env's own opening messages;
  - `search(query)` is the env's search tool, as a documented method: TRL renders its schema from
    the docstring, and the script checks that the rendered prompt is token for token nanoagent's;
  - the reward function replays each finished completion through the env's `step()`, so rewards
    (outcome, -0.1 format penalty) and success are computed by the same code on both sides.
TRL's tool loop runs only while the model's turns parse as tool calls, so a turn that is neither a
call nor an answer, or a malformed call, ends its episode. nanoagent's env is run with
`end_on_format_error=True`, which ends its episodes at the same turns. (By default the env answers
such a turn with the error and lets the model retry, which learns this task more slowly: see the
docs/performance.md.) What still differs: a well-formed call with a wrong tool name or
argument is an error that ends nanoagent's episode, while TRL returns the error and goes on.

Each run is its own process, so that peak memory (the process's peak RSS) is its own. Reported per
framework: seconds per step and tokens per second over steps 3..N (the first two pay for start-up),
trajectory tokens per step (prompt + completion, tool results included), peak memory, the training
success rate of the last 5 steps, and the held-out success after the last step, measured for both by
the same evaluator (eval.evaluate_held_out: 128 held-out seeds, sampled at temperature 1). With --profile, each
run also prints where its timed steps' time goes, by bench_train.py's timers: nanoagent's parts as
`bench_train.py --profile` names them, TRL's by the GRPOTrainer methods a step calls (trl_parts).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the concept files live at the repository root
import envs  # noqa: E402
import eval as evaluation  # noqa: E402
import rollout  # noqa: E402
import tools  # noqa: E402
import train  # noqa: E402
from bench_train import (TIMED_FROM, new_profile, new_step, new_turn, peak_memory_mb, print_table,  # noqa: E402
                         profile_table, profiling, step_parts, timed_run)  # bench/ is this script's own folder
from nanoagent.models import load_model, load_tokenizer, resolve_model_path  # noqa: E402
from nanoagent.sampler import TorchSampler  # noqa: E402
from real_model_recipe import RECIPE  # noqa: E402


def bench_flags(seed, real=False):
    """train.py's flags for the benchmark: its defaults (real: the real model's recipe, RECIPE), with the
    env's episodes ending as TRL's do."""
    return [*(RECIPE if real else []), "--seed", str(seed),
            "--env_options", json.dumps({"end_on_format_error": True})]


class TRLEnv:
    """nanoagent's env in TRL's environment_factory shape: reset(**row), one documented method per tool
    (TRL renders the tool's schema from the method's docstring, and takes every public function of the
    class for a tool: the rest is private). _make_env: set by run_trl."""
    _make_env = None

    def __init__(self):
        self.env = type(self)._make_env()

    def reset(self, seed, **row):
        self.env.reset(seed)

    def _call(self, name, **arguments):
        return tools.run_tool_call(tools.ToolCall(name, arguments), self.env.tools)[0]


class SearchEnv(TRLEnv):
    def search(self, query: str):
        """Look up a name; returns the facts about it.

        Args:
            query: A name.
        """
        return self._call("search", query=query)


class CalculatorEnv(TRLEnv):
    def calculator(self, expression: str):
        """Evaluate an arithmetic expression with + - * / ** (or ^) and parentheses, e.g. (2.5 + 3) * -4.

        Args:
            expression: The arithmetic expression to evaluate.
        """
        return self._call("calculator", expression=expression)


TRL_ENVS = {"synthetic_qa": (SearchEnv, "search"), "calculator": (CalculatorEnv, "calculator")}


def held_out_success(model, tokenizer, args):
    """train.py's evaluation of `model`: the same seeds, sampler and settings for both frameworks."""
    sampler = TorchSampler(model, batch_size=32)
    return evaluation.evaluate_held_out(sampler, tokenizer, args, rank=0, world_size=1)["eval_success"]


def run_nanoagent(steps, seed, real, profile=None):
    """train.main for `steps` GRPO steps; returns the measurements. With a `profile` (bench_train.new_profile),
    the steps' parts are timed into it as `bench_train.py --profile` times them."""
    with profiling(profile, step_parts(profile)) if profile else contextlib.nullcontext():
        args, policy, history, seconds, tokens = timed_run(bench_flags(seed, real), steps)
    tokenizer = load_tokenizer(resolve_model_path(args.model))  # the warm-up keeps the model's own
    return {"seconds_per_step": seconds, "tokens_per_step": tokens,
            "train_success": statistics.fmean(h["success"] for h in history[-5:]),
            "eval_success": held_out_success(policy, tokenizer, args),
            "peak_memory_mb": peak_memory_mb()}


def split_turns(completion_text):
    """The assistant turns of a TRL completion: its text up to the first <|im_end|>, then the text of
    each later `<|im_start|>assistant` block (the blocks between are the tool responses)."""
    pieces = completion_text.split("<|im_start|>assistant\n")
    return [piece.split("<|im_end|>")[0] for piece in pieces]


def trl_parts(profile, trainer_class, accelerator_class):
    """(owner, attribute, label) of what a GRPOTrainer step calls, for bench_train's `profiling`, named like
    nanoagent's parts where the work is the same. The clock starts at the first timed step's generation."""
    def generate_and_score(*args, **kwargs):
        new_step(profile)
        return "1-4. generate and score (_generate_and_score_completions)"

    def generate(*args, **kwargs):
        profile["turn"] = 0
        return "rollout (_generate)"

    def turn(trainer, prompt_ids, *args, **kwargs):  # the first turn from _generate, later ones from the tool loop
        return new_turn(profile, "generate (_generate_single_turn)", len(prompt_ids))

    def loss(*args, **kwargs):
        profile.update(backward="5. update: policy backward", optimizer="5. update: policy optimizer step")
        return "5. update: policy forward and loss (compute_loss)"
    return [(trainer_class, "_generate_and_score_completions", generate_and_score),
            (trainer_class, "_generate", generate), (trainer_class, "_generate_single_turn", turn),
            (trainer_class, "_tool_call_loop", lambda *args, **kwargs: "tool-call loop (_tool_call_loop)"),
            (trainer_class, "_calculate_rewards", lambda *args, **kwargs: "rewards (_calculate_rewards)"),
            (trainer_class, "compute_loss", loss),
            (accelerator_class, "clip_grad_norm_", lambda *args, **kwargs: "5. update: clip gradients")]


def run_trl(steps, seed, real, profile=None):
    """TRL's GRPOTrainer for `steps` steps on the same model, env and settings; returns the measurements.
    With a `profile`, the steps' parts are timed into it (trl_parts)."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # environment_factory is marked experimental in TRL 1.x
    from accelerate import Accelerator
    from transformers import TrainerCallback
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as out_dir:
        args = train.get_args([*bench_flags(seed, real), "--steps", str(steps)])
        model, tokenizer = load_model(train.warm_up(args))  # float32, like train.py on CPU
        make_env = envs.env_factory(args.env, args.env_options, data=args.data, split="train")
        env_class, tool_name = TRL_ENVS[args.env]
        env_class._make_env = staticmethod(make_env)

        # train.py's seeds for steps 0..steps-1, in its order; TRL repeats each row group_size times.
        seeds = [step * args.prompts_per_step + i for step in range(steps) for i in range(args.prompts_per_step)]
        openings = [make_env().reset(seed) for seed in seeds]  # (messages, tool schemas)
        trl_tools = [getattr(env_class(), tool_name)]  # what TRL renders: the method, through its docstring
        prompt_lengths = {}
        for seed, (messages, schemas) in zip(seeds, openings):
            ours = rollout.render(tokenizer, messages, schemas, add_generation_prompt=True)
            theirs = rollout.render(tokenizer, messages, trl_tools, add_generation_prompt=True)
            assert ours == theirs, "TRL would see another prompt than nanoagent; the comparison would be unfair"
            prompt_lengths[seed] = len(rollout.encode_chat(tokenizer, messages, schemas, add_generation_prompt=True))
        dataset = Dataset.from_dict({"prompt": [messages for messages, _ in openings], "seed": seeds})

        step_log = {"successes": [], "tokens": 0, "per_step": []}  # filled by the reward function

        def env_reward(completion_ids, seed, **kwargs):
            """Replays each completion's assistant turns through a fresh env: nanoagent's own rewards."""
            rewards = []
            for ids, row_seed in zip(completion_ids, seed):
                env = make_env()
                env.reset(row_seed)
                total, success = 0.0, False
                for turn in split_turns(tokenizer.decode(ids, skip_special_tokens=False))[:args.max_turns]:
                    result = env.step(turn)
                    total, success = total + result.reward, result.info["success"]
                    if result.done:
                        break
                rewards.append(total)
                step_log["successes"].append(float(success))
                step_log["tokens"] += prompt_lengths[row_seed] + len(ids)
            return rewards

        class StepTimer(TrainerCallback):
            """Closes each step's record: when it ended, its tokens, its success rate."""

            def on_step_end(self, *_, **__):
                step_log["per_step"].append({"time": time.perf_counter(), "tokens": step_log["tokens"],
                                             "success": statistics.fmean(step_log["successes"])})
                step_log["successes"], step_log["tokens"] = [], 0

        config = GRPOConfig(
            output_dir=out_dir, max_steps=steps, seed=args.seed, use_cpu=not torch.cuda.is_available(), bf16=False,
            per_device_train_batch_size=args.prompts_per_step * args.group_size, gradient_accumulation_steps=1,
            num_generations=args.group_size, num_iterations=1, shuffle_dataset=False,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=args.grad_clip,
            beta=0.0, epsilon=args.clip_low, epsilon_high=args.clip_high, loss_type="dapo", scale_rewards="group",
            temperature=args.temperature, top_p=1.0, top_k=0,
            max_completion_length=args.max_total_tokens - max(prompt_lengths.values()),
            generation_kwargs={"max_new_tokens": args.max_new_tokens},  # per turn, like train.py
            max_tool_calling_iterations=args.max_turns - 1,  # at most max_turns assistant turns
            # TRL's default recomputes every activation in the backward pass to save memory; nanoagent does
            # not, so the same work is TRL without it (its best honest setting here, and its faster one).
            gradient_checkpointing=False,
            logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=False)
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=env_reward, args=config,
                              train_dataset=dataset, environment_factory=env_class, callbacks=[StepTimer()])
        with profiling(profile, trl_parts(profile, GRPOTrainer, Accelerator)) if profile else contextlib.nullcontext():
            trainer.train()
        per_step = step_log["per_step"]
        measured = per_step[2:]
        return {"seconds_per_step": (measured[-1]["time"] - per_step[1]["time"]) / len(measured),
                "tokens_per_step": statistics.fmean(s["tokens"] for s in measured),
                "train_success": statistics.fmean(s["success"] for s in per_step[-5:]),
                "eval_success": held_out_success(trainer.model, tokenizer, args),
                "peak_memory_mb": peak_memory_mb()}


def main():
    parser = argparse.ArgumentParser(description="nanoagent GRPO vs TRL GRPOTrainer, same model, env and settings")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (at least 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; round r runs nanoagent, then TRL, with train.py's default seed + r")
    parser.add_argument("--real", action="store_true",
                        help="SmolLM2-135M-Instruct on the calculator, from the real model's SFT warm-up, at its "
                        "recipe's settings (bench/real_model_recipe.py), instead of the tiny model on synthetic QA")
    parser.add_argument("--profile", action="store_true",
                        help="print where each run's timed steps go (the timers are on for both sides)")
    parser.add_argument("--worker", choices=["nanoagent", "trl"], help=argparse.SUPPRESS)  # one run, in a child
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # the worker's seed
    cli = parser.parse_args()
    if cli.steps < 3:
        parser.error("--steps must be at least 3: the first two steps are not timed")
    if cli.rounds < 1:
        parser.error("--rounds must be at least 1")
    if cli.worker:
        profile = new_profile() if cli.profile else None
        result = (run_nanoagent if cli.worker == "nanoagent" else run_trl)(cli.steps, cli.seed, cli.real, profile)
        if profile:  # the table's lines start with "|": the parent prints them
            total = profile["end"] - profile["start"]
            print_table(profile_table(profile, total, cli.steps - TIMED_FROM, 1000), "ms/step", "calls/step")
        print("RESULT " + json.dumps(result))
        return

    try:
        import trl
    except ImportError:
        sys.exit("TRL is not installed: pip install -r bench/requirements-bench.txt")
    results = {"nanoagent": [], "trl": []}
    # From train.py's default seed on, the seeds a newcomer's run meets; the real model's recipe from 0.
    first_seed = 0 if cli.real else train.get_args([]).seed
    for seed in range(first_seed, first_seed + cli.rounds):
        # Seed s: train.py's warm-up with seed s (cached, and done before any timing), then both RL runs
        # from it with seed s. Alternating the two spreads the machine's slow moments over both.
        args = train.get_args(bench_flags(seed, cli.real))
        model, tokenizer = load_model(train.warm_up(args))
        start = held_out_success(model, tokenizer, args)
        print(f"round {seed - first_seed + 1}/{cli.rounds} (seed {seed}): held-out success of the warm-up {start:.3f}",
              flush=True)
        for name in results:
            child = subprocess.run([sys.executable, __file__, "--worker", name, "--steps", str(cli.steps),
                                    "--seed", str(seed), *(["--profile"] if cli.profile else []),
                                    *(["--real"] if cli.real else [])],
                                   capture_output=True, text=True)
            lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
            if child.returncode != 0 or not lines:
                sys.exit(f"the {name} run failed:\n{child.stdout[-3000:]}\n{child.stderr[-3000:]}")
            results[name].append(json.loads(lines[-1].removeprefix("RESULT ")))
            print(f"  {name:9s} " + ", ".join(f"{key} {value:.3f}" for key, value in results[name][-1].items()),
                  flush=True)
            if cli.profile:
                print("\n".join(line for line in child.stdout.splitlines() if line.startswith("|")), flush=True)

    def median(name, key):
        return statistics.median(run[key] for run in results[name])

    task = "SmolLM2-135M-Instruct, calculator" if cli.real else "tiny model, synthetic QA"
    print(f"\n{task}, {args.prompts_per_step} prompts x {args.group_size} samples per step, "
          f"{cli.steps} steps, {torch.get_num_threads()} threads, torch {torch.__version__}, TRL {trl.__version__}; "
          f"median of {cli.rounds} seeds")
    print("| | seconds/step | steps/s | tokens/s | peak memory (MB) | train success (last 5 steps) "
          f"| held-out success after {cli.steps} steps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in results:
        seconds = median(name, "seconds_per_step")
        print(f"| {name} | {seconds:.2f} | {1 / seconds:.2f} | {median(name, 'tokens_per_step') / seconds:,.0f} "
              f"| {median(name, 'peak_memory_mb'):,.0f} | {median(name, 'train_success'):.3f} "
              f"| {median(name, 'eval_success'):.3f} |")
    speedup = median("trl", "seconds_per_step") / median("nanoagent", "seconds_per_step")
    print(f"nanoagent / TRL: {speedup:.1f}x the steps per second, "
          f"{median('nanoagent', 'peak_memory_mb') / median('trl', 'peak_memory_mb'):.2f}x the peak memory")


if __name__ == "__main__":
    main()
