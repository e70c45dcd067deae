"""
Benchmark: TorchSampler against transformers' model.generate and VLLMSampler, in generated tokens per second.

Same model, same 64 prompts of 20-300 tokens (left-padded for generate), same sampling (temperature 1,
no top-k, no top-p), one run, the methods alternating. The model is the tiny one, or with --shape
qwen0.5b a random one with Qwen2.5-0.5B's widths (896 wide, 14 heads of 64, 2 key/value heads, MLP
4864) and --layers layers, where a token's work is real matmuls. Four workloads:
  - fixed length: no stop tokens, every row writes exactly max_new_tokens. Pure engine speed.
  - rollout turn: 14 token ids stop a row (~1.3% of the vocabulary, so rows end at different times,
    as agent turns do). generate keeps computing finished rows until the last one stops;
    TorchSampler drops them. Only tokens up to each row's stop token count.
  - GRPO groups: the same, but 8 distinct prompts x 8 samples each, as in a training step's first
    turn. TorchSampler prefills each distinct prompt once; generate prefills all 64 rows.
  - next turn: the turn after "rollout turn": each prompt, its sampled turn and 20 environment
    tokens. The TorchSampler that sampled the first turn (untimed) prefills only the new tokens
    from its kept cache; generate prefills the whole conversation, as a turn-by-turn loop over it does.
The samplers also return every token's log-prob; generate is asked for none. VLLMSampler runs when
vLLM is installed (vllm-cpu on a CPU, requirements-vllm-cpu.txt): its prefix cache plays the part of
TorchSampler's kept cache on the next turn. On a CPU the engine binds its threads to cores and then
fixes the process's thread count, so it is built first, bound to --threads cores, and every method runs
with that many threads. Run from the repository root (one thread by default: timings on a shared 2-core
machine are steadier that way):

    python bench/bench_sampler.py
    python bench/bench_sampler.py --shape qwen0.5b --layers 4 --num-prompts 16 --max-new-tokens 32
    python bench/bench_sampler.py --batch-size 32 --threads 2
    python bench/bench_sampler.py --device cuda
"""

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanoagent/ lives at the repository root
from nanoagent.models import load_model, resolve_model_path, tiny_model, tiny_tokenizer  # noqa: E402
from nanoagent.sampler import TorchSampler  # noqa: E402

parser = argparse.ArgumentParser(description="TorchSampler vs model.generate vs VLLMSampler, tokens/s")
parser.add_argument("--shape", default="tiny", choices=["tiny", "qwen0.5b"], help="qwen0.5b: Qwen2.5-0.5B's widths")
parser.add_argument("--layers", type=int, default=4, help="layers of the qwen0.5b shape (the real model has 24)")
parser.add_argument("--num-prompts", type=int, default=64)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--batch-size", type=int, default=None, help="TorchSampler rows per batch (default: all)")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
parser.add_argument("--repeats", type=int, default=3, help="timed runs per method; the median is reported")
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
args = parser.parse_args()

QWEN25_05B_WIDTHS = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864)
model_path = resolve_model_path("tiny")
if args.shape == "qwen0.5b":  # random weights are enough for speed; saved so that vLLM can load the same model
    model_path = tempfile.mkdtemp(prefix="bench-qwen0.5b-")
    tiny_model(tiny_tokenizer(), **QWEN25_05B_WIDTHS, num_hidden_layers=args.layers).save_pretrained(model_path)
    tiny_tokenizer().save_pretrained(model_path)
torch.set_num_threads(args.threads)
vllm_sampler = None
if importlib.util.find_spec("vllm") is not None:
    from nanoagent.sampler import VLLMSampler
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")  # the engine's threads, on CPU
    vllm_sampler = VLLMSampler(model_path, max_model_len=1024, dtype="float32",
                               gpu_memory_utilization=0.3 if args.device == "cuda" else None)
model, tokenizer = load_model(model_path, device=args.device)
generator = torch.Generator().manual_seed(0)
lengths = torch.linspace(20, 300, args.num_prompts).long().tolist()
prompts = [torch.randint(0, len(tokenizer), (length,), generator=generator).tolist() for length in lengths]
GROUPED = [prompt for prompt in prompts[::8] for _ in range(8)]  # 8 distinct prompts, 8 rows each
ROLLOUT_STOPS = list(range(100, 900, 60))  # 14 ids of the tiny model's ~1100: a turn ends after ~80 tokens


def sampler_tokens(sampler):
    """A generate function for tokens_per_second: `sampler` (TorchSampler or VLLMSampler) on the prompts."""
    def generate(prompts, stop_token_ids):
        generations = sampler.generate(prompts, args.max_new_tokens, temperature=1.0, stop_token_ids=stop_token_ids,
                                       seed=list(range(len(prompts))))
        return sum(len(generation.token_ids) for generation in generations)
    return generate


def hf_generate_tokens(prompts, stop_token_ids):
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, device=args.device)  # (B, L), left padding
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long, device=args.device)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                              eos_token_id=stop_token_ids or None, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        new_tokens = generated[:, width:]
    count = 0
    for row in new_tokens.tolist():  # a row's tokens up to and including its first stop token
        count += next((index + 1 for index, token in enumerate(row) if token in stop_token_ids), len(row))
    return count


def tokens_per_second(generate, prompts, stop_token_ids, before=None):
    """Median generated tokens/s of `generate` over args.repeats runs, after a warm-up; `before()`, if
    given, runs untimed before each run (the first turn, for the next-turn workload)."""
    rates = []
    for repeat in range(args.repeats + 1):  # run 0 is the warm-up
        if before is not None:
            before()
        start = time.perf_counter()
        tokens = generate(prompts, stop_token_ids)
        if repeat:
            rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


print(f"{args.shape} model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, float32), "
      f"{args.num_prompts} prompts of {min(lengths)}-{max(lengths)} tokens, up to {args.max_new_tokens} new tokens, "
      f"TorchSampler batch size {args.batch_size or 'all'}, {torch.get_num_threads()} torch thread(s)")
first_turn = TorchSampler(model).generate(prompts, args.max_new_tokens, stop_token_ids=ROLLOUT_STOPS,
                                         seed=list(range(len(prompts))))
NEXT_TURN = [prompt + generation.token_ids + torch.randint(0, len(tokenizer), (20,), generator=generator).tolist()
             for prompt, generation in zip(prompts, first_turn)]  # what a second turn's prompts look like
for name, rows, stop_token_ids in [("fixed length", prompts, []), ("rollout turn", prompts, ROLLOUT_STOPS),
                                   ("GRPO groups", GROUPED, ROLLOUT_STOPS), ("next turn", NEXT_TURN, ROLLOUT_STOPS)]:
    def rate(sampler):
        if name == "next turn":  # the same sampler samples the first turn, untimed, before every timed second turn
            return tokens_per_second(sampler_tokens(sampler), rows, stop_token_ids,
                                     before=lambda: sampler_tokens(sampler)(prompts, ROLLOUT_STOPS))
        return tokens_per_second(sampler_tokens(sampler), rows, stop_token_ids)
    ours = rate(TorchSampler(model, batch_size=args.batch_size))
    theirs = tokens_per_second(hf_generate_tokens, rows, stop_token_ids)
    line = (f"{name:13s} TorchSampler {ours:7.0f} tokens/s   model.generate {theirs:7.0f} tokens/s   "
            f"{ours / theirs:5.2f}x")
    if vllm_sampler is not None:
        engine = rate(vllm_sampler)
        line += f"   VLLMSampler {engine:7.0f} tokens/s   TorchSampler / VLLMSampler {ours / engine:5.2f}x"
    print(line, flush=True)
