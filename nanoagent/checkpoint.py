"""Checkpoints: the policy (and critic) in HF format plus the trainer state, written
so a crash loses nothing.

    out_dir/
      step_000100/        policy: config.json, model.safetensors, tokenizer files
        adapter/          with --lora_rank: the LoRA adapter alone, in peft's format
        critic/           PPO's critic, also an HF directory
        optimizer/        the fp32 master weights and the optimizers' states, sharded
                          as in training (torch.distributed.checkpoint)
        trainer_state.pt  step, RNG states, metrics history: the rest of a resume
        manifest.json     every file above with its size, written last: the mark of
                          a complete checkpoint

The policy directory is an ordinary HF checkpoint (`eval.py --model DIR` and vLLM
load it), in the dtype the model came in (bf16 for Qwen2.5: half the size), each
tied parameter once; `--resume` continues exactly from optimizer/'s fp32 masters, on
any number of ranks.
A save goes to a temporary directory, is flushed to disk, and only then renamed into
place, so a process killed mid-save (or a full disk) leaves the earlier checkpoints
as they were. save_checkpoint takes CPU copies of what it holds (its only time on
the training's path) and a background thread writes them while training goes on
(finish_checkpoint waits for it).
"""

import copy
import fcntl
import functools
import json
import os
import shutil
import tempfile
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
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
SHARD_WRITERS = weakref.WeakKeyDictionary()  # {policy: the dcp writer of its shards}
# torch.distributed.checkpoint warns at every save and load that no process group is
# up: without torchrun that is the plan (no_dist=True). A filter for good, as the
# background thread's saves warn after any `with` has ended.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


def fsync_tree(directory):
    """Flush all under `directory` to disk: a rename is durable only once its data is."""
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
        descriptor = os.open(root, os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)


def temporary_sibling(path, collective=False):
    """A new empty directory beside `path` to write it in (a killed process's leftovers
    removed). collective: every rank gets the one rank 0 made."""
    tmp = None
    if not collective or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp"))
    if collective:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)
        tmp = shared[0]
    return tmp


def move_into_place(tmp, path):
    """Flush the directory tmp to disk, then rename it to `path` (replacing one)."""
    fsync_tree(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def save_atomically(path, save_fn):
    """Call save_fn(tmp_dir) on a temporary sibling of `path`, flush it, then rename it to
    `path`, unless `path` exists: under a lock beside it, so two processes building one
    cache entry at once (a sweep's runs) neither remove the other's temporary directory
    nor replace what it loads; the one that waited keeps it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when its process dies
        if path.exists():
            return path
        tmp = temporary_sibling(path)
        try:
            save_fn(tmp)
            move_into_place(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def file_sizes(directory):
    """{relative path: size in bytes} of every file under directory but the manifest."""
    directory = Path(directory)
    return {str(path.relative_to(directory)): path.stat().st_size
            for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST}


def save_checkpoint(out_dir, step, policy, tokenizer, trainer_state, critic=None, optimizers=None):
    """Start writing out_dir/step_{step:06d} as the module docstring lays it out;
    returns a Future for finish_checkpoint. optimizers: {name: (model, optimizer)}.
    Under a process group every rank calls it (the gathers and the optimizer shards
    are collective); rank 0 writes the rest once every rank's shards are written."""
    out_dir = Path(out_dir)
    path, master = out_dir / f"step_{step:06d}", not is_sharded() or dist.get_rank() == 0
    tmp = temporary_sibling(path, collective=is_sharded())
    exports = [  # in the dtype each came in (models.built)
        (model, subdirectory, full_state_dict(model, model.stored_dtype))
        for model, subdirectory in ((policy, tmp), (critic, tmp / "critic")) if model is not None
    ]
    for model, subdirectory, _ in exports:
        if hasattr(model, "peft_config"):  # --lora_rank: adapter/ too
            save_adapter(model, subdirectory / "adapter", master)
    # The shards are staged in CPU memory now (from a GPU, into pinned buffers the
    # run's writer keeps, far faster than pageable memory) and written by dcp's own
    # thread, with collectives on a group of their own: the training's run on the
    # default group meanwhile (two threads' calls on one group would interleave).
    if optimizers and policy not in SHARD_WRITERS:  # the first save: its writer makes them
        cache = torch.cuda.is_available()
        SHARD_WRITERS[policy] = dcp.FileSystemWriter(tmp, cache_staged_state_dict=cache)
    shards = dcp.async_save(
        training_states(optimizers), checkpoint_id=tmp / "optimizer",
        no_dist=not is_sharded(), storage_writer=SHARD_WRITERS.get(policy),
        process_group=background_group() if is_sharded() else None
    ) if optimizers else None
    trainer_state = copy.deepcopy(trainer_state)  # the history grows at the next step

    def write():
        try:
            if shards:
                shards.result()  # every rank's shards are written (gathered last)
            if master:  # save_pretrained writes the fp32 dtype and FSDP's class name: fix them
                for model, subdirectory, state_dict in exports:
                    model.save_pretrained(subdirectory, state_dict=state_dict)
                    config_file = subdirectory / "config.json"
                    config = json.loads(config_file.read_text())
                    config.update(
                        dtype=str(model.stored_dtype).removeprefix("torch."),
                        architectures=[type(model).__name__.removeprefix("FSDP")]
                    )
                    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                tokenizer.save_pretrained(tmp)
                torch.save(trainer_state, tmp / "trainer_state.pt")
                manifest = {"step": step, "files": file_sizes(tmp)}
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
                move_into_place(tmp, path)
        except OSError as error:
            previous = latest_checkpoint(out_dir)
            intact = (
                f"the newest complete checkpoint, {previous.name}, is intact" if previous
                else "no earlier checkpoint exists"
            )
            raise UserError(
                f"could not write the checkpoint of step {step} in {out_dir} ({error});"
                f" {intact}: make room (or fix the directory) and continue with --resume"
            ) from error
        finally:
            if master:
                shutil.rmtree(tmp, ignore_errors=True)
        return path

    executor = ThreadPoolExecutor(max_workers=1)  # not a daemon: an exit waits for it
    saving = executor.submit(write)
    executor.shutdown(wait=False)  # its thread ends with the write
    return saving


def finish_checkpoint(saving):
    """Wait for save_checkpoint's Future (if not None); raise its UserError (a full
    disk). Every rank calls it: before the next save and at the end of training."""
    if saving is not None:
        saving.result()
        if is_sharded():
            dist.barrier()  # no rank goes on before the checkpoint is in place


@functools.cache
def background_group():
    """A gloo group of every rank for the background saves' collectives (on CPU)."""
    return dist.new_group(backend="gloo")


def training_states(optimizers):
    """{name: {"weights": the fp32 masters, "optimizer": its state}} of
    {name: (model, optimizer)}, as this rank's shards: what optimizer/ holds."""
    return {
        name: {
            "weights": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer)
        }
        for name, (model, optimizer) in optimizers.items()
    }


def load_training_states(path, optimizers):
    """Restore the fp32 master weights and the optimizers saved with a checkpoint,
    resharded to this run's ranks. optimizers: as for save_checkpoint, sharded."""
    states = training_states(optimizers)
    optimizer_dir = Path(path) / "optimizer"
    dcp.load(states, checkpoint_id=optimizer_dir, no_dist=not is_sharded())  # into the shards
    for name, (model, optimizer) in optimizers.items():
        set_model_state_dict(model, states[name]["weights"])
        set_optimizer_state_dict(model, optimizer, states[name]["optimizer"])


def checkpoint_problem(path):
    """None if `path` is complete (its manifest lists every file at its size), else
    what is wrong."""
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
    """The newest complete step_* directory in out_dir, or None; a partial or
    corrupted one (a crash, a disk error) is reported and skipped."""
    for path in sorted(Path(out_dir).glob("step_*"), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print0(f"warning: skipping checkpoint {path}: {problem}")
    return None


def load_trainer_state(path):
    """The trainer_state dict saved with a checkpoint (step, RNG, history, ...)."""
    return torch.load(Path(path) / "trainer_state.pt", weights_only=False)


def check_out_dir(out_dir, resume):
    """Create train.py's --out_dir and write in it now, not at the first checkpoint an hour
    in; its latest checkpoint, which --resume needs and a new run must not find."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkstemp(dir=out_dir, prefix=".write-test")[1]).unlink()
    except OSError as error:
        raise UserError(f"--out_dir {out_dir} is not writable: {error}") from error
    checkpoint = latest_checkpoint(out_dir)
    if resume and checkpoint is None:
        raise UserError(f"--resume: no complete checkpoint in {out_dir}")
    if not resume and checkpoint is not None:
        raise UserError(
            f"{out_dir} already holds a run: pass --resume to continue it, "
            "or choose another --out_dir"
        )
    return checkpoint


def check_same_run(flags, saved_flags, may_change):
    """Refuse to --resume a run's checkpoint with other flags than its trainer state's
    `saved_flags`, but those in `may_change`; say which differ."""
    changed = [
        f"--{key} {saved_flags.get(key)!r} -> {value!r}" for key, value in flags.items()
        if key not in may_change and saved_flags.get(key) != value
    ]
    if changed:
        raise UserError(
            f"--resume: {flags['out_dir']} holds a run with other flags ({'; '.join(changed)}); "
            "resume with the run's own flags, or start a new run in another --out_dir"
        )
