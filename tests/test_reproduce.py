"""bench/reproduce.py: the collapse detector and the table's numbers on hand-made histories (the studies themselves
run, in their --quick versions, when notebook 05 is executed by test_notebooks.py)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
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
