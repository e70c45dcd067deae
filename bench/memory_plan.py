"""
Memory planner: per-GPU memory of a train.py run, by part, before renting the GPUs.

    python bench/memory_plan.py --model Qwen/Qwen2.5-3B-Instruct --algo ppo --gpus 8 --gpu_memory_gb 80 \
        --vllm_memory 0.3
    python bench/memory_plan.py --model runs/default/step_000100 --algo grpo --gpus 1 --activation_checkpointing
    python bench/memory_plan.py --model Qwen/Qwen2.5-7B-Instruct --gpus 1 --sampler torch --lora_rank 16
    python bench/memory_plan.py --table --activation_checkpointing --vllm_sleep   # docs/gpu.md's tables:
        Qwen2.5 0.5B..7B x GRPO/PPO x 1/8 GPUs, under the flags given (checkpointing, vLLM's share, sleep, --kl)
    python bench/memory_plan.py --measure tiny   # planned against measured tensor sizes on this CPU

The model's shape comes from a local directory's config.json, or for the Qwen2.5 instruct models from the
numbers below (their published config.json values, so nothing is downloaded). What train.py holds per GPU
with FSDP2 over N GPUs (nanoagent/parallel.py), P parameters:
  parameters   fp32 master shards, 4P/N bytes, plus the bf16 copy of the largest FSDP group being gathered
  gradients    fp32 shards, 4P/N
  optimizer    AdamW's two fp32 moments, 8P/N
  reference    bf16 shards, 2P/N (only with --kl)
  critic       PPO: the same backbone again, parameters + gradients + optimizer (16 bytes a parameter, /N)
  activations  what the backward pass needs, per token of a minibatch on this GPU (formula in
               activation_bytes_per_token); activation checkpointing keeps one layer input per layer
  logits       the LM head's output on the kept (agent) tokens only, K x V in fp32, and its log-softmax
  vLLM         --vllm_memory of the card, when the sampler is a colocated vLLM engine; with --vllm_sleep it holds
               nothing during the update, but its share again during the rollout, when the update's gradients,
               activations and logits are gone: the part counts what that adds to the step's peak
  sampler      --sampler torch instead: the TorchSampler's bf16 copy of the policy (a sharded policy cannot
               sample unequal lengths), 2P bytes on every GPU; its KV cache lives during the rollout only
With --lora_rank R the base weights keep their fp32 masters (4P/N) but gradients and AdamW's moments are the
adapters' alone: R x (inputs + outputs) for each of a layer's 7 linear maps.
The shared-prompt pass (a group's prompt run once, without --activation_checkpointing) is not credited: a
~200-token prompt is ~5% of a 4096-token trajectory's activations.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
GiB = 2 ** 30
# Qwen2.5 instruct models' config.json values: hidden, layers, heads, kv heads, intermediate, vocab, tied.
QWEN25 = {
    "Qwen/Qwen2.5-0.5B-Instruct": (896, 24, 14, 2, 4864, 151936, True),
    "Qwen/Qwen2.5-1.5B-Instruct": (1536, 28, 12, 2, 8960, 151936, True),
    "Qwen/Qwen2.5-3B-Instruct": (2048, 36, 16, 2, 11008, 151936, True),
    "Qwen/Qwen2.5-7B-Instruct": (3584, 28, 28, 4, 18944, 152064, False),
}


def model_shape(name_or_dir):
    """(hidden, layers, heads, kv_heads, intermediate, vocab, tied) from a known name or a config.json."""
    if name_or_dir in QWEN25:
        return QWEN25[name_or_dir]
    config_file = Path(name_or_dir) / "config.json"
    assert config_file.exists(), (f"{name_or_dir!r} is neither a local model directory nor one of {sorted(QWEN25)}: "
                                  "download its config.json (or the model) first")
    c = json.loads(config_file.read_text())
    return (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c.get("num_key_value_heads", c["num_attention_heads"]), c["intermediate_size"], c["vocab_size"],
            c.get("tie_word_embeddings", False))


def parameter_counts(shape):
    """(policy parameters, critic parameters, parameters of one decoder layer) of a Qwen2-style model."""
    hidden, layers, heads, kv_heads, intermediate, vocab, tied = shape
    kv = hidden // heads * kv_heads
    layer = hidden * hidden * 2 + hidden * kv * 2 + hidden + 2 * kv + 3 * hidden * intermediate + 2 * hidden
    body = vocab * hidden + layers * layer + hidden
    return body + (0 if tied else vocab * hidden), body + hidden + 1, layer


def lora_parameters(shape, rank):
    """Parameters of rank-`rank` adapters on every linear map of the decoder (q, k, v, o, gate, up, down)."""
    hidden, layers, heads, kv_heads, intermediate, _, _ = shape
    kv = hidden // heads * kv_heads
    per_layer = 2 * (2 * hidden) + 2 * (hidden + kv) + 3 * (hidden + intermediate)
    return layers * rank * per_layer


def activation_bytes_per_token(shape, compute_bytes, checkpointing):
    """Bytes autograd keeps per token for the backward pass, summed over layers.

    Per decoder layer: the two RMSNorms keep their fp32 input (4D each) and their output (bD each); attention
    keeps q and k after the rotary embedding (D + kv), the q, k, v and output the attention kernel saves
    (2D + 2kv); the MLP keeps gate, up, silu(gate) and their product (4I). Checkpointing keeps the layer
    input (bD) and recomputes the rest one layer at a time, so one layer's worth is added once.
    """
    hidden, layers, heads, kv_heads, intermediate, _, _ = shape
    kv = hidden // heads * kv_heads
    layer = 8 * hidden + compute_bytes * (5 * hidden + 3 * kv + 4 * intermediate)
    final_norm = 4 * hidden + compute_bytes * hidden
    if checkpointing:
        return layers * compute_bytes * hidden + layer + final_norm
    return layers * layer + final_norm


def plan(shape, algo, gpus, tokens_per_gpu, kept_tokens_per_gpu, kl=False, checkpointing=False, compute_bytes=2,
         gpu_memory_gb=80.0, vllm_memory=0.0, vllm_sleep=False, sharded=True, torch_sampler=False, lora_rank=0):
    """Per-GPU bytes by part (a dict), for one minibatch of tokens_per_gpu tokens on each GPU. sharded=False:
    a plain single CPU process (no FSDP group gathered beside the parameters)."""
    policy, critic, layer = parameter_counts(shape)
    adapters = lora_parameters(shape, lora_rank)  # 0 without LoRA: the whole policy is trained
    trained = adapters or policy
    vocab, hidden = shape[5], shape[0]
    # The largest FSDP group, gathered whole for its forward: a layer, or the root.
    largest_group = max(layer, vocab * hidden * (1 if shape[6] else 2) + hidden) if sharded else 0
    parts = {
        "parameters": 4 * (policy + adapters) / gpus + compute_bytes * largest_group,
        "gradients": 4 * trained / gpus,
        "optimizer": 8 * trained / gpus,
        "reference": compute_bytes * policy / gpus if kl else 0,
        "critic": (16 * critic / gpus + compute_bytes * largest_group) if algo == "ppo" else 0,
        "activations": tokens_per_gpu * activation_bytes_per_token(shape, compute_bytes, checkpointing),
        # lm_head output (compute dtype), .float(), / temperature, log_softmax: K x V each
        "logits": kept_tokens_per_gpu * vocab * (compute_bytes + 12 if compute_bytes != 4 else 12),
    }
    vllm = vllm_memory * gpu_memory_gb * GiB
    # Asleep: the peak is the update without vLLM, or the rollout (vLLM awake, no gradients, activations, logits).
    parts["vLLM"] = max(0, vllm - parts["gradients"] - parts["activations"] - parts["logits"]) if vllm_sleep else vllm
    parts["sampler"] = compute_bytes * policy if torch_sampler else 0
    return parts


def advice(parts, gpu_memory_gb):
    """What to change when the plan does not fit, biggest part first."""
    total, budget = sum(parts.values()), gpu_memory_gb * GiB
    if total <= budget:
        return f"fits: {total / GiB:.1f} of {gpu_memory_gb:.0f} GiB ({(budget - total) / GiB:.1f} GiB to spare)"
    hints = {"activations": "--activation_checkpointing, or a smaller --minibatch_size / --max_total_tokens",
             "optimizer": "more GPUs (FSDP shards parameters, gradients and optimizer states)",
             "critic": "--algo grpo (no critic), or more GPUs", "logits": "a smaller --minibatch_size",
             "vLLM": "--vllm_sleep, or a lower --vllm_memory (gpu_memory_utilization)", "reference": "--kl none",
             "parameters": "more GPUs", "gradients": "more GPUs",
             "sampler": "--sampler vllm (the TorchSampler keeps a whole bf16 copy on every GPU)"}
    biggest = sorted(parts, key=parts.get, reverse=True)[:2]
    return (f"does NOT fit: {total / GiB:.1f} GiB > {gpu_memory_gb:.0f} GiB. Largest parts: "
            + "; ".join(f"{part} {parts[part] / GiB:.1f} GiB -> {hints[part]}" for part in biggest))


def measure(shape, tokens, kept_tokens):
    """Measured bytes on this CPU, float32, one process: parameters, gradients, AdamW states, and the tensors
    autograd saves for the backward pass of nanoagent/models.py's token_logprobs (activations and logits together)."""
    import train
    from transformers import Qwen2Config, Qwen2ForCausalLM
    hidden, layers, heads, kv_heads, intermediate, vocab, tied = shape
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).train()
    rows = max(1, tokens // 128)
    input_ids = torch.randint(0, vocab, (rows, tokens // rows))
    attention_mask = torch.ones_like(input_ids)
    positions = torch.zeros(rows, input_ids.shape[1] - 1)
    positions.view(-1)[torch.randperm(positions.numel())[:kept_tokens]] = 1
    saved = {}

    def pack(tensor):
        is_activation = tensor.device.type != "meta" and not isinstance(tensor, torch.nn.Parameter)
        if is_activation and tensor.untyped_storage().size():
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    parameters = {id(p): p for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = train.token_logprobs(model, input_ids, attention_mask, 1.0, positions)
    for parameter in parameters.values():  # weights are saved by linear layers: they are not activations
        saved.pop(parameter.untyped_storage().data_ptr(), None)
    logprobs.sum().backward()
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    return {"parameters": sum(p.numel() * p.element_size() for p in parameters.values()),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in parameters.values()),
            "optimizer": sum(t.numel() * t.element_size()
                             for s in optimizer.state.values() for t in s.values() if t.dim()),
            "activations + logits": sum(saved.values())}


def main():
    parser = argparse.ArgumentParser(description="Per-GPU memory of a train.py run, by part")
    parser.add_argument("--model", default="Qwen/Qwen2.5-3B-Instruct",
                        help="a local model directory or a Qwen2.5 instruct name")
    parser.add_argument("--algo", default="grpo", choices=["grpo", "ppo", "reinforce_pp"])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu_memory_gb", type=float, default=80.0)
    parser.add_argument("--vllm_memory", type=float, default=0.3,
                        help="vLLM's gpu_memory_utilization (0: TorchSampler)")
    parser.add_argument("--prompts_per_step", type=int, default=8)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--minibatch_size", type=int, default=None, help="trajectories per update (default: all)")
    parser.add_argument("--max_total_tokens", type=int, default=4096)
    parser.add_argument("--agent_tokens", type=int, default=1024, help="agent (kept) tokens per trajectory")
    parser.add_argument("--kl", action="store_true", help="a reference model (--kl loss / in_reward)")
    parser.add_argument("--vllm_sleep", action="store_true", help="vLLM asleep during the update (GPUs)")
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--sampler", default="vllm", choices=["vllm", "torch"],
                        help="torch: the TorchSampler's bf16 copy instead of vLLM's share")
    parser.add_argument("--lora_rank", type=int, default=0, help="train rank-R adapters (0: full fine-tuning)")
    parser.add_argument("--table", action="store_true", help="print the README table")
    parser.add_argument("--measure", default=None, choices=["tiny", "mid"], help="plan against measured sizes on CPU")
    args = parser.parse_args()
    if args.measure:
        from nanoagent.models import TINY_SHAPE
        tiny = (TINY_SHAPE["hidden_size"], TINY_SHAPE["num_hidden_layers"], TINY_SHAPE["num_attention_heads"],
                TINY_SHAPE["num_key_value_heads"], TINY_SHAPE["intermediate_size"], 1024, True)
        shape = tiny if args.measure == "tiny" else (512, 4, 8, 2, 1376, 16384, False)
        tokens, kept = 1024, 256
        planned = plan(shape, "grpo", 1, tokens, kept, compute_bytes=4, sharded=False)
        planned["activations + logits"] = planned.pop("activations") + planned.pop("logits")
        measured = measure(shape, tokens, kept)
        print(f"{'part':<22}{'planned MiB':>12}{'measured MiB':>14}")
        for part, value in measured.items():
            print(f"{part:<22}{planned[part] / 2 ** 20:>12.2f}{value / 2 ** 20:>14.2f}")
        return
    if args.table:
        print(f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}; shared-prompt pass not "
              f"credited; vLLM at {args.vllm_memory} of 80 GB, {'asleep' if args.vllm_sleep else 'awake'} during the "
              f"update; {'a' if args.kl else 'no'} reference; 8 trajectories x 4096 tokens (1024 agent) per GPU")
        print("| model | algo | GPUs | params+grads+optim | critic | activations | logits | vLLM | total "
              "| fits 80 GB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name in QWEN25:
            for algo in ("grpo", "ppo"):
                for gpus in (1, 8):
                    tokens = 8 * 4096  # a minibatch of 8 trajectories x 4096 tokens per GPU (--minibatch_size 8 x GPUs)
                    parts = plan(model_shape(name), algo, gpus, tokens, tokens // 4, kl=args.kl,
                                 checkpointing=args.activation_checkpointing, vllm_memory=args.vllm_memory,
                                 vllm_sleep=args.vllm_sleep)
                    total = sum(parts.values())
                    model_state = parts["parameters"] + parts["gradients"] + parts["optimizer"]
                    short_name = name.split('/')[1].removesuffix('-Instruct')
                    print(f"| {short_name} | {algo} | {gpus} | {model_state / GiB:.1f} | "
                          f"{parts['critic'] / GiB:.1f} | {parts['activations'] / GiB:.1f} | "
                          f"{parts['logits'] / GiB:.1f} | {parts['vLLM'] / GiB:.1f} | {total / GiB:.1f} | "
                          f"{'yes' if total <= 80 * GiB else 'no'} |")
        return
    trajectories = args.minibatch_size or args.prompts_per_step * args.group_size
    rows_per_gpu = math.ceil(trajectories / args.gpus)
    parts = plan(model_shape(args.model), args.algo, args.gpus, rows_per_gpu * args.max_total_tokens,
                 rows_per_gpu * args.agent_tokens, kl=args.kl, checkpointing=args.activation_checkpointing,
                 gpu_memory_gb=args.gpu_memory_gb, vllm_sleep=args.vllm_sleep, lora_rank=args.lora_rank,
                 vllm_memory=args.vllm_memory if args.sampler == "vllm" else 0, torch_sampler=args.sampler == "torch")
    print(f"{args.model}, {args.algo}, {args.gpus} GPU(s), "
          f"{rows_per_gpu} trajectories x {args.max_total_tokens} tokens per GPU")
    for part, value in parts.items():
        print(f"  {part:<12}{value / GiB:8.2f} GiB")
    print(advice(parts, args.gpu_memory_gb))


if __name__ == "__main__":
    main()
