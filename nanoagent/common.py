"""The few helpers every nanoagent script needs: process setup, seeding and RNG
state, printing, shutdown.

A script calls `compute_init()` once at the top and `compute_cleanup()` once at the
end, and reports bad input by raising `UserError`. Run plainly (`python train.py`)
it is one process on the best device; under torchrun it joins the process group
(NCCL on GPUs, gloo on CPU), so the same script is tested with 2 CPU processes and
runs on 8 GPUs per node, or several nodes, unchanged.
"""

import argparse
import datetime
import json
import os
import random

import torch
import torch.distributed as dist


class UserError(RuntimeError):
    """Something the user must fix: a flag, a data file, a directory, a full disk.
    The scripts print its message (what to change) and exit, without a traceback."""


def json_object(text):
    """argparse's type for a flag that holds a JSON object (--env_options)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def get_dist_info():
    """(is_distributed, rank, local_rank, world_size) from torchrun's variables."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    if all(name in os.environ for name in names):
        return True, *(int(os.environ[name]) for name in names)
    return False, 0, 0, 1


def autodetect_device_type():
    """'cuda' if a GPU is visible, else 'cpu' (Apple's mps has no NCCL/gloo story)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def autodetect_dtype(device_type):
    """The compute dtype: bf16 on GPUs that support it (the dtype Qwen2.5 ships in),
    float32 everywhere else: on CPU, bf16 matmuls are neither faster nor exact
    enough for tests that compare log-probs to 1e-4. For testing,
    NANOAGENT_CPU_BF16=1 takes the GPU's bf16 path on a CPU: torchrun's FSDP2 ranks
    compute in bf16 (masters stay float32), a sharded run's TorchSampler copy and a
    vLLM engine sample in bf16."""
    gpu_bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported()
    cpu_bf16 = device_type == "cpu" and os.environ.get("NANOAGENT_CPU_BF16") == "1"
    return torch.bfloat16 if gpu_bf16 or cpu_bf16 else torch.float32


def seed_everything(seed, rank=0):
    """Seed python, torch (CPU and CUDA) so each rank draws a different,
    reproducible stream."""
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)  # also seeds every CUDA device


def rng_state():
    """Python's and torch's RNG states, so a resumed run draws the same numbers as
    an unbroken one."""
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    """Restore what rng_state() captured."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def print0(*args, **kwargs):
    """print() on rank 0 only, so logs under torchrun are not repeated world_size times."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs)


def compute_init(device_type=None, timeout_minutes=30):
    """Set up this process (see above); returns (ddp, rank, local_rank, world_size,
    device).
    device_type: 'cuda', 'cpu' or None (autodetect). On CUDA each rank is pinned to
    its local rank's GPU.
    timeout_minutes: how long a collective waits for the other ranks before it
    raises (NCCL's watchdog ends the process, naming the call): ranks that diverged
    (nanoagent/parallel.py's rule) stop with an error, not a hang."""
    device_type = device_type or autodetect_device_type()
    assert device_type in ("cuda", "cpu"), f"unsupported device type {device_type!r}"
    ddp, rank, local_rank, world_size = get_dist_info()
    if device_type == "cuda":
        assert torch.cuda.is_available(), "device 'cuda' but torch sees no GPU (--device cpu)"
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # NCCL needs to know this rank's GPU before init
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if ddp:
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend, device_id=device if device_type == "cuda" else None,
            timeout=datetime.timedelta(minutes=timeout_minutes)
        )
        dist.barrier()
    elif device_type == "cuda":  # a 1-rank group: a single GPU trains sharded too
        dist.init_process_group(
            backend="nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device
        )
    return ddp, rank, local_rank, world_size, device


def compute_cleanup():
    """Tear the process group down (if any) so torchrun sees a clean exit on every rank."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
