"""Checkpoints: the policy (and critic) in HF format plus the trainer state, written atomically.

    out_dir/
      step_000100/            policy: config.json, model.safetensors, tokenizer files (save_pretrained)
        critic/               PPO's critic, also an HF directory
        trainer_state.pt      optimizers, step, RNG states, data position: everything an exact resume needs
      latest                  a one-line text file naming the newest complete step directory

The policy directory is an ordinary HF checkpoint, so `eval.py --model out_dir/step_000100` and vLLM load
it directly. Every write goes to a temporary directory first and is renamed into place, and `latest`
is replaced only after that: a crash mid-save leaves the previous checkpoint as the latest one.
"""

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch


def save_atomically(path, save_fn):
    """Call save_fn(tmp_dir) on a temporary sibling of `path`, then rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp"))
    try:
        save_fn(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def rng_state():
    """Python's and torch's RNG states, so a resumed run draws the same numbers as an unbroken one."""
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    """Restore what rng_state() captured."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir, step, policy, tokenizer, trainer_state, critic=None):
    """Write out_dir/step_{step:06d} (policy, tokenizer, optional critic, trainer_state) and point `latest` at it."""
    out_dir = Path(out_dir)

    def save(directory):
        policy.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        if critic is not None:
            critic.save_pretrained(directory / "critic")
        torch.save(trainer_state, directory / "trainer_state.pt")

    path = save_atomically(out_dir / f"step_{step:06d}", save)
    latest_tmp = out_dir / ".latest.tmp"
    latest_tmp.write_text(path.name + "\n")
    os.replace(latest_tmp, out_dir / "latest")  # atomic on POSIX: readers see the old or the new name
    return path


def latest_checkpoint(out_dir):
    """The newest complete checkpoint directory in out_dir, or None if there is none."""
    latest = Path(out_dir) / "latest"
    if not latest.exists():
        return None
    path = Path(out_dir) / latest.read_text().strip()
    assert (path / "trainer_state.pt").exists(), f"{latest} names {path}, which is incomplete or missing"
    return path


def load_trainer_state(path):
    """The trainer_state dict saved with a checkpoint (optimizer states, step, RNG, ...)."""
    return torch.load(Path(path) / "trainer_state.pt", weights_only=False)
