"""Tests for eval.py: metrics on hand-made transcripts, the baselines, the multi-model table, chat."""
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import envs
import eval as evaluation
import rollout
import tools
import train
from nanoagent import models
from nanoagent.sampler import Generation, per_row

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    return models.tiny_tokenizer()


class ScriptedSampler:
    """Plays fixed assistant texts. `script(prompt_ids, seed)` returns the next text; the sampler
    encodes it, adds <|im_end|>, and remembers every prompt it was given."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.prompts = tokenizer, script, []

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=0):
        seeds = per_row(seed, len(prompts))
        generations = []
        for prompt, row_seed in zip(prompts, seeds):
            self.prompts.append(list(prompt))
            im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
            ids = rollout.encode(self.tokenizer, self.script(prompt, row_seed)) + [im_end]
            generations.append(Generation(ids, [0.0] * len(ids), "stop"))
        return generations

# -----------------------------------------------------------------------------
# Metrics


def test_pass_at_k_matches_brute_force_over_subsets():
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(outcomes[i] for i in subset) for subset in subsets) / len(subsets)
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    assert evaluation.pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the success rate
    assert evaluation.pass_ks(1) == [1] and evaluation.pass_ks(8) == [1, 2, 4, 8]
    assert evaluation.pass_ks(6) == [1, 2, 4, 6]


class QuizEnv(envs.ToolEnv):
    """Seed 0 asks for Paris, seed 1 for the Eiffel Tower; the calculator is the tool."""

    def new_task(self, rng):
        answers = {0: ["Paris"], 1: ["The Eiffel Tower"]}[self.seed]
        return f"Question {self.seed}?", answers, [tools.calculator_tool()]


def test_table_row_of_hand_made_transcripts_through_rollout(tokenizer):
    # (env seed, member) -> the assistant's turns; the episodes run through the real rollout() and env.
    transcripts = {
        (0, 0): ["<answer>paris</answer>"],  # EM 1, F1 1
        (0, 1): [envs.format_tool_call("calculator", {"expression": "2+2"}), "<answer>Lyon Paris</answer>"],  # F1 2/3
        (1, 0): ['<tool_call>{"name": "weather", "arguments": {}}</tool_call>', "<answer>Eiffel Tower</answer>"],
        (1, 1): ["I do not know.", "Still no idea."],  # no answer before the env's max_turns: not truncated
    }
    turn_of_seed = {rollout.sample_seed_for(0, seed, member, turn): (seed, member, turn)
                    for (seed, member) in transcripts for turn in range(2)}

    def script(prompt, sample_seed):
        seed, member, turn = turn_of_seed[sample_seed]
        return transcripts[seed, member][turn]
    sampler = ScriptedSampler(tokenizer, script)
    trajectories = rollout.rollout(sampler, tokenizer, lambda: QuizEnv(max_turns=2), [0, 1], group_size=2, max_turns=2,
                                   max_new_tokens=64, max_total_tokens=4096, sample_seed=0)
    row = evaluation.table_row(trajectories)
    # By hand: rewards 1.0 | 0.0 (ok call, wrong answer) | -0.1 (all calls invalid) + 1.0 | -0.1 - 0.1
    expected = {"episodes": 4, "success": 0.5, "em": 0.5, "f1": (1 + 2 / 3 + 1 + 0) / 4,
                "reward": (1.0 + 0.0 + 0.9 - 0.2) / 4, "reward_std": statistics.pstdev([1.0, 0.0, 0.9, -0.2]),
                "turns": (1 + 2 + 2 + 2) / 4, "tool_calls": 2 / 4, "invalid_call_rate": 1 / 2, "truncated": 0.0,
                "no_answer": 1 / 4, "prompt_too_long": 0.0, "pass@1": 0.5, "pass@2": 1.0,
                "void_turns": 2 / 4,  # the two turns with neither a call nor an answer
                "response_tokens": statistics.fmean(sum(t.action_mask) for t in trajectories),
                "trajectory_tokens": statistics.fmean(len(t.token_ids) for t in trajectories),
                "prompt_tokens": statistics.fmean(t.prompt_length for t in trajectories)}
    assert row.keys() == expected.keys()
    for key, value in expected.items():
        assert row[key] == pytest.approx(value), key


def test_format_table_has_a_row_per_entry_and_dashes_for_missing():
    rows = [{"model": "a", "setting": "tools", "temp": 0.0, "episodes": 2, "success": 0.5, "em": None, "f1": None,
             "reward": 0.25, "turns": 1.0, "tool_calls": 0.0, "invalid_call_rate": 0.0, "truncated": 0.0,
             "no_answer": 0.25, "pass@1": 0.5},
            {"model": "b", "setting": "tools", "temp": 1.0, "episodes": 4, "success": 1.0, "em": 1.0, "f1": 1.0,
             "reward": 1.0, "turns": 1.0, "tool_calls": 0.0, "invalid_call_rate": 0.0, "truncated": 0.0,
             "no_answer": 0.0, "pass@1": 1.0, "pass@2": 1.0}]
    lines = evaluation.format_table(rows).splitlines()
    assert lines[0].split() == ["model", "setting", "temp", "episodes", "success", "EM", "F1", "reward", "turns",
                                "calls", "invalid", "trunc", "no", "ans", "pass@1", "pass@2"]
    assert lines[1].split() == ["a", "tools", "0.0", "2", "0.500", "-", "-", "0.250", "1.000", "0.000", "0.000",
                                "0.000", "0.250", "0.500", "-"]
    assert lines[2].split()[:3] == ["b", "tools", "1.0"] and lines[2].split()[-1] == "1.000"

# -----------------------------------------------------------------------------
# Baselines


ROWS = [{"id": "0", "question": "Where was Ada Lovelace born?", "answers": ["London"],
         "supporting_titles": ["Ada Lovelace"],
         "paragraphs": [{"title": "Ada Lovelace", "text": "Ada Lovelace was born in London in 1815."},
                        {"title": "Rome", "text": "Rome is the capital of Italy."}]}]


def test_naive_rag_puts_the_envs_own_search_result_in_the_prompt_and_removes_the_tools():
    env = evaluation.BaselineEnv(envs.SearchQAEnv(ROWS), retrieve=True)
    messages, tool_schemas = env.reset(0)
    assert tool_schemas == [] and env.max_turns == 1
    expected = tools.search_tool(ROWS[0]["paragraphs"]).function(query=ROWS[0]["question"])
    assert expected.startswith("[1] Ada Lovelace\n")
    assert messages[1]["content"] == f"Passages:\n{expected}\n\nQuestion: {ROWS[0]['question']}"
    assert "search" not in messages[0]["content"]
    result = env.step("<answer>London</answer>")
    assert result.done and result.info["success"] and result.reward == 1.0


def test_no_retrieval_is_the_bare_question_and_a_tool_call_is_invalid_and_final():
    env = evaluation.BaselineEnv(envs.SearchQAEnv(ROWS), retrieve=False)
    messages, tool_schemas = env.reset(0)
    assert tool_schemas == [] and messages[1]["content"] == ROWS[0]["question"]
    result = env.step(envs.format_tool_call("search", {"query": "Ada"}))
    assert result.done and result.info["tool_calls"] == 1 and result.info["invalid_calls"] == 1
    assert "Lovelace" not in result.observations[0]["content"]  # the search did not run
    with pytest.raises(AssertionError, match="tool env"):
        evaluation.BaselineEnv(envs.BanditEnv(), retrieve=False)


def test_multi_model_table_with_baselines_end_to_end_on_tiny_checkpoints(tmp_path, capsys):
    model_a, model_b = models.save_tiny_model(tmp_path / "a", seed=0), models.save_tiny_model(tmp_path / "b", seed=1)
    out = tmp_path / "results.json"
    evaluation.main(["--model", str(model_a), "--model", str(model_b), "--env", "search_qa", "--data",
                     str(REPO / "tests" / "data" / "hotpotqa_sample.jsonl"), "--n", "2", "--max_new_tokens", "6",
                     "--max_turns", "2", "--trajectories", str(tmp_path / "episodes"),
                     "--baselines", "--json", str(out), "--sampler", "torch"])
    rows = json.loads(out.read_text())
    # Every episode in the report's format (nanoagent/report.py), labelled by its row.
    episodes = [json.loads(line) for line in (tmp_path / "episodes" / "trajectories.jsonl").read_text().splitlines()]
    assert [(e["step"], e["group"], e["member"]) for e in episodes] == [
        (f"{model} | {setting} | temperature 0.0", group, 0) for model in (model_a, model_b)
        for setting in ("tools", "naive_rag", "no_retrieval") for group in (0, 1)]
    assert all(e["tokens"]["advantage"] is None and len(e["tokens"]["id"]) == len(e["tokens"]["author"])
               for e in episodes)
    assert [(row["model"], row["setting"]) for row in rows] == [
        (str(model), setting) for model in (model_a, model_b) for setting in ("tools", "naive_rag", "no_retrieval")]
    for row in rows:
        assert row["episodes"] == 2 and 0.0 <= row["success"] <= 1.0 and row["temp"] == 0.0
        assert row["turns"] == 1.0 if row["setting"] != "tools" else 1.0 <= row["turns"] <= 2.0
    lines = capsys.readouterr().out.splitlines()
    table = lines[[line.split()[:2] for line in lines].index(["model", "setting"]):]
    assert sum(line.startswith(str(model_a)) for line in table) == 3
    assert sum(line.startswith(str(model_b)) for line in table) == 3

# A run's own settings: eval.py on a run's checkpoint plays the run's game, as the run evaluated itself


@pytest.mark.parametrize("env", sorted(name for name, env in envs.ENVS.items() if env.train_defaults))
def test_a_runs_checkpoint_evaluated_bare_gives_the_runs_last_held_out_number(env, tmp_path):
    # Random tiny weights (no warm-up), one RL step, then the checkpoint evaluated with no flag but --model: the
    # same seeds, turns, token budgets, temperature and sampling seeds give the same episodes, so the same numbers.
    _, history = train.main(["--env", env, "--warmup_steps", "0", "--steps", "1", "--prompts_per_step", "2",
                             "--group_size", "2", "--eval_every", "1", "--eval_episodes", "8", "--save_every", "1",
                             "--seed", "5", "--out_dir", str(tmp_path / "run")])
    out = tmp_path / "eval.json"
    args = evaluation.main(["--model", str(tmp_path / "run" / "step_000001"), "--json", str(out)])
    [row] = json.loads(out.read_text())
    defaults = envs.run_defaults(env)
    assert (args.env, args.max_turns) == (env, defaults["max_turns"])
    assert args.max_total_tokens == defaults["max_total_tokens"]
    assert (row["episodes"], row["temp"], args.sample_seed) == (8, 1.0, 6)
    assert row["success"] == history[-1]["eval_success"]
    # The same scores: the run sums them over ranks in floats, rollout.summarize takes their exact mean.
    assert row["reward"] == pytest.approx(history[-1]["eval_score"], rel=0, abs=1e-12)


def test_an_env_is_evaluated_in_the_settings_it_trains_in_and_flags_still_win():
    args = evaluation.get_args(["--model", "tiny", "--env", "sokoban"])  # SokobanEnv() alone plays 10 turns
    assert (args.max_turns, args.env_options["max_turns"]) == (5, 5)
    assert (args.max_new_tokens, args.max_total_tokens) == (32, 640)
    assert (args.temperature, args.n, args.sample_seed, args.seed_start) == ([0.0], 256, 0, envs.EVAL_SEED_START)
    args = evaluation.get_args(["--model", "tiny", "--env", "sokoban", "--max_turns", "3", "--max_new_tokens", "9"])
    assert (args.max_turns, args.env_options["max_turns"], args.max_new_tokens) == (3, 3, 9)
    assert evaluation.get_args(["--model", "tiny", "--env", "math"]).seed_start == 0  # row 0 of the held-out split
    args = evaluation.get_args(["--model", "tiny", "--env_options", '{"hops": 3}', "--max_turns", "2"])
    assert args.env_options == {"max_turns": 2, "hops": 3}

# -----------------------------------------------------------------------------
# Chat


def test_chat_runs_the_tool_live_and_keeps_tokens_in_tokens_out(tokenizer, monkeypatch, capsys):
    env = envs.SyntheticQAEnv(hops=1)
    env.reset(5)
    entity = env.hop_entities[0]
    fact = env.tools["search"].function(query=entity)
    replies = iter([envs.format_tool_call("search", {"query": entity}), f"<answer>{env.answers[0]}</answer>",
                    "Hi again."])
    sampler = ScriptedSampler(tokenizer, lambda prompt, seed: next(replies))
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Tell me about {entity}\nthanks\n"))  # then EOF (Ctrl-D)
    evaluation.chat(sampler, tokenizer, envs.SyntheticQAEnv(hops=1), seed=5)
    out = capsys.readouterr().out
    assert f'[tool search({{"query": "{entity}"}})] -> {fact}' in out
    assert f"agent> <answer>{env.answers[0]}</answer>" in out and "agent> Hi again." in out
    # Each prompt extends the previous one token by token: generation + observation tokens (tool, then user).
    first, second, third = sampler.prompts
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call_ids = rollout.encode(tokenizer, envs.format_tool_call("search", {"query": entity})) + [end]
    assert second == first + call_ids + rollout.observation_tokens(tokenizer, [{"role": "tool", "content": fact}])
    answer_ids = rollout.encode(tokenizer, f"<answer>{env.answers[0]}</answer>") + [end]
    assert third == second + answer_ids + rollout.observation_tokens(tokenizer, [{"role": "user", "content": "thanks"}])
    assert tokenizer.decode(first).endswith(f"Tell me about {entity}<|im_end|>\n<|im_start|>assistant\n")


def test_chat_command_line_with_the_tiny_model_exits_cleanly():
    result = subprocess.run([sys.executable, "eval.py", "--chat", "--model", "tiny", "--max_new_tokens", "8"],
                            input="hello\nexit\n", capture_output=True, text=True, cwd=REPO, env=os.environ,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tools: search" in result.stdout and "agent> " in result.stdout


def test_chat_at_the_turn_limit_does_not_run_calls_and_the_next_message_follows_the_agents_end_of_turn(
        tokenizer, capsys):
    call = envs.format_tool_call("search", {"query": "Kalo"})
    sampler = ScriptedSampler(tokenizer, lambda prompt, seed: call)
    lines = iter(["first", "second", "exit"])
    evaluation.chat(sampler, tokenizer, envs.SyntheticQAEnv(), seed=0, max_turns=1, read=lambda prompt: next(lines))
    out = capsys.readouterr().out
    assert out.count("these calls were not run") == 2 and "[tool search" not in out
    first, second = sampler.prompts
    call_ids = rollout.encode(tokenizer, call) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert second == first + call_ids + rollout.observation_tokens(tokenizer, [{"role": "user", "content": "second"}])


def test_vllm_memory_reaches_the_engine(monkeypatch):
    # --vllm_memory is the engine's gpu_memory_utilization, as in train.py (it was fixed at 0.5).
    import nanoagent.sampler
    options = {}
    monkeypatch.setattr(nanoagent.sampler, "VLLMSampler", lambda path, **given: options.update(given))
    evaluation.make_sampler("vllm", "tiny", 512, vllm_memory=0.7)
    assert options == {"gpu_memory_utilization": 0.7, "max_model_len": 512}
