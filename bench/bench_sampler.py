"""
Benchmark: TorchSampler against transformers' model.generate, in generated tokens per second (CPU).

Same model (the tiny one), same 64 prompts of 20-300 tokens (left-padded for generate), same sampling
(temperature 1, no top-k, no top-p). Four workloads:
  - fixed length: no stop tokens, every row writes exactly max_new_tokens. Pure engine speed.
  - rollout turn: 14 token ids stop a row (~1.3% of the vocabulary, so rows end at different times,
    as agent turns do). generate keeps computing finished rows until the last one stops;
    TorchSampler drops them. Only tokens up to each row's stop token count.
  - GRPO groups: the same, but 8 distinct prompts x 8 samples each, as in a training step's first
    turn. TorchSampler prefills each distinct prompt once; generate prefills all 64 rows.
  - next turn: the turn after "rollout turn": each prompt, its sampled turn and 20 environment
    tokens. The TorchSampler that sampled the first turn (untimed) prefills only the new tokens
    from its kept cache; generate prefills the whole conversation, as a turn-by-turn loop over it does.
TorchSampler also returns every token's log-prob; generate is asked for none. Run from the repository
root (one torch thread by default: timings on a shared 2-core machine are steadier that way):

    python bench/bench_sampler.py
    python bench/bench_sampler.py --batch-size 32 --threads 2
    python bench/bench_sampler.py --device cuda      # on a GPU; adds VLLMSampler when vLLM is installed
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanoagent/ lives at the repository root
from nanoagent.models import load_model, resolve_model_path  # noqa: E402
from nanoagent.sampler import TorchSampler  # noqa: E402

parser = argparse.ArgumentParser(description="TorchSampler vs model.generate, tokens/s")
parser.add_argument("--num-prompts", type=int, default=64)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--batch-size", type=int, default=None, help="TorchSampler rows per batch (default: all)")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
parser.add_argument("--repeats", type=int, default=3, help="timed runs per method; the median is reported")
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
args = parser.parse_args()

torch.set_num_threads(args.threads)
model, tokenizer = load_model("tiny", device=args.device)
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
        new_tokens = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)[:, width:]
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


print(f"{args.num_prompts} prompts of {min(lengths)}-{max(lengths)} tokens, up to {args.max_new_tokens} new tokens, "
      f"TorchSampler batch size {args.batch_size or 'all'}, {torch.get_num_threads()} torch thread(s)")
vllm_sampler = None
if args.device == "cuda" and importlib.util.find_spec("vllm") is not None:
    from nanoagent.sampler import VLLMSampler
    vllm_sampler = VLLMSampler(resolve_model_path("tiny"), gpu_memory_utilization=0.3, max_model_len=512)
first_turn = TorchSampler(model).generate(prompts, args.max_new_tokens, stop_token_ids=ROLLOUT_STOPS,
                                         seed=list(range(len(prompts))))
NEXT_TURN = [prompt + generation.token_ids + torch.randint(0, len(tokenizer), (20,), generator=generator).tolist()
             for prompt, generation in zip(prompts, first_turn)]  # what a second turn's prompts look like
for name, rows, stop_token_ids in [("fixed length", prompts, []), ("rollout turn", prompts, ROLLOUT_STOPS),
                                   ("GRPO groups", GROUPED, ROLLOUT_STOPS), ("next turn", NEXT_TURN, ROLLOUT_STOPS)]:
    sampler = TorchSampler(model, batch_size=args.batch_size)
    if name == "next turn":  # the same sampler samples the first turn, untimed, before every timed second turn
        ours = tokens_per_second(sampler_tokens(sampler), rows, stop_token_ids,
                                 before=lambda: sampler_tokens(sampler)(prompts, ROLLOUT_STOPS))
    else:
        ours = tokens_per_second(sampler_tokens(sampler), rows, stop_token_ids)
    theirs = tokens_per_second(hf_generate_tokens, rows, stop_token_ids)
    line = f"{name:13s} TorchSampler {ours:7.0f} tokens/s   model.generate {theirs:7.0f} tokens/s   {ours / theirs:5.2f}x"
    if vllm_sampler is not None:
        line += f"   VLLMSampler {tokens_per_second(sampler_tokens(vllm_sampler), rows, stop_token_ids):7.0f} tokens/s"
    print(line)
