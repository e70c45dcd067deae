"""bench/bench_train.py: --profile's table, on a short Bandit run (its warm-up cached with test_train's); and
bench/bench_trl.py's profile of TRL's step, on a stand-in trainer (TRL is a benchmark-only dependency)."""

import sys
import time
from pathlib import Path

import pytest
import torch

import rollout
import train
from tests.test_train import BANDIT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_train  # noqa: E402
import bench_trl  # noqa: E402


def test_profile_adds_up_to_the_timed_steps_and_names_their_parts():
    profile = bench_train.new_profile()
    with bench_train.profiling(profile, bench_train.step_parts(profile)):
        bench_train.timed_run(BANDIT, 3)
    assert rollout.rollout.__name__ == "rollout" and not hasattr(train.token_logprobs, "__wrapped__")  # undone
    total = profile["end"] - profile["start"]  # the third step, timed alone
    table = bench_train.profile_table(profile, total)
    top = {name: seconds for depth, name, seconds, _, _ in table if depth == 0}
    for part in ["1. rollout (rollout.rollout)", "2. collate (masks.collate)", "5. update: policy backward",
                 "5. update: policy forward (token_logprobs)", "5. update: policy optimizer step", "7. end_of_step"]:
        assert top[part] > 0, part
    assert sum(top.values()) == pytest.approx(total) and top["other"] >= 0  # the parts fit in the wall time
    assert all(seconds >= 0 for _, _, seconds, _, _ in table)  # and what a part calls fits in the part
    turns = [name for depth, name, _, _, _ in table if depth == 1 and "sampler.generate" in name]
    assert turns == ["turn 1: sampler.generate (16.0 episodes)"]  # one turn of 4 prompts x 4 samples


class StandInAccelerator:
    def clip_grad_norm_(self, parameters, max_norm):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


class StandInTrainer:
    """Calls its methods as a GRPOTrainer step does: the first turn, then the tool loop's turns, inside the
    generation; the rewards; the loss, its backward pass, clipping through the accelerator, the optimizer step."""

    def __init__(self):
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.optimizer = torch.optim.SGD([self.weight], lr=0.1)
        self.accelerator = StandInAccelerator()

    def _generate_and_score_completions(self, prompts):
        self._generate(prompts)
        self._calculate_rewards(prompts)

    def _generate(self, prompts):
        self._generate_single_turn(prompts)
        self._tool_call_loop(prompts)

    def _generate_single_turn(self, prompt_ids):
        time.sleep(0.001)

    def _tool_call_loop(self, prompts):
        self._generate_single_turn(prompts[:3])  # the episodes that called a tool
        self._generate_single_turn(prompts[:1])

    def _calculate_rewards(self, prompts):
        return [0.0] * len(prompts)

    def compute_loss(self):
        return (self.weight ** 2).sum()

    def step(self):
        self._generate_and_score_completions(list(range(8)))
        self.compute_loss().backward()
        self.accelerator.clip_grad_norm_([self.weight], 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()


def test_trl_profile_times_the_steps_after_the_first_two_and_nests_the_tool_loops_turns():
    profile, trainer = bench_train.new_profile(), StandInTrainer()
    with bench_train.profiling(profile, bench_trl.trl_parts(profile, StandInTrainer, StandInAccelerator)):
        for _ in range(bench_train.TIMED_FROM + 2):
            trainer.step()
    assert not hasattr(StandInTrainer._generate, "__wrapped__")  # undone
    total = profile["end"] - profile["start"]
    table = bench_train.profile_table(profile, total, per=2)
    assert [(depth, name, calls) for depth, name, _, calls, _ in table] == [
        (0, "1-4. generate and score (_generate_and_score_completions)", 1),  # once a timed step: two, not four
        (1, "rollout (_generate)", 1),
        (2, "turn 1: generate (_generate_single_turn) (8.0 episodes)", 1),
        (2, "tool-call loop (_tool_call_loop)", 1),
        (3, "turn 2: generate (_generate_single_turn) (3.0 episodes)", 1),
        (3, "turn 3: generate (_generate_single_turn) (1.0 episodes)", 1),
        (3, "rest", None), (2, "rest", None),
        (1, "rewards (_calculate_rewards)", 1), (1, "rest", None),
        (0, "5. update: policy forward and loss (compute_loss)", 1), (0, "5. update: policy backward", 1),
        (0, "5. update: clip gradients", 1), (0, "5. update: policy optimizer step", 1), (0, "other", None)]
    assert sum(seconds for depth, _, seconds, _, _ in table if depth == 0) == pytest.approx(total / 2)
    assert all(seconds >= 0 for _, _, seconds, _, _ in table)
