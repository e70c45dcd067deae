"""Shared test setup: a private cache so tests never touch (or depend on) the user's ~/.cache."""

import os
import sys
import tempfile
from pathlib import Path

# Tests import the concept files at the repository root (tools.py, envs.py, ...) by name.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("NANOAGENT_CACHE", os.path.join(tempfile.gettempdir(), "nanoagent-test-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test that reaches for the network must fail, not hang
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
