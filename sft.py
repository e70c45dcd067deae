"""Supervised warm-up on demonstrations: the step before RL that teaches a model the format.

RL can only sharpen what a policy already does sometimes. A tiny model from random
weights never writes `<tool_call>{json}</tool_call>` or `<answer>...</answer>`
(Qwen2.5-Instruct does), so no rollout earns a reward and every GRPO group is flat. The
fix, the "cold start" SFT of DeepSeek-R1 and most agent-RL recipes, is a short
supervised pass on demonstrations.

The warm-up must leave a *weak* agent, or RL has nothing left to do. Two phases:
  1. correct demonstrations of an easier task (the env's `warmup_options`) teach the
     skill, copying a name from the context into the next query, in a sudden
     (induction-head-like) jump that flawed demonstrations alone bring much later:
     most of their names are not in the context;
  2. flawed demonstrations (the env's `demonstration` with a mistake rate), wrong as a
     weak agent is: the model keeps the skill and learns to misuse it, so RL starts
     low. Uniform noise would not do: the right entity would stay the likeliest token,
     and greedy decoding near perfect.

The loss is next-token cross-entropy on the assistant's tokens, RL's action mask: the
model learns to act. A game adds the env's replies (`world_model`: implicit world
modelling, arXiv 2510.08558): each next grid shows where a move went. The HF
checkpoint it makes is cached: train.py pays once.
"""

import hashlib
import json
import os
import random
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

import envs
import masks
import rollout
from nanoagent.checkpoint import save_atomically
from nanoagent.common import print0
from nanoagent.models import (
    TINY_MODELS, cache_dir, load_model, resolve_model_path, shared_prompt_hidden,
)


def assistant_token_mask(tokenizer, input_ids):
    """1 on what follows each `<|im_start|>assistant\\n` up to its <|im_end|> included,
    else 0."""
    header = rollout.encode(tokenizer, "<|im_start|>assistant\n")
    im_end = tokenizer.convert_tokens_to_ids(rollout.END_OF_TURN)
    mask, inside, t = [0] * len(input_ids), False, 0
    while t < len(input_ids):
        if not inside and input_ids[t:t + len(header)] == header:
            inside, t = True, t + len(header)
            continue
        if inside:
            mask[t] = 1
            inside = input_ids[t] != im_end
        t += 1
    return mask


def demonstrations(tokenizer, env_class, env_kwargs, num_episodes, mistake_rate, rng, first_seed):
    """Tokenized demonstrations on seeds first_seed, first_seed + 1, ...: [(ids, mask)]."""
    examples, solved = [], 0
    for seed in range(first_seed, first_seed + num_episodes):
        env = env_class(**env_kwargs)
        messages, tool_schemas = env.reset(seed)
        for text in env.demonstration(mistake_rate=mistake_rate, rng=rng):
            messages.append({"role": "assistant", "content": text})
            result = env.step(text)
            messages.extend(result.observations)
            if result.done:
                break
        input_ids = rollout.encode_chat(tokenizer, messages, tool_schemas)
        examples.append((input_ids, assistant_token_mask(tokenizer, input_ids)))
        solved += result.info["success"]
    print0(
        f"warm-up: {num_episodes} demonstrations at mistake rate {mistake_rate}, "
        f"{solved / num_episodes:.0%} of them solve their task"
    )
    return examples


def demonstration_loss(model, batch, pad_token_id, device="cpu", world_model=0.0):
    """Next-token cross-entropy on the assistant's tokens of demonstrations [(ids, mask)],
    plus `world_model` times that on the env's tokens after the first reply. They open
    with their env's system prompt and tool schemas (half their tokens): the shared
    opening runs once (shared_prompt_hidden), the LM head only where the loss reads."""
    input_ids = masks.padded([ids for ids, _ in batch], fill=pad_token_id)  # (B, T), right padded
    attention_mask = masks.padded([[1] * len(ids) for ids, _ in batch])  # (B, T)
    loss_mask = masks.padded([mask for _, mask in batch])  # (B, T)
    # Shared at most up to the first token the loss reads: shared_prompt_hidden leaves the
    # hidden states before the prompt's last token as garbage.
    common_prefix = os.path.commonprefix([ids for ids, _ in batch])
    shared = min(len(common_prefix), *(mask.index(1) for _, mask in batch))
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    keep = loss_mask[:, 1:].bool().to(device)  # (B, T-1): position t predicts token t+1
    prompt_lengths = torch.full((len(batch),), shared, device=device)  # (B,)
    hidden = shared_prompt_hidden(model, input_ids, attention_mask, prompt_lengths)  # (B, T, D)
    head, targets = model.get_output_embeddings(), input_ids[:, 1:]
    logits = head(hidden[:, :-1][keep])  # (K, V), K kept positions
    loss = torch.nn.functional.cross_entropy(logits, targets[keep])
    if world_model:  # (B, T-1): what the env wrote after the first reply
        env = (loss_mask.cumsum(1)[:, 1:] > 0).to(device) & ~keep & attention_mask[:, 1:].bool()
        env_loss = torch.nn.functional.cross_entropy(head(hidden[:, :-1][env]), targets[env])
        loss = loss + world_model * env_loss
    return loss


# The files whose edits change the warmed-up weights key the cache: no stale warm-up.
WARM_UP_CODE = [
    "sft.py", "envs.py", "tools.py", "rollout.py", "masks.py", "nanoagent/models.py",
    "nanoagent/qwen25_chat_template.jinja",
]


def warm_up_code_hash():
    """A hash of WARM_UP_CODE's files and the torch and transformers versions."""
    root, digest = Path(__file__).resolve().parent, hashlib.sha256()
    for name in WARM_UP_CODE:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    digest.update(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    return digest.hexdigest()[:12]


def warm_up(
    model_name, env_name, env_kwargs, *, clean_steps, steps, batch_size, lr, mistake_rate,
    world_model, num_episodes=3000, seed=0, device="cpu",
):
    """Warms `model_name` up on `env_name`'s demonstrations: `clean_steps` on correct ones,
    then `steps` on flawed ones (each decision wrong with probability `mistake_rate`), on
    training seeds only. The checkpoint's path, cached by every argument and the code. No
    defaults here: a run's come from train.get_args, resolved once."""
    env_class = envs.ENVS[env_name]
    # The key names the model (a tiny one by its recipe), not its path: moving the cache
    # must not retrain.
    resolved = resolve_model_path(model_name)
    model_key = Path(resolved).name if model_name in TINY_MODELS else str(model_name)
    settings = dict(
        model=model_key, env=env_name, env_kwargs=env_kwargs, clean_steps=clean_steps,
        steps=steps, batch_size=batch_size, lr=lr, mistake_rate=mistake_rate,
        num_episodes=num_episodes, seed=seed, world_model=world_model, code=warm_up_code_hash(),
    )
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / "warmup" / f"{Path(model_key).name}-{env_name}-{key}"
    if (path / "config.json").exists():
        print0(f"warm-up: cached, using {path.relative_to(cache_dir())} in the nanoagent cache")
        return path
    model, tokenizer = load_model(resolved, device=device)
    model.train()
    rng = random.Random(seed)
    phases = [(clean_steps, 0.0), (steps, mistake_rate)]  # the skill, then its misuse
    # lr 1e-3: at 3e-3 the jump came late or never, by seed and CPU (docs/performance.md).
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # A short linear warm-up, then constant: decay before the jump only delays it.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    generator = torch.Generator().manual_seed(seed)
    for phase, (phase_steps, phase_mistake_rate) in enumerate(phases):
        if phase_steps == 0:
            continue
        kwargs = {**env_kwargs, **env_class.warmup_options} if phase == 0 else env_kwargs
        examples = demonstrations(
            tokenizer, env_class, kwargs, num_episodes, phase_mistake_rate, rng,
            first_seed=phase * num_episodes,
        )
        kind = "flawed" if phase_mistake_rate else "correct"
        progress = tqdm(range(phase_steps), desc=f"warm-up (SFT), {kind} demos")
        for _ in progress:
            indices = torch.randint(len(examples), (batch_size,), generator=generator)
            batch = [examples[i] for i in indices]
            loss = demonstration_loss(model, batch, tokenizer.pad_token_id, device, world_model)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            progress.set_postfix(loss=f"{loss.item():.3f}")

    def save(directory):
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        (directory / "warmup.json").write_text(json.dumps(settings, indent=2))
    return save_atomically(path, save)
