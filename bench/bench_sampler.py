"""
Benchmark: TorchSampler against transformers' model.generate, in generated tokens per second (CPU).

Same model (the tiny one), same 64 prompts of 20-300 tokens (left-padded for generate), same sampling
(temperature 1, no top-k, no top-p). Two workloads:
  - fixed length: no stop tokens, every row writes exactly max_new_tokens. Pure engine speed.
  - rollout turn: 14 token ids stop a row (~1.5% of the vocabulary, so rows end at different times,
    as agent turns do). generate keeps computing finished rows until the last one stops;
    TorchSampler drops them. Only tokens up to each row's stop token count.
TorchSampler also returns every token's log-prob; generate is asked for none. Run from the repository
root (one torch thread by default: timings on a shared 2-core machine are steadier that way):

    python bench/bench_sampler.py
    python bench/bench_sampler.py --batch-size 32 --threads 2
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanoagent/ lives at the repository root
from nanoagent.models import load_model  # noqa: E402
from nanoagent.sampler import TorchSampler  # noqa: E402

parser = argparse.ArgumentParser(description="TorchSampler vs model.generate, tokens/s")
parser.add_argument("--num-prompts", type=int, default=64)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--batch-size", type=int, default=None, help="TorchSampler rows per batch (default: all)")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
parser.add_argument("--repeats", type=int, default=3, help="timed runs per method; the median is reported")
args = parser.parse_args()

torch.set_num_threads(args.threads)
model, tokenizer = load_model("tiny")
generator = torch.Generator().manual_seed(0)
lengths = torch.linspace(20, 300, args.num_prompts).long().tolist()
prompts = [torch.randint(0, len(tokenizer), (length,), generator=generator).tolist() for length in lengths]
ROLLOUT_STOPS = list(range(100, 900, 60))  # 14 ids of the tiny model's ~900: a turn ends after ~65 tokens


def torch_sampler_tokens(stop_token_ids):
    sampler = TorchSampler(model, batch_size=args.batch_size)
    generations = sampler.generate(prompts, args.max_new_tokens, temperature=1.0, stop_token_ids=stop_token_ids,
                                   seed=list(range(len(prompts))))
    return sum(len(generation.token_ids) for generation in generations)


def hf_generate_tokens(stop_token_ids):
    width = max(lengths)
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id)  # (B, L), left padding
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
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


def tokens_per_second(generate, stop_token_ids):
    generate(stop_token_ids)  # warm-up
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = generate(stop_token_ids)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


print(f"{args.num_prompts} prompts of {min(lengths)}-{max(lengths)} tokens, up to {args.max_new_tokens} new tokens, "
      f"TorchSampler batch size {args.batch_size or 'all'}, {torch.get_num_threads()} torch thread(s)")
for name, stop_token_ids in [("fixed length", []), ("rollout turn", ROLLOUT_STOPS)]:
    ours, theirs = tokens_per_second(torch_sampler_tokens, stop_token_ids), tokens_per_second(hf_generate_tokens, stop_token_ids)
    print(f"{name:13s} TorchSampler {ours:7.0f} tokens/s   model.generate {theirs:7.0f} tokens/s   {ours / theirs:5.2f}x")
