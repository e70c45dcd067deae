"""sft.py: the warm-up's loss against a plain loop, the assistant-token mask by hand, train.py's warm-up flags."""

import random

import pytest
import torch

import envs
import rollout
import sft
import train
from nanoagent.models import load_model


@pytest.mark.parametrize("env_class, world_model", [(envs.SyntheticQAEnv, 0.0), (envs.SokobanEnv, 0.7)])
def test_demonstration_loss_matches_a_plain_loop_in_value_and_gradients(env_class, world_model):
    model, tokenizer = load_model("tiny")
    batch = sft.demonstrations(tokenizer, env_class, {}, 5, 0.5, random.Random(0), first_seed=0)
    batch.append(batch[0])  # a repeated demonstration shares all of its prompt with the first
    assert len({len(ids) for ids, _ in batch}) > 1  # rows of different lengths: the padding is exercised
    shared = sft.demonstration_loss(model, batch, tokenizer.pad_token_id, world_model=world_model)
    shared.backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    # Reference: each row on its own, every position through the LM head, token by token: the mean loss
    # over all assistant tokens of the batch, plus world_model times the mean over the env's tokens (those
    # after a row's first assistant token that are not assistant tokens).
    totals, counts = [0.0, 0.0], [0, 0]
    for ids, mask in batch:
        logits = model(torch.tensor([ids])).logits[0]  # (T, V)
        for t in range(1, len(ids)):
            kind = 0 if mask[t] else 1 if t > mask.index(1) else None
            if kind is not None:
                loss = torch.nn.functional.cross_entropy(logits[t - 1], torch.tensor(ids[t]))
                totals[kind], counts[kind] = totals[kind] + loss, counts[kind] + 1
    assert counts[1] > counts[0]  # the env writes more tokens than the replies
    plain = totals[0] / counts[0] + (world_model * totals[1] / counts[1] if world_model else 0.0)
    plain.backward()
    assert torch.allclose(shared, plain, atol=1e-5), (shared.item(), plain.item())
    for parameter, shared_grad in zip(model.parameters(), shared_grads):
        assert torch.allclose(parameter.grad, shared_grad, atol=1e-5, rtol=1e-4)


def test_the_shared_opening_pass_gives_the_same_gradients_every_time_with_two_threads():
    # Reading one prompt's keys and values into many rows by advanced indexing made the backward pass add into
    # them with parallel atomic adds: with two threads, the same batch gave gradients 1e-8 apart from call to
    # call, and two identical warm-ups ended 1e-6 apart (chaos from there). index_select adds in a fixed order.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, tokenizer = load_model("tiny")
        batch = sft.demonstrations(tokenizer, envs.SyntheticQAEnv, {}, 16, 0.0, random.Random(0), first_seed=0)
        runs = []
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            sft.demonstration_loss(model, batch, tokenizer.pad_token_id).backward()
            runs.append([p.grad.clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other))
    finally:
        torch.set_num_threads(threads)


def test_assistant_token_mask_by_hand():
    _, tokenizer = load_model("tiny")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"},
                {"role": "tool", "content": "x"}, {"role": "assistant", "content": "No"}]
    ids = rollout.encode_chat(tokenizer, messages, [])
    mask = sft.assistant_token_mask(tokenizer, ids)
    marked = tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    assert marked == "Yes<|im_end|>No<|im_end|>"


def test_train_py_warm_up_flags_set_its_batch_and_its_cache_key(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOAGENT_CACHE", str(tmp_path))
    sizes, loss = [], sft.demonstration_loss

    def counted_loss(model, batch, *rest):
        sizes.append(len(batch))
        return loss(model, batch, *rest)

    monkeypatch.setattr(sft, "demonstration_loss", counted_loss)
    flags = ["--env", "bandit", "--warmup_clean_steps", "2", "--warmup_steps", "1"]
    paths = [train.warm_up(train.get_args(flags + extra))
             for extra in ([], ["--warmup_batch_size", "3"], ["--warmup_world_model", "0.5"])]
    assert sizes == [16] * 3 + [3] * 3 + [16] * 3 and len(set(paths)) == 3  # every step, both phases; cached apart
