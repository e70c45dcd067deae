"""bench/bench_train.py: --profile's table, on a short Bandit run (its warm-up cached with test_train's)."""

import sys
from pathlib import Path

import pytest

import rollout
import train
from tests.test_train import BANDIT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_train  # noqa: E402


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
