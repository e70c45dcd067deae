"""Shared test setup: a private cache so tests never touch (or depend on) the user's ~/.cache; optional packages."""

import importlib
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


def import_or_skip_outside_ci(module):
    """`module`, imported. Without it the test skips, except where the CI variable is set: CI installs every locked
    package (requirements-lock.txt), so there a missing one fails the run instead of silently skipping tests."""
    return importlib.import_module(module) if os.environ.get("CI") else pytest.importorskip(module)
