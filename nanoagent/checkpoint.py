"""Checkpoints: the policy (and critic) in HF format plus the trainer state, written so a crash loses nothing.

    out_dir/
      step_000100/            policy: config.json, model.safetensors, tokenizer files (save_pretrained)
        adapter/              with --lora_rank: the LoRA adapter alone, in peft's format (the policy is merged)
        critic/               PPO's critic, also an HF directory
        optimizer/            the fp32 master weights and the optimizers' states, sharded as in training
                              (torch.distributed.checkpoint)
        trainer_state.pt      step, RNG states, metrics history: the rest of what an exact resume needs
        manifest.json         every file above with its size, written last: the mark of a complete checkpoint

The policy directory is an ordinary HF checkpoint, so `eval.py --model out_dir/step_000100` and vLLM load
it directly. It is written in the dtype the model came in (bf16 for Qwen2.5: what its users expect, and half
the size), each tied parameter once; training's fp32 master weights go to optimizer/ with the optimizer states,
so `--resume` continues from them exactly. Those shards load back on another number of ranks (or into one
unsharded process).
A save goes to a temporary directory, is flushed to disk, and only then is renamed into place, so a process
killed mid-save (or a full disk) leaves the earlier checkpoints as they were.
"""

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from nanoagent.common import UserError, print0
from nanoagent.lora import save_adapter
from nanoagent.parallel import full_state_dict, is_sharded

MANIFEST = "manifest.json"


def fsync_tree(directory):
    """Flush every file and directory under `directory` to disk: a rename is durable only once its data is."""
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        descriptor = os.open(root, os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)


def save_atomically(path, save_fn, all_ranks=False):
    """Call save_fn(tmp_dir) on a temporary sibling of `path`, flush it, then rename it to `path`. all_ranks:
    every rank calls this and runs save_fn, into the one directory rank 0 made; rank 0 renames it at the end."""
    path = Path(path)
    collective = all_ranks and is_sharded()
    master = not collective or dist.get_rank() == 0
    tmp = None
    if master:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp*"):  # left by a process killed while saving this path
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp"))
    if collective:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)
        tmp = shared[0]
    try:
        save_fn(tmp)
        fsync_tree(tmp)
        if collective:
            dist.barrier()  # every rank's files are written and flushed
        if master:
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
    finally:
        if master:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def file_sizes(directory):
    """{relative path: size in bytes} of every file under directory but the manifest."""
    directory = Path(directory)
    return {str(path.relative_to(directory)): path.stat().st_size
            for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST}


def save_checkpoint(out_dir, step, policy, tokenizer, trainer_state, critic=None, optimizers=None):
    """Write out_dir/step_{step:06d} as the module docstring lays it out; returns its path. optimizers:
    {name: (model, optimizer)}. Under a process group every rank calls it (the gathers and the optimizer
    shards are collective). A failed write (a full disk) raises UserError."""
    out_dir = Path(out_dir)
    master = not is_sharded() or dist.get_rank() == 0

    def save(directory):
        for model, subdirectory in ((policy, directory), (critic, directory / "critic")):
            if model is not None:
                dtype = model.stored_dtype  # the dtype its checkpoint came in (models.built records it)
                state_dict = full_state_dict(model, dtype)  # every rank takes part; rank 0 holds the result
                if master:  # save_pretrained writes the fp32 masters' dtype into config.json, and FSDP's class name
                    model.save_pretrained(subdirectory, state_dict=state_dict)
                    config_file = subdirectory / "config.json"
                    config = json.loads(config_file.read_text())
                    config.update(dtype=str(dtype).removeprefix("torch."),
                                  architectures=[type(model).__name__.removeprefix("FSDP")])
                    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                if hasattr(model, "peft_config"):  # --lora_rank: the adapter alone too (the export above is merged)
                    save_adapter(model, subdirectory / "adapter", master)
        if optimizers:  # collective: when it returns, every rank's shards are written
            with single_process_quiet():
                states = training_states(optimizers)
                dcp.save(states, checkpoint_id=directory / "optimizer", no_dist=not is_sharded())
        if master:
            tokenizer.save_pretrained(directory)
            torch.save(trainer_state, directory / "trainer_state.pt")
            (directory / MANIFEST).write_text(json.dumps({"step": step, "files": file_sizes(directory)}, indent=1))

    try:
        path = save_atomically(out_dir / f"step_{step:06d}", save, all_ranks=True)
        if is_sharded():
            dist.barrier()  # no rank goes on before this step's checkpoint is in place
    except OSError as error:
        previous = latest_checkpoint(out_dir)
        intact = (f"the newest complete checkpoint, {previous.name}, is intact" if previous
                  else "no earlier checkpoint exists")
        raise UserError(f"could not write the checkpoint of step {step} in {out_dir} ({error}); {intact}: "
                        "make room (or fix the directory) and continue with --resume") from error
    return path


@contextlib.contextmanager
def single_process_quiet():
    """Silence torch.distributed.checkpoint's warning that no process group is up: without torchrun that is
    the plan (no_dist=True), and it would print at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def training_states(optimizers):
    """{name: {"weights": the fp32 masters, "optimizer": its state}} of {name: (model, optimizer)}, as this rank's
    shards: what optimizer/ holds."""
    return {name: {"weights": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
            for name, (model, optimizer) in optimizers.items()}


def load_training_states(path, optimizers):
    """Restore the fp32 master weights and the optimizers saved with a checkpoint, resharded to this run's ranks
    (any number of them). optimizers: {name: (model, optimizer)} as for save_checkpoint, the models sharded."""
    states = training_states(optimizers)
    with single_process_quiet():
        dcp.load(states, checkpoint_id=Path(path) / "optimizer", no_dist=not is_sharded())  # in place, into the shards
    for name, (model, optimizer) in optimizers.items():
        set_model_state_dict(model, states[name]["weights"])
        set_optimizer_state_dict(model, optimizer, states[name]["optimizer"])


def checkpoint_problem(path):
    """None if `path` is a complete checkpoint (its manifest lists every file at its size), else what is wrong."""
    manifest = Path(path) / MANIFEST
    if not manifest.exists():
        return "no manifest: the save did not finish"
    try:
        expected = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as error:
        return f"unreadable manifest ({error})"
    found = file_sizes(path)
    for name, size in expected.items():
        if name not in found:
            return f"{name} is missing"
        if found[name] != size:
            return f"{name} has {found[name]} bytes, the manifest says {size}"
    return None


def latest_checkpoint(out_dir):
    """The newest complete step_* directory in out_dir, or None; a partial or corrupted one (a crash, a disk
    error, a hand edit) is reported and skipped."""
    for path in sorted(Path(out_dir).glob("step_*"), key=lambda path: path.name, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print0(f"warning: skipping checkpoint {path}: {problem}")
    return None


def load_trainer_state(path):
    """The trainer_state dict saved with a checkpoint (step, RNG, history, ...)."""
    return torch.load(Path(path) / "trainer_state.pt", weights_only=False)
