"""nanoagent: shared plumbing (device and distributed setup, model loading,
samplers, checkpoints).

The concepts themselves live in the files at the repository root (tools.py, envs.py,
rollout.py, masks.py, train.py, eval.py); this package holds only what several of
them need.
"""
