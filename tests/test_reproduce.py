"""bench/reproduce.py: the collapse detector and the table's numbers on hand-made histories (the studies themselves
run, in their --quick versions, when notebook 05 is executed by test_notebooks.py)."""

import sys
from pathlib import Path

import pytest

from tests.conftest import import_or_skip_outside_ci

import_or_skip_outside_ci("matplotlib")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import reproduce  # noqa: E402


def history(successes):
    return [{"step": 0, "eval_success": 0.1}] + [{"step": i + 1, "success": s, "grad_norm": 1.0}
                                                 for i, s in enumerate(successes)]


def test_collapse_step_is_the_first_window_below_half_the_best():
    # 5-step means: 0.3 up to step 9, then the window ending at step 12 averages (0.3 + 0.3 + 0 + 0 + 0) / 5 = 0.12.
    assert reproduce.collapse_step(history([0.3] * 9 + [0.0] * 6)) == 12
    assert reproduce.collapse_step(history([0.3] * 9 + [0.2] * 6)) is None  # 0.2 > 0.5 x 0.3: a dip, not a collapse
    assert reproduce.collapse_step(history([0.15] * 5 + [0.0] * 10)) is None  # never learned: nothing to collapse from
    assert reproduce.collapse_step(history([0.0] * 5 + [0.9] * 10)) is None  # learned and stayed


def test_spread_is_mean_and_population_sd_over_seeds():
    assert reproduce.spread([0.2, 0.4]) == "0.300 ± 0.100"
    assert reproduce.spread([0.5]) == "0.500 ± 0.000"
    assert reproduce.spread([None, 0.5]) == "0.500 ± 0.000" and reproduce.spread([]) == "-"


def test_a_quick_study_trains_evaluates_and_writes_its_table(tmp_path):
    results = reproduce.main(["mask_ablation", "--quick", "--out", str(tmp_path)])["mask_ablation"]
    assert set(results) == {"agent tokens only (action mask)", "every token (--no_action_mask)", "wall_s"}
    table = (tmp_path / "mask_ablation" / "table.md").read_text()
    assert table.count("\n| ") == 3 and "± 0.000" in table  # header and two rows; one seed, so no spread
    assert (tmp_path / "mask_ablation" / "mask_ablation.png").stat().st_size > 0
    assert (tmp_path / "evaluations.json").exists()
    # read back, not redone
    again = reproduce.main(["mask_ablation", "--quick", "--out", str(tmp_path)])["mask_ablation"]
    assert (again["wall_s"] < results["wall_s"]
            and again["agent tokens only (action mask)"] == results["agent tokens only (action mask)"])


def test_a_signal_fires_on_its_3_step_mean_and_its_threshold_is_fitted_between_the_errors():
    signal = lambda values: [{"step": i + 1, "grad_norm": 1.0, "zero_variance_groups": v} for i, v in enumerate(values)]
    collapsing, stuck = signal([0.1] * 7 + [0.9] * 8), signal([0.1] * 15)
    for h, successes in ((collapsing, [0.3] * 9 + [0.0] * 6), (stuck, [0.0] * 5 + [0.9] * 10)):
        for step, success in zip(h, successes):
            step["success"] = success
    # 3-step means from step 6: 0.1, 0.1, (0.1 + 0.1 + 0.9) / 3, (0.1 + 0.9 + 0.9) / 3, then 0.9.
    assert reproduce.first_firing(collapsing, "zero_variance_groups", 0.5) == 9
    assert reproduce.first_firing(collapsing, "zero_variance_groups", 0.9) is None  # never above 0.9
    assert reproduce.first_firing(stuck, "zero_variance_groups", 0.05) == 6  # nothing fires before step 6
    assert reproduce.SIGNALS["retrieval_accuracy"] == -1  # a fall warns: below the threshold
    falling = [{"step": i + 1, "grad_norm": 1.0, "retrieval_accuracy": v} for i, v in enumerate([0.9] * 8 + [0.0] * 4)]
    assert reproduce.first_firing(falling, "retrieval_accuracy", 0.5) == 10  # (0.9 + 0 + 0) / 3 = 0.3 < 0.5
    collapses = [reproduce.collapse_step(collapsing), reproduce.collapse_step(stuck)]
    assert collapses == [12, None]
    record = reproduce.lead_record(collapses + [20, None], [9, None, 25, 7])  # caught 3 ahead; one late; one alarm
    assert record == {"collapses": 2, "caught": 1, "leads": [3], "healthy": 2, "false_alarms": 1}
    assert reproduce.describe(record) == "1/2, lead 3 (3-3); 1/2 false"
    # Candidates 0.1, 0.367, 0.633 catch the collapse without alarming the other run (J = 1); 0.9 never fires.
    threshold, j = reproduce.fit_threshold([collapsing, stuck], collapses, "zero_variance_groups")
    assert threshold == pytest.approx(1.1 / 3) and j == 1.0


def test_the_collapse_signals_study_runs_quick_and_writes_its_table(tmp_path):
    results = reproduce.main(["collapse_signals", "--quick", "--out", str(tmp_path)])["collapse_signals"]
    assert set(reproduce.SIGNALS) <= set(results) and results["rescue"]["pairs"] == []  # 2 steps: nothing fires
    table = (tmp_path / "collapse_signals" / "table.md").read_text()
    assert table.count("\n| ") == 2 + len(reproduce.SIGNALS)  # the header, the monitor's row, a row per signal
    assert len(list((tmp_path / "collapse_signals" / "runs").glob("signals-*"))) == 9  # 3 methods x 3 sets
