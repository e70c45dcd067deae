"""nanoagent/report.py: the trajectory lines on a hand-made episode, the page on a hand-made run and on bad
input, and the page of a real run as a browser shows it (headless chromium)."""

import html
import json
import os
import re
import shutil
import subprocess

import pytest

import envs
import rollout
import train
from nanoagent import models, report
from nanoagent.sampler import Generation

DEMO = envs.SyntheticQAEnv(hops=2, max_turns=4, process_reward=0.1)


class ReplaySampler:
    """Every episode writes the k-th of `turns` on its k-th turn, ending it with <|im_end|>."""

    def __init__(self, tokenizer, turns):
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.replies, self.calls = [rollout.encode(tokenizer, text) + [end_of_turn] for text in turns], 0

    def generate(self, prompts, max_new_tokens, **sampling):
        reply, self.calls = self.replies[self.calls], self.calls + 1
        return [Generation(reply, [-0.5] * len(reply), "stop") for _ in prompts]


@pytest.fixture(scope="module")
def demo_group():
    """(tokenizer, two identical members of seed 0's group, their records at step 7 with made-up trainer rows)."""
    tokenizer = models.tiny_tokenizer()
    DEMO.reset(0)
    trajectories = rollout.rollout(ReplaySampler(tokenizer, DEMO.demonstration()), tokenizer,
                                   lambda: envs.SyntheticQAEnv(hops=2, max_turns=4, process_reward=0.1), [0], 2, 4,
                                   64, 1024)
    # The trainer's rows are (T-1,), aligned with token_ids[1:]: position t holds token t+1's number.
    advantages = [[0.001 * t for t in range(len(trajectory.token_ids) - 1)] for trajectory in trajectories]
    old_logprobs = [[-1.0] * len(row) for row in advantages]
    return tokenizer, trajectories, report.trajectory_records(trajectories, tokenizer, 7, advantages, old_logprobs)


def test_a_record_keeps_every_token_its_author_reward_and_each_turns_calls_and_answers(demo_group):
    tokenizer, (trajectory, _), records = demo_group
    record, tokens = records[0], records[0]["tokens"]
    assert [(r["step"], r["group"], r["member"], r["seed"]) for r in records] == [(7, 0, 0, 0), (7, 0, 1, 0)]
    assert record["score"] == pytest.approx(1.2) and record["success"] and not record["truncated"]
    assert tokens["id"] == trajectory.token_ids and "".join(tokens["text"]) == tokenizer.decode(trajectory.token_ids)
    prompt = trajectory.prompt_length
    assert tokens["author"] == ["prompt"] * prompt + [["env", "agent"][m] for m in trajectory.action_mask[prompt:]]
    assert tokens["author"][prompt] == "agent" and "env" in tokens["author"]
    # Rewards sit on each turn's last agent token and nowhere else.
    rewards = {position: reward for position, reward in enumerate(tokens["reward"]) if reward}
    assert rewards == dict(zip(trajectory.turn_end_positions, [0.1, 0.1, 1.0]))
    assert tokens["advantage"][:3] == [0.0, 0.0, 0.001]
    assert tokens["advantage"][-1] == round(0.001 * (len(tokens["id"]) - 2), 4)
    assert tokens["old_logprob"][0] == 0.0 and set(tokens["old_logprob"][1:]) == {-1.0}
    assert tokens["sampler_logprob"][prompt:prompt + 2] == [-0.5, -0.5] and tokens["sampler_logprob"][0] == 0.0
    first, last = record["turns"][0], record["turns"][-1]
    assert first["calls"] == [{"name": "search", "arguments": {"query": "Echo"}, "error": None}]
    assert first["answers"] == ["Echo: born in Daisy."] and first["reward"] == 0.1
    assert last == {"text": "<answer>Plum</answer>", "answers": [], "reward": 1.0, "calls": []}
    assert json.loads(json.dumps(records)) == records  # one JSON line each, as written


def hand_made_run(run_dir, records, steps=3, logged=3):
    """A run directory as train.py leaves it: args.json, `logged` steps of metrics (an Echo-Trap warning at
    step 3, held-out success at 0 and 3) and the records."""
    run_dir.mkdir(exist_ok=True)
    (run_dir / "args.json").write_text(json.dumps({"steps": steps, "env": "synthetic_qa"}))
    history = [{"step": 0, "eval_success": 0.25}]
    for step in range(1, logged + 1):
        history.append({"step": step, "reward": 0.1 * step, "success": 0.2, "turns": 2.0, "policy_loss": 0.01,
                        "group_reward_std": 0.3, "elapsed_s": 10.0 * step, "approx_kl": 0.0,
                        "echo_trap_warnings": ["collapse"] if step == 3 else []})
    history[-1]["eval_success"] = 0.75
    report.append_jsonl(run_dir / "metrics.jsonl", history)
    report.append_jsonl(run_dir / report.TRAJECTORIES, records)
    return run_dir


def test_the_page_of_a_hand_made_run(tmp_path, demo_group):
    _, _, records = demo_group
    page = report.report_html(hand_made_run(tmp_path / "run", records))
    assert "step 0: <b>0.250</b> · step 3: <b>0.750</b>" in page and "Wall time: 30 s" in page
    assert "Echo-Trap warning <b>collapse</b> at 1 step(s), from step 3" in page
    assert "Not plotted, 0 at every step: approx_kl (" in page  # GRPO's single update: flat by construction
    assert page.count('<img alt="') == 4  # outcome, behaviour, optimisation, signal
    assert page.count('class="trajectory ') == 2 and "step 7 · group 0 · 2/2 succeeded" in page
    assert '<code>search({"query": "Echo"})</code>' in page and "→ Echo: born in Daisy." in page
    assert "&lt;tool_call&gt;" in page and "<tool_call>" not in page  # the agent's text is text, never markup
    assert 'class="missing"' not in page
    # A resumed run writes a step again: the page shows the last writing, not both.
    report.append_jsonl(tmp_path / "run" / report.TRAJECTORIES, records)
    assert report.report_html(tmp_path / "run").count('class="trajectory ') == 2


@pytest.mark.parametrize("case, message", [
    ("empty", "no metrics.jsonl in this directory"),
    ("no trajectories", "no trajectories.jsonl in this directory"),
    ("half-written line", "trajectories.jsonl line 3 is not a complete JSON object (a run killed mid-write?)"),
    ("in progress", "step 2 of 10 logged: the run is still going, or stopped early"),
])
def test_bad_input_makes_a_page_that_says_what_is_missing(tmp_path, demo_group, case, message):
    _, _, records = demo_group
    run_dir = tmp_path / "run"
    if case == "empty":
        run_dir.mkdir()
    else:
        in_progress = case == "in progress"
        hand_made_run(run_dir, records, steps=10 if in_progress else 3, logged=2 if in_progress else 3)
    if case == "no trajectories":
        (run_dir / report.TRAJECTORIES).unlink()
    if case == "half-written line":
        with open(run_dir / report.TRAJECTORIES, "a") as file:
            file.write(json.dumps(records[0])[:100])
    report.main([str(run_dir)])
    page = (run_dir / "report.html").read_text()
    assert f'<div class="missing">{message}' in html.unescape(page)
    assert page.count('class="trajectory ') == (0 if case in ("empty", "no trajectories") else 2)
    with pytest.raises(SystemExit, match="is not a directory"):
        report.main([str(tmp_path / "nowhere")])


def test_the_notebook_view_is_the_pages_view(demo_group):
    _, _, records = demo_group
    view = report.trajectories_html(records[:1])
    assert view.count("<style>") == 1 and view.count('class="trajectory ') == 1 and "<html" not in view
    agent_tokens = re.findall(r'<span class="agent"[^>]*title="token', view)  # the legend's spans have no title
    assert len(agent_tokens) == records[0]["tokens"]["author"].count("agent")

# -----------------------------------------------------------------------------
# In a real browser: the report of a real (short) run


def chromium(*flags, timeout=120):
    """Run headless chromium (Debian's package, which CI installs); skip without it, fail in CI."""
    binary = shutil.which("chromium")
    if binary is None:
        message = "chromium is not installed (apt-get install chromium); CI always runs this test"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *flags],
                          capture_output=True, text=True, timeout=timeout, check=True).stdout


def test_a_real_runs_report_in_a_browser(tmp_path):
    # Two GRPO steps of the untrained tiny model: its turns are noise, so the env answers with format hints.
    run_dir = tmp_path / "run"
    train.main(["--warmup_steps", "0", "--steps", "2", "--prompts_per_step", "2", "--group_size", "3",
                "--max_turns", "2", "--max_new_tokens", "6", "--eval_every", "0", "--out_dir", str(run_dir)])
    report.main([str(run_dir)])
    last = [json.loads(line) for line in (run_dir / report.TRAJECTORIES).read_text().splitlines()][-3:]
    assert [(r["step"], r["member"]) for r in last] == [(2, 0), (2, 1), (2, 2)]
    # The page, with a script that records the colour the browser gave every token.
    probe = tmp_path / "probe.html"
    probe.write_text((run_dir / "report.html").read_text().replace("</body>", (
        "<script>for (const span of document.querySelectorAll('#view span.agent, #view span.env'))"
        " span.dataset.color = getComputedStyle(span).color;</script></body>")))
    dom = chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", probe.as_uri())
    sections = re.findall(r'<section class="group"( hidden="")?>(.*?)</section>', dom, re.S)
    assert len(sections) == 2 and [hidden for hidden, _ in sections] == [' hidden=""', ""]  # the last step shows
    assert dom.count('<img alt="') == 4  # the curves
    shown = sections[1][1].split('<div class="trajectory ')[1:]
    assert len(shown) == 3
    for record, card in zip(last, shown):  # every token of every member, in order, coloured by its author
        spans = re.findall(r'<span class="(agent|env)"[^>]*data-color="([^"]+)"[^>]*>(.*?)</span>', card, re.S)
        prompt = record["tokens"]["author"].count("prompt")
        assert [(author, html.unescape(text)) for author, _, text in spans] == list(
            zip(record["tokens"]["author"][prompt:], record["tokens"]["text"][prompt:]))
        assert {(author, color) for author, color, _ in spans} == {("agent", "rgb(11, 61, 145)"),
                                                                   ("env", "rgb(119, 119, 119)")}
    screenshot = tmp_path / "report.png"
    chromium(f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={screenshot}", "--window-size=1200,1600",
             (run_dir / "report.html").as_uri())
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
