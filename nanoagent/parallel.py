"""Multi-GPU plumbing: FSDP2 sharding, sums over ranks, and the weights gathered one
parameter at a time.

train.py shows the algorithm; this file makes the same step run on 1 or N ranks:

- `shard_model`: PyTorch's FSDP2 (`fully_shard`), applied from outside as torchtitan
  does: every decoder layer is its own FSDP group, then the root (the embedding, the
  final norm and the LM head or the critic's score head; Qwen2.5-0.5B..3B tie the LM
  head to the embedding: a tied parameter must sit in one group). Each rank stores
  1/N of every parameter in float32 (the master weights), and AdamW updates those
  shards. A forward all-gathers a layer's parameters in the compute dtype (bf16 on
  GPUs) just before it runs and frees them after; gradients are reduce-scattered in
  float32 (MixedPrecisionPolicy), summed: every rank's loss is its share of the
  whole batch's loss (masks.aggregate_loss with sum_over_ranks), so the sum is the
  batch's gradient. Why fp32 master weights: AdamW's step at lr 1e-6 is below half a
  bf16 rounding unit of most weights, so a bf16 weight would not move at all.
- `fill_from_rank0`: train.py builds a sharded model on the meta device (no memory)
  and shards it empty; rank 0 alone reads the checkpoint and sends each rank its
  shards, so no rank holds a whole float32 copy (~28 GB at 7B).
- `sum_over_ranks`: the global batch is split over ranks, and its statistics (token
  counts for the token-mean loss, whitening moments, logged metrics) must be the
  global ones, or a step would depend on how many ranks there are.

Training shards whenever a process group is up: under torchrun, and on a single GPU,
where compute_init starts a 1-rank group, so every GPU run takes this one path. A
single CPU process uses the plain model.

The rule: every rank makes the same collectives in the same order, whatever its rows
hold (each forward and backward of a sharded model is one); one more on a rank leaves
the others waiting until compute_init's time-out. What keeps each part of train.py's
step to it (tests/test_parallel.py feeds two ranks skewed rows and compares):
- rollout and eval: an unsharded sampler (a TorchSampler's copy, a rank's own vLLM
  engine) makes none; then one gather_objects (eval: one sums_over_ranks, whether a
  rank played any seed or none);
- StarPO-S, the minibatches' count, GRPO's advantages, the RAGEN-2 probe: from the
  gathered batch, alike everywhere;
- scoring (policy, reference, critic) and each minibatch: one forward (and
  backward), on rows every rank holds (fewer rows than minibatches stops all ranks);
  shared_prompt_hidden's passes as many everywhere (most_over_ranks);
- token counts, whitening, logged metrics, grad clipping's norm: a fixed number of
  reductions a step;
- the weight push (copy, vLLM, LoRA merged) and checkpoints: every rank gathers each
  entry in state-dict order and saves its optimizer shards; rank 0 alone writes the
  files (the others wait for it in the next collective);
- Echo-Trap response: decided from metrics that are global, so the same on every rank;
- warm-up (sft.py): rank 0 alone, on an unsharded model (no collective), while the
  others wait in one barrier.
"""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import (
    FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
)
from torch.distributed.tensor import DTensor

from nanoagent.common import autodetect_dtype
from nanoagent.lora import base_name, merged


def is_sharded():
    """Does training shard the models (FSDP2)? Whenever a process group is up."""
    return dist.is_available() and dist.is_initialized()


def shard_model(model, device, activation_checkpointing=False):
    """The FSDP2 layout above, applied to a HF model in place when sharding (else it
    is returned as is); a model built on the meta device gets its weights after
    (fill_from_rank0).
    activation_checkpointing: each decoder layer recomputes its activations in the
    backward pass (set before sharding, as torchtitan does), so one input is kept
    per layer."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not is_sharded():
        return model
    compute_dtype = autodetect_dtype(device.type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.base_model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a SUM: gloo has no AVG
    model.forward_through_root = lambda function, *args: function(*args)
    register_fsdp_forward_method(model, "forward_through_root")  # inside the root's hooks
    if hasattr(model, "read_weights"):  # built on the meta device: its shards are empty
        fill_from_rank0(model, device)
    return model


def fill_from_rank0(model, device):
    """Give a model sharded on the meta device its weights: rank 0 reads them
    (model.read_weights(), in the dtype they are stored in) and sends every rank its
    shards, one parameter at a time, cast to the shards' dtype. The buffers no
    checkpoint holds (RoPE's frequencies) come from rank 0 too."""
    model.to_empty(device=device)
    full = model.read_weights() if dist.get_rank() == 0 else None
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.state_dict() if full is not None else {}, options=options)
    for name, buffer in model.named_buffers():
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, src=0)


def forward_through_root(model, function, *args):
    """function(*args), a function that calls parts of `model` (train.py: the body,
    then the LM head on the kept positions), as one forward of the root: FSDP gathers
    the root's parameters only around the root's forward, so two separate calls would
    miss them; this gathers them before and reduces their gradients after."""
    if isinstance(model, FSDPModule):
        return model.forward_through_root(function, *args)
    return function(*args)


def sum_over_ranks(tensor):
    """The tensor summed over all ranks (itself without a group); not differentiable."""
    if is_sharded() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
    return tensor


def most_over_ranks(model, count, device):
    """The largest `count` of any rank (one all-reduce) when `model` is sharded: how
    many forward passes every rank makes where each needs `count` (under FSDP2 each
    pass is a collective); `count` itself otherwise."""
    if not isinstance(model, FSDPModule):  # sft.py's warm-up: rank 0 alone, no collective
        return count
    count = torch.tensor(count, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def sums_over_ranks(numbers, device):
    """A list of Python numbers summed over ranks: one all-reduce, on a device the
    backend supports (CUDA under NCCL, CPU under gloo)."""
    numbers = torch.tensor(numbers, dtype=torch.float64, device=device)
    return sum_over_ranks(numbers).tolist()


def gather_objects(objects):
    """Every rank's list of picklable objects, concatenated in rank order."""
    if not is_sharded() or dist.get_world_size() == 1:
        return list(objects)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(objects))
    return [item for rank_objects in everyone for item in rank_objects]


def full_weights(model, dtype=None):
    """Yield (HF name, full tensor) for every entry of model's state dict, cast to
    dtype if given, one parameter at a time: never the whole model at once. Every
    rank must consume it to the end, in the same order (each sharded parameter is one
    all-gather). A tied LM head comes under its own name too: vLLM needs it (a push
    without it leaves the engine's head at the old weights). A policy with LoRA
    adapters comes merged, in float32 before the cast (lora.merged)."""
    gathered = (
        (name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
        for name, tensor in model.state_dict().items()
    )
    for name, full in merged(model, gathered):
        yield name, full if dtype is None else full.to(dtype)


def full_state_dict(model, dtype=None):
    """The whole state dict on CPU on rank 0 ({} on other ranks), in dtype if given,
    gathered parameter by parameter, a tied parameter once under its first name, as
    save_pretrained writes it (it drops a tied copy only when it sees the tie, which
    it does not in gathered tensors). Copies, even of a CPU model's tensors: a
    checkpoint writes them in the background while training goes on. From a GPU they
    go into pinned host memory without a wait each (PyTorch's caching host allocator
    reuses the blocks), and one synchronize ends them all."""
    master = not is_sharded() or dist.get_rank() == 0
    owned = {base_name(name) for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    copies = {}
    for name, tensor in full_weights(model, dtype):
        if master and name in owned:
            copies[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            copies[name].copy_(tensor, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return copies


def clip_gradients(model, max_norm):
    """Clip the gradients' norm over every rank's shards to max_norm; returns the norm
    before, a float."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()

