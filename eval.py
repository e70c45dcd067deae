"""
Evaluate trained agents, run the papers' baselines, and chat with an agent in the terminal.

    python eval.py --model tiny --env synthetic_qa --n 64   # one model, greedy
    python eval.py --model Qwen/Qwen2.5-3B-Instruct --model runs/ppo/step_000200 \
        --model runs/grpo/step_000200 --env search_qa --data hotpotqa --split held-out \
        --n 512 --baselines --json results.json
    python eval.py --model runs/grpo/step_000200 --env calculator \
        --temperature 0 1.0 --samples 8   # + pass@1..8
    python eval.py --chat --model tiny --env synthetic_qa --seed 3   # Ctrl-D or "exit" ends

Evaluation. rollout.rollout, training's loop, plays held-out seeds (envs.eval_seeds;
rows of --split for search_qa) with the settings training plays (resolve_settings): a
run's checkpoint is evaluated as the run evaluated itself, and gives its number. Each
(model, setting, temperature) is a row of the numbers training logs (rollout.summarize)
and pass@k for k = 1, 2, 4, ... up to --samples: the unbiased 1 - C(n-c, k) / C(n, k)
from n samples per seed with c successes (Codex paper). Temperature 0 is greedy. One
process, no torchrun.

Baselines (Agent-R1's table), rows --baselines adds for every model, tool envs only:
  tools         the plain row: Base Tool Call when the model is the untrained one
  naive_rag     one search with the question, its passages in the prompt of one turn
                without tools (on synthetic_qa, an exact name lookup, no retrieval:
                the point of a multi-hop task)
  no_retrieval  the question alone, answered in one turn without tools

Chat. The user's messages replace the env's question; the tools are --env's for
--seed. The agent's calls run live, token in, token out, until it writes none.
"""
import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

import envs
import rollout
import tools
from nanoagent import common, models
from nanoagent.checkpoint import load_trainer_state
from nanoagent.common import UserError
from nanoagent.parallel import sums_over_ranks
from nanoagent.report import TRAJECTORIES, append_jsonl, trajectory_records
from nanoagent.sampler import TorchSampler

# -----------------------------------------------------------------------------
# Metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples, drawn without replacement from n with c correct, is
    correct)."""
    assert 0 <= c <= n and 1 <= k <= n, f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}"
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(samples: int) -> list[int]:
    return sorted({2 ** i for i in range(samples.bit_length()) if 2 ** i < samples} | {samples})


def table_row(trajectories: list) -> dict:
    """The table's row (module docstring) of trajectories, as many per seed each."""
    successes = defaultdict(list)  # env seed -> success of each sample
    for trajectory in trajectories:
        successes[trajectory.seed].append(bool(trajectory.info["success"]))
    samples = {len(flags) for flags in successes.values()}
    assert len(samples) == 1, f"every seed needs the same number of samples, got {samples}"
    row = {"episodes": len(trajectories), **rollout.summarize(trajectories)}
    for k in pass_ks(samples.pop()):
        row[f"pass@{k}"] = statistics.fmean(
            pass_at_k(len(flags), sum(flags), k) for flags in successes.values()
        )
    return row


def format_table(rows: list[dict]) -> str:
    """Rows of (model, setting, temperature, metrics) as an aligned table; None prints "-"."""
    ks = sorted(
        {key for row in rows for key in row if key.startswith("pass@")},
        key=lambda key: int(key[5:]),
    )
    columns = [
        "model", "setting", "temp", "episodes", "success", "em", "f1", "reward", "turns",
        "tool_calls", "invalid_call_rate", "truncated", "no_answer", *ks,
    ]
    headers = {
        "tool_calls": "calls", "invalid_call_rate": "invalid", "truncated": "trunc",
        "no_answer": "no ans", "em": "EM", "f1": "F1",
    }

    def cell(value, column):
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) and column != "temp" else str(value)
    table = [[headers.get(column, column) for column in columns]]
    table += [[cell(row.get(column), column) for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join(
        "  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in table
    )

# -----------------------------------------------------------------------------
# Baselines: the same task with the tools taken away


class BaselineEnv:
    """Agent-R1's baselines of a ToolEnv: one turn, no tools, its question and scoring
    (retrieve=True: naive RAG)."""

    def __init__(self, env: envs.ToolEnv, retrieve: bool):
        assert isinstance(env, envs.ToolEnv), f"baselines need a tool env, got {type(env).__name__}"
        self.env, self.retrieve, self.max_turns = env, retrieve, 1

    def reset(self, seed: int, member: int = 0) -> tuple[list[dict], list[dict]]:
        """The env's episode for `seed`, with a tool-free prompt (for naive RAG, passages)."""
        self.env.reset(seed, member)
        question = self.env.question
        if self.retrieve:
            assert "search" in self.env.tools, (
                f"naive RAG needs a search tool, {type(self.env).__name__} has none"
            )
            call = tools.ToolCall("search", {"query": question})
            passages, _ = tools.run_tool_call(call, self.env.tools)
            question = f"Passages:\n{passages}\n\nQuestion: {question}"
        # From here a tool call is invalid (unknown tool), and the first turn the last.
        self.env.tools, self.env.max_turns = {}, 1
        think = envs.THINK_INSTRUCTION if self.env.require_think else ""
        system = envs.ToolEnv.system_prompt + think
        return [{"role": "system", "content": system}, {"role": "user", "content": question}], []

    def step(self, assistant_text: str) -> envs.StepResult:
        return self.env.step(assistant_text)


SETTINGS = {
    "tools": lambda env: env, "naive_rag": lambda env: BaselineEnv(env, retrieve=True),
    "no_retrieval": lambda env: BaselineEnv(env, retrieve=False),
}

# -----------------------------------------------------------------------------
# Evaluation and chat


def evaluate(
    sampler, tokenizer, make_env, seeds, samples=1, temperature=0.0, max_new_tokens=256,
    max_total_tokens=4096, seeds_per_batch=64, sample_seed=0, progress=True, save_as=None,
) -> dict:
    """table_row() of `samples` episodes per seed from rollout.rollout (batched by
    seeds). save_as=(directory, label): also append them to directory/trajectories.jsonl."""
    assert temperature > 0 or samples == 1, (
        "greedy decoding (temperature 0) gives identical samples: use --samples 1"
    )
    seeds, trajectories = list(seeds), []
    max_turns = make_env().max_turns
    starts = range(0, len(seeds), seeds_per_batch)
    for start in tqdm(starts, desc="eval batches", disable=not progress):
        batch = rollout.rollout(
            sampler, tokenizer, make_env, seeds[start:start + seeds_per_batch], samples,
            max_turns, max_new_tokens, max_total_tokens,
            temperature=temperature, sample_seed=sample_seed,
        )
        # group ids numbered across batches
        trajectories += [dataclasses.replace(t, group_id=start + t.group_id) for t in batch]
    if save_as:
        records = trajectory_records(trajectories, tokenizer, save_as[1])
        append_jsonl(Path(save_as[0]) / TRAJECTORIES, records)
    return table_row(trajectories)


def evaluate_held_out(sampler, tokenizer, args, rank=0, world_size=1, device="cpu", server=None):
    """train.py's held-out evaluation under its settings `args`: success rate and mean score at
    the training temperature, over all ranks; with a `server`, the --agent program plays (a
    failed episode is left out)."""
    # search_qa, math: rows of the held-out split (envs.read_rows: each dataset's own)
    seeds = list(envs.eval_seeds(args.eval_episodes, args.env))[rank::world_size]
    if server is not None:
        trajectories = server.play(
            args.agent, seeds, 1, args.agent_timeout, sample_seed=args.seed + 1
        )
    else:
        make_env = envs.env_factory(
            args.env, args.env_options, data=args.data, split="held-out"
        )
        trajectories = rollout.rollout(
            sampler, tokenizer, make_env, seeds, 1, args.max_turns, args.max_new_tokens,
            args.max_total_tokens, temperature=args.temperature, sample_seed=args.seed + 1,
        )
    successes, score, count = sums_over_ranks([
        sum(t.info["success"] for t in trajectories), sum(t.score for t in trajectories),
        len(trajectories),
    ], device)
    return {"eval_success": successes / count, "eval_score": score / count}


# chat in a terminal: agent green, tools grey
AGENT_COLOR, ENV_COLOR, RESET = "\033[32m", "\033[90m", "\033[0m"


def chat(
    sampler, tokenizer, env, seed=0, max_turns=4, max_new_tokens=256, max_total_tokens=4096,
    temperature=0.0, read=input, color=False,
):
    """The module docstring's chat, until read() raises EOFError (Ctrl-D) or returns
    "exit"/"quit". Any sampler with generate() (tests script one)."""
    agent_color, env_color, plain = (AGENT_COLOR, ENV_COLOR, RESET) if color else ("", "", "")
    messages, tool_schemas = env.reset(seed)
    tool_dict = getattr(env, "tools", {})
    question = messages[-1]["content"]
    print(f"tools: {', '.join(tool_dict) or 'none'}   (env question for seed {seed}: {question!r})")
    end_of_turn = tokenizer.convert_tokens_to_ids(rollout.END_OF_TURN)
    stop_token_ids = [tokenizer.convert_tokens_to_ids(token) for token in rollout.STOP_TOKENS]
    token_ids, turn = [], 0
    while True:
        try:
            user_text = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if user_text in ("exit", "quit"):
            return
        user = {"role": "user", "content": user_text}
        if token_ids:  # later messages: tokens after the last <|im_end|>, as observations are
            token_ids += rollout.observation_tokens(tokenizer, [user])
        else:
            token_ids = rollout.encode_chat(
                tokenizer, [messages[0], user], tool_schemas, add_generation_prompt=True
            )
        for step in range(max_turns):
            if len(token_ids) >= max_total_tokens:
                print(f"[context full: {len(token_ids)} tokens; start a new chat]")
                return
            generation = sampler.generate(
                [token_ids], min(max_new_tokens, max_total_tokens - len(token_ids)),
                temperature=temperature, stop_token_ids=stop_token_ids, seed=turn,
            )[0]
            turn += 1
            sampled, closing = rollout.close_turn(generation, end_of_turn)
            token_ids += generation.token_ids + closing  # as sampled, like rollout's trajectories
            text = tokenizer.decode(sampled)
            print(f"{agent_color}agent> {text}{plain}")
            action_text = envs.split_thinking(text)[1]
            calls = tools.parse_tool_calls(action_text, tool_dict) if tool_dict else []
            if not calls:
                break
            if step == max_turns - 1:  # no turn would follow: the chat must end on <|im_end|>
                limit = f"turn limit {max_turns} reached: these calls were not run"
                print(f"{env_color}  [{limit}]{plain}")
                break
            observations = []
            for call in calls:
                output, _ = tools.run_tool_call(call, tool_dict)
                arguments = json.dumps(call.arguments)
                print(f"{env_color}  [tool {call.name}({arguments})] -> {output}{plain}")
                observations.append({"role": "tool", "content": output})
            token_ids += rollout.observation_tokens(tokenizer, observations)

# -----------------------------------------------------------------------------
# Command line


def make_sampler(kind, model_name, max_total_tokens=4096, vllm_memory=0.5):
    """(sampler, tokenizer) for a model name or path: a vLLM engine (vllm_memory: its GPU
    share), or the model in this process."""
    if kind == "vllm":
        from nanoagent.sampler import VLLMSampler  # here: only where vLLM is installed
        path = models.resolve_model_path(model_name)
        # gpu_memory_utilization counts on a GPU only (a CPU's KV cache is bounded in bytes)
        sampler = VLLMSampler(
            path, gpu_memory_utilization=vllm_memory, max_model_len=max_total_tokens
        )
        return sampler, models.load_tokenizer(path)
    device = common.autodetect_device_type()
    dtype = common.autodetect_dtype(device)
    model, tokenizer = models.load_model(model_name, device=device, dtype=dtype)
    return TorchSampler(model), tokenizer


def get_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add = parser.add_argument
    # Models and sampling
    add("--model", action="append", required=True,
        help="HF name, checkpoint dir or .gguf file, 'tiny', 'tiny-deep' or 'smollm2-135m'; repeat")
    add("--sampler", choices=["torch", "vllm"], help="default: vllm on a GPU, else torch")
    add("--vllm_memory", type=float, default=0.5,
        help="--sampler vllm on GPUs: its share of the card's memory")
    add("--temperature", type=float, nargs="+",
        help="0 = greedy; several give several rows (default: the run's, else 0)")
    add("--samples", type=int, default=1, help="samples per seed when sampling (pass@k up to this)")
    add("--max_new_tokens", type=int, help="per assistant turn (default: as training)")
    add("--max_total_tokens", type=int, help="per episode (default: as training)")
    add("--seeds_per_batch", type=int, default=64,
        help="seeds per rollout() call (x samples episodes)")
    add("--sample_seed", type=int,
        help="seeds the sampling (default: as the run evaluated, else 0)")
    # Environment and data
    add("--env", choices=sorted(envs.ENVS), help="default: the run's, else synthetic_qa")
    add("--env_options", type=common.json_object,
        help='JSON constructor options, e.g. \'{"hops": 3}\'')
    add("--max_turns", type=int, help="default: as training")
    add("--data",
        help="search_qa, math: Hub name, local dataset directory or .json/.jsonl/.parquet "
        "(default: the run's, else hotpotqa)")
    add("--split", default="held-out",
        help="search_qa, math: held-out is the dataset's own (envs.read_rows; a local file: "
        "its held-out share), or a split's name ('all': every row)")
    add("--n", type=int, help="evaluation seeds (search_qa: rows; default: the run's, else 256)")
    add("--seed_start", type=int, help="default: envs.eval_seeds's, as training evaluates")
    # Output and modes
    add("--baselines", action="store_true", help="add naive_rag and no_retrieval rows per model")
    add("--json", help="also write the rows to this JSON file")
    add("--trajectories", help="also write every episode to this directory's trajectories.jsonl, "
        "as train.py does (python -m nanoagent.report DIR shows them)")
    add("--chat", action="store_true", help="talk to the first model with --env's tools for --seed")
    add("--seed", type=int, default=0, help="chat: the env seed whose tools (KB) are used")
    return resolve_settings(parser.parse_args(argv))


# eval.py's flags that a run's checkpoint sets, from the run's settings
RUN_SETTINGS = {
    "env": "env", "env_options": "env_options", "data": "data", "max_new_tokens": "max_new_tokens",
    "max_total_tokens": "max_total_tokens", "temperature": "temperature", "n": "eval_episodes",
}


def resolve_settings(args):
    """The settings once, as train.py resolves a run's: the flags given; then, when --model is
    a run's checkpoint, the run's own (its trainer state), as it evaluated itself; then the
    env's defaults (envs.run_defaults)."""
    runs = [
        load_trainer_state(model)["args"] for model in args.model
        if (Path(model) / "trainer_state.pt").is_file()
    ]
    run = runs[0] if runs else {}
    for flag, key in RUN_SETTINGS.items():
        if getattr(args, flag) is None and runs:
            if any(other[key] != run[key] for other in runs):
                raise UserError(
                    f"the --model checkpoints come from runs with other {key} settings: "
                    f"pass --{flag}, or evaluate them one at a time"
                )
            value = run[key]
            setattr(args, flag, [value] if flag == "temperature" else value)
    args.env = args.env or "synthetic_qa"
    defaults = envs.run_defaults(args.env)
    args.max_new_tokens = args.max_new_tokens or defaults["max_new_tokens"]
    args.max_total_tokens = args.max_total_tokens or defaults["max_total_tokens"]
    args.temperature = args.temperature or [0.0]
    args.n = args.n or 256
    args.data = args.data or "hotpotqa"
    if args.sample_seed is None:
        args.sample_seed = run["seed"] + 1 if run else 0  # evaluate_held_out's
    args.env_options = {"max_turns": defaults["max_turns"], **(args.env_options or {})}
    if args.max_turns is not None:
        args.env_options["max_turns"] = args.max_turns
    args.max_turns = args.env_options["max_turns"]
    if args.seed_start is None:
        args.seed_start = envs.eval_seeds(0, args.env).start
    return args


def table_settings(args, make_env, seeds) -> list[str]:
    """The rows' settings: "tools", and with --baselines those the env allows."""
    settings = ["tools"]
    if args.baselines:
        probe = make_env()
        assert isinstance(probe, envs.ToolEnv), (
            f"--baselines needs a tool env, {args.env} is a game"
        )
        probe.reset(seeds[0])
        settings += (["naive_rag"] if "search" in probe.tools else []) + ["no_retrieval"]
    return settings


def main(argv=None):
    args = get_args(argv)
    if args.trajectories:
        Path(args.trajectories).mkdir(parents=True, exist_ok=True)
    on_gpu = common.autodetect_device_type() == "cuda"
    sampler_kind = args.sampler or ("vllm" if on_gpu else "torch")
    print(f"settings: {json.dumps(vars(args))}")
    make_env = envs.env_factory(args.env, args.env_options, data=args.data, split=args.split)
    if args.chat:
        sampler, tokenizer = make_sampler(
            sampler_kind, args.model[0], args.max_total_tokens, args.vllm_memory
        )
        chat(
            sampler, tokenizer, make_env(), args.seed, args.max_turns, args.max_new_tokens,
            args.max_total_tokens, args.temperature[0], color=sys.stdout.isatty(),
        )
        return
    seeds = range(args.seed_start, args.seed_start + args.n)
    settings = table_settings(args, make_env, seeds)
    rows = []
    for model_name in args.model:
        sampler, tokenizer = make_sampler(
            sampler_kind, model_name, args.max_total_tokens, args.vllm_memory
        )
        for setting in settings:
            for temperature in args.temperature:
                samples = args.samples if temperature > 0 else 1
                label = f"{model_name} | {setting} | temperature {temperature}"
                print(f"{label} | {len(seeds)} seeds x {samples}")
                row = evaluate(
                    sampler, tokenizer, lambda: SETTINGS[setting](make_env()), seeds, samples,
                    temperature, args.max_new_tokens, args.max_total_tokens, args.seeds_per_batch,
                    args.sample_seed, save_as=args.trajectories and (args.trajectories, label),
                )
                rows.append({"model": model_name, "setting": setting, "temp": temperature, **row})
        del sampler  # free the model (or vLLM's memory) before the next one loads
        gc.collect()
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.json}")
    return args


if __name__ == "__main__":
    try:
        main()
    except UserError as error:  # bad input: the message says what to do, a traceback would not
        sys.exit(f"eval.py: error: {error}")
