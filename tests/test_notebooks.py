"""notebooks/: every notebook runs top to bottom in a fresh kernel, is committed with its outputs, opens by
explaining its idea and closes with "What to try next". Needs requirements-notebooks.txt (skipped without it, but
CI fails)."""

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import import_or_skip_outside_ci

nbformat = import_or_skip_outside_ci("nbformat")
nbclient = import_or_skip_outside_ci("nbclient")
import_or_skip_outside_ci("ipykernel")
import_or_skip_outside_ci("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CONCEPT_FILES = [*ROOT.glob("*.py"), *(ROOT / "nanoagent").glob("*.py")]


def code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def test_the_notebooks_are_there():
    names = [path.stem for path in NOTEBOOKS]
    for name in ["01_tools_and_envs", "02_rollout_and_masks", "03_advantages", "04_train_on_cpu",
                 "05_reproduce_the_papers", "06_a_real_model"]:
        assert name in names, f"notebooks/{name}.ipynb is missing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_without_errors(path, monkeypatch):
    monkeypatch.setenv("NANOAGENT_QUICK_NOTEBOOKS", "1")  # 05 reruns the papers' studies at tiny settings
    notebook = nbformat.read(path, as_version=4)
    # One extra cell reports the kernel's interpreter: the notebook must run on this Python (this virtual
    # environment, with this checkout's packages), not on whatever "python3" a machine has elsewhere.
    notebook.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    client = nbclient.NotebookClient(notebook, timeout=1800, kernel_name="python3",  # a hang guard, not a speed test
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on the first failing cell
    errors = [output for cell in code_cells(notebook) for output in cell.outputs if output.output_type == "error"]
    assert not errors, f"{path.name}: {errors}"
    assert notebook.cells[-1].outputs[0]["text"].strip() == sys.executable, "the kernel runs another interpreter"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_opens_with_the_idea_and_ends_with_what_to_try_next(path):
    notebook = nbformat.read(path, as_version=4)
    first, last = notebook.cells[0], notebook.cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "the first cell is a markdown title"
    assert len(first.source.split()) >= 80, "the opening cell explains the idea, not just a title"
    assert re.search(r"\(.*20\d\d", first.source), \
        "the opening cell names the paper the idea comes from (Author, year)"
    assert last.cell_type == "markdown" and last.source.startswith("## What to try next"), \
        "the last cell is What to try next"
    assert last.source.count("\n- ") >= 3, "What to try next lists a few experiments"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_committed_with_the_outputs_of_one_clean_run(path):
    notebook = nbformat.read(path, as_version=4)
    cells = code_cells(notebook)
    assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1)), \
        "save the notebook right after running it top to bottom once (Restart & Run All)"
    outputs = [output for cell in cells for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"], "a committed output is an error"
    # A warning's text carries a path of the machine that ran it.
    assert not [output for output in outputs if "site-packages" in str(output)], "a committed output shows a warning"


def test_notebooks_import_the_project_instead_of_copying_it():
    project_names = set()
    for path in CONCEPT_FILES:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                project_names.add(node.name)
    assert {"rollout", "compute_gae", "parse_tool_calls"} <= project_names  # the scan sees the project
    for path in NOTEBOOKS:
        source = "\n".join(cell.source for cell in code_cells(nbformat.read(path, as_version=4)))
        defined = {node.name for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & project_names, \
            f"{path.name} redefines {sorted(defined & project_names)}: import it instead"
