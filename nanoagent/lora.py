"""LoRA (Hu et al. 2021): train a low-rank update W + s·B·A of the policy's linear
layers, the base weights frozen.

`train.py --lora_rank R` calls `add_lora` on the policy before sharding. peft
injects the adapters into the HF model in place, so the model keeps its class, its
layers and its forward: sharding, the shared-prompt pass and the loss see an
ordinary model whose decoder projections are now peft LoRA layers. Only A (R x in)
and B (out x R) train, so AdamW keeps states for them alone. The critic stays a
full model.

Whatever leaves the trainer as weights leaves merged, as TRL pushes them: `merged`
turns the gathered state dict into the base model's, each W + s·B·A computed into a
copy one layer at a time (the trainer's W is never touched, so no merge-then-unmerge
rounding creeps into it). parallel.full_weights goes through it, so the pushes to
vLLM, the sampler's copy and a checkpoint's HF export need nothing of peft. A
checkpoint also holds the adapter alone (`save_adapter`, peft's format), and the
base weights with A and B in its training states: `--resume` continues from those.
"""

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor


def add_lora(model, rank):
    """Inject rank-`rank` adapters into every linear layer of the decoder (peft's
    "all-linear": not the LM head), in place, and freeze the rest; returns the model.
    B starts at zero, so the model starts as it was. A model built on the meta device
    (models.built) gets the same adapters in the weights rank 0 reads for it."""
    # s = alpha / r = 2, a common choice
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    with torch.random.fork_rng(devices=[]):  # the same A on any ranks; the caller's RNG kept
        torch.manual_seed(0)
        inject_adapter_in_model(config, model)
    if hasattr(model, "read_weights"):
        read = model.read_weights
        model.read_weights = lambda: add_lora(read(), rank)
    return model


def base_name(name):
    """A LoRA model's state-dict name -> the base model's
    (layers.0.self_attn.q_proj.base_layer.weight -> ... q_proj.weight)."""
    return name.replace(".base_layer.", ".")


def merged(model, named_tensors):
    """(name, full tensor) pairs of model's state dict, in its order -> the merged
    base model's: each LoRA layer's W + s·B·A under the base name, its A and B
    dropped (as they were without LoRA). A layer's entries come as W, bias, A, B: W
    and A wait for B, so one layer's weight is held at a time."""
    held = {}
    for name, tensor in named_tensors:
        if ".lora_A." in name or name.endswith(".base_layer.weight"):
            held[name] = tensor
        elif ".lora_B." in name:
            layer, _, adapter = name.partition(".lora_B.")
            weight = held.pop(f"{layer}.base_layer.weight")
            down = held.pop(f"{layer}.lora_A.{adapter}")
            scaling = model.get_submodule(layer).scaling["default"]
            # (out, in) + (out, R) @ (R, in), in peft's order of operations (the same floats)
            yield f"{layer}.weight", weight + (tensor @ down) * scaling
        else:
            yield base_name(name), tensor
    assert not held, f"LoRA entries without their B: {sorted(held)}"


def save_adapter(model, directory, master):
    """Write model's adapter as PeftModel.save_pretrained does, so
    PeftModel.from_pretrained(base model, directory) loads it. Every rank calls it
    (each A and B is one all-gather); rank 0 (master) writes."""
    adapter = {
        name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        for name, tensor in model.state_dict().items() if ".lora_" in name
    }
    if master:
        directory.mkdir(parents=True)
        # peft's names drop the adapter's name and sit under the PeftModel's prefix
        weights = get_peft_model_state_dict(model, state_dict=adapter)
        save_file(
            {
                f"base_model.model.{name}": tensor.contiguous().cpu()
                for name, tensor in weights.items()
            },
            directory / "adapter_model.safetensors"
        )
        model.peft_config["default"].save_pretrained(directory)
