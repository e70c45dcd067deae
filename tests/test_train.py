"""train.py: the loss, the mask, clipping, filtering, configuration checks, resume, torchrun, and learning."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from nanoagent.models import load_critic, load_model
from rollout import Trajectory

REPO = Path(__file__).resolve().parent.parent
# Half a minute of SFT teaches the bandit's answer format, picking arms half and half (cached across tests).
BANDIT = ["--env", "bandit", "--warmup_clean_steps", "0", "--warmup_steps", "300", "--warmup_mistake_rate", "0.5", "--max_turns", "1",
          "--max_new_tokens", "8", "--max_total_tokens", "160", "--prompts_per_step", "4", "--group_size", "4",
          "--eval_every", "0", "--lr", "1e-3"]


def trajectory(group_id, score):
    return Trajectory(token_ids=[1, 2], action_mask=[0, 1], logprobs=[0.0, -1.0], prompt_length=1, turn_rewards=[score],
                      turn_end_positions=[1], score=score, group_id=group_id, seed=group_id, truncated=False,
                      num_turns=1, info={"success": score > 0}, messages=[])


def test_filter_keeps_the_groups_with_the_largest_reward_std():
    scores = {0: [1, 1, 1, 1], 1: [0, 1, 0, 1], 2: [0, 0, 0, 1], 3: [0, 0, 0, 0]}  # stds 0, .5, .433, 0
    batch = [trajectory(group, score) for group, group_scores in scores.items() for score in group_scores]
    kept = train.keep_high_variance_groups(batch, 0.5)
    assert sorted({t.group_id for t in kept}) == [1, 2] and len(kept) == 8
    assert {t.group_id for t in train.keep_high_variance_groups(batch, 0.25)} == {1}
    assert len(train.keep_high_variance_groups(batch, 1.0)) == 16
    assert {t.group_id for t in train.keep_high_variance_groups(batch, 0.01)} == {1}  # always at least one group


def test_decoupled_clipping_on_crafted_ratios():
    old = torch.zeros(1, 6)
    ratios = torch.tensor([[0.5, 0.79, 1.0, 1.25, 1.29, 2.0]])
    mask = torch.ones(1, 6)
    for advantage in (1.0, -1.0):
        advantages = torch.full((1, 6), advantage)
        loss, ratio = train.policy_loss(ratios.log(), old, advantages, mask, 0.2, 0.28, "token-mean", None)
        # Reference, token by token: min(r A, clip(r, 0.8, 1.28) A), negated and averaged.
        expected = [-min(r * advantage, min(max(r, 0.8), 1.28) * advantage) for r in ratios[0].tolist()]
        assert loss.item() == pytest.approx(sum(expected) / 6, abs=1e-6)
        assert torch.allclose(ratio, ratios)
    # Gradient flows only where the clip is inactive: positive advantage -> ratios above 1.28 are frozen.
    logprobs = ratios.log().requires_grad_()
    train.policy_loss(logprobs, old, torch.ones(1, 6), mask, 0.2, 0.28, "token-mean", None)[0].backward()
    assert (logprobs.grad[0, 4:] == 0).all() and (logprobs.grad[0, 1:4] != 0).all()


@pytest.fixture(scope="module")
def tiny_batch():
    model, tokenizer = load_model("tiny")
    torch.manual_seed(0)
    input_ids = torch.randint(10, 800, (3, 20))
    attention_mask = torch.ones_like(input_ids)
    action_mask = torch.zeros(3, 20, dtype=torch.long)
    action_mask[:, 5:9], action_mask[:, 14:18] = 1, 1  # two agent turns, env tokens between
    return model, input_ids, attention_mask, action_mask[:, 1:].float()


def test_on_policy_ratio_is_exactly_one_and_a_single_update_lowers_the_loss(tiny_batch):
    model, input_ids, attention_mask, mask = tiny_batch
    model = type(model)(model.config)
    model.load_state_dict(tiny_batch[0].state_dict())
    advantages = torch.tensor([[1.0], [-0.5], [0.7]]) * mask
    with torch.no_grad():
        old, _ = train.token_logprobs(model, input_ids, attention_mask, 1.0)
    logprobs, _ = train.token_logprobs(model, input_ids, attention_mask, 1.0)
    loss, ratio = train.policy_loss(logprobs, old, advantages, mask, 0.2, 0.2, "token-mean", None)
    assert torch.equal(ratio, torch.ones_like(ratio))  # same weights, same inputs: the ratio is exactly 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after, _ = train.policy_loss(train.token_logprobs(model, input_ids, attention_mask, 1.0)[0], old, advantages,
                                     mask, 0.2, 0.2, "token-mean", None)
    assert after.item() < loss.item()


def test_log_probs_match_a_plain_loop_and_positions_only_skip_work(tiny_batch):
    model, input_ids, attention_mask, mask = tiny_batch
    attention_mask = attention_mask.clone()
    attention_mask[2, 18:] = 0  # padding at the end of one row, after its last agent token
    temperature = 0.7
    full, full_entropy = train.token_logprobs(model, input_ids, attention_mask, temperature, with_entropy=True)
    only, only_entropy = train.token_logprobs(model, input_ids, attention_mask, temperature, mask, with_entropy=True)
    with torch.no_grad():  # reference: the whole model's logits, one token at a time
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits / temperature  # (B, T, V)
    for row in range(3):
        for t in range(19):
            if not attention_mask[row, t + 1]:
                assert full[row, t] == 0
                continue
            distribution = torch.log_softmax(logits[row, t], dim=-1)
            assert full[row, t].item() == pytest.approx(distribution[input_ids[row, t + 1]].item(), abs=1e-5)
            entropy = -(distribution.exp() * distribution).sum().item()
            assert full_entropy[row, t].item() == pytest.approx(entropy, abs=1e-5)
    assert torch.allclose(only[mask == 1], full[mask == 1], atol=1e-6) and (only[mask == 0] == 0).all()
    assert torch.allclose(only_entropy[mask == 1], full_entropy[mask == 1], atol=1e-6)
    # The same gradient either way: positions outside the mask never reached the loss.
    gradients = []
    for positions in (None, mask):
        model.zero_grad(set_to_none=True)
        logprobs, _ = train.token_logprobs(model, input_ids, attention_mask, temperature, positions)
        (logprobs * mask).sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6)


def test_shared_prompt_pass_matches_separate_rows_in_values_and_gradients(tiny_batch):
    model = tiny_batch[0]
    torch.manual_seed(1)
    # Two groups of three rows: prompts of 6 and 4 tokens, then rests of different lengths, right-padded.
    prompts = [torch.randint(10, 800, (6,)).tolist(), torch.randint(10, 800, (4,)).tolist()]
    rests = [torch.randint(10, 800, (n,)).tolist() for n in (7, 3, 9, 5, 1, 0)]
    rows = [prompts[row // 3] + rest for row, rest in enumerate(rests)]
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])  # (6, 15)
    attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    prompt_lengths = torch.tensor([len(prompts[row // 3]) for row in range(6)])
    # The loss positions: every position from the last prompt token on (it predicts the first agent token).
    positions = attention_mask[:, 1:] * (torch.arange(width - 1) >= prompt_lengths[:, None] - 1)  # (6, 14)
    results = []
    for shared in (None, prompt_lengths):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = train.token_logprobs(model, input_ids, attention_mask, 0.7, positions, with_entropy=True,
                                                 prompt_lengths=shared)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    (plain, plain_entropy, plain_grads), (shared, shared_entropy, shared_grads) = results
    assert positions.sum() == 7 + 3 + 9 + 5 + 1 and (shared[positions == 1] != 0).all()
    assert torch.allclose(plain, shared, atol=1e-5) and torch.allclose(plain_entropy, shared_entropy, atol=1e-5)
    for plain_grad, shared_grad in zip(plain_grads, shared_grads):
        assert torch.allclose(plain_grad, shared_grad, atol=1e-5, rtol=1e-4)
    # The prompt's own log-probs are not computed on the shared path: asking for them is an error.
    with pytest.raises(AssertionError, match="leave out the prompt"):
        train.token_logprobs(model, input_ids, attention_mask, 1.0, attention_mask[:, 1:], prompt_lengths=prompt_lengths)


def test_critic_values_with_a_shared_prompt_pass_match_and_have_no_dropout_noise(tmp_path):
    model, tokenizer = load_model("tiny")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    critic = load_critic(tmp_path).train()  # trained in train mode: its values must still be deterministic
    torch.nn.init.normal_(critic.score.weight)
    torch.manual_seed(2)
    input_ids = torch.cat([torch.randint(10, 800, (1, 5)).repeat(4, 1), torch.randint(10, 800, (4, 6))], dim=1)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0
    prompt_lengths = torch.tensor([5, 5, 5, 5])
    plain = train.critic_values(critic, input_ids, attention_mask)
    assert torch.equal(plain, train.critic_values(critic, input_ids, attention_mask))
    shared = train.critic_values(critic, input_ids, attention_mask, prompt_lengths)
    read = (attention_mask[:, 1:] == 1) & (torch.arange(10) >= 4)  # from the last prompt token on
    assert torch.allclose(plain[read], shared[read], atol=1e-5)


def test_environment_tokens_get_no_gradient(tiny_batch):
    model, input_ids, attention_mask, mask = tiny_batch
    advantages = torch.randn(3, 19)  # nonzero everywhere, env positions included
    logprobs, _ = train.token_logprobs(model, input_ids, attention_mask, 1.0)
    logprobs.retain_grad()
    loss, _ = train.policy_loss(logprobs, logprobs.detach(), advantages, mask, 0.2, 0.2, "token-mean", None)
    loss.backward()
    assert (logprobs.grad[mask == 0] == 0).all() and (logprobs.grad[mask == 1] != 0).all()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("argv, message", [
    (["--algo", "grpo", "--group_size", "1"], "--group_size must be at least 2"),
    (["--filter_ratio", "0"], "--filter_ratio must be in (0, 1]"),
    (["--filter_ratio", "1.5"], "--filter_ratio must be in (0, 1]"),
    (["--algo", "grpo", "--kl", "in_reward"], "--kl in_reward needs per-token credit"),
    (["--critic_warmup", "3"], "--critic_warmup needs a critic"),
    (["--env", "search_qa"], "--env search_qa needs --data"),
    (["--max_new_tokens", "600", "--max_total_tokens", "512"], "--max_new_tokens must be below"),
])
def test_bad_configurations_fail_with_their_message(argv, message, capsys):
    with pytest.raises(SystemExit):
        train.get_args(argv)
    assert message in capsys.readouterr().err


def test_starpo_s_sets_its_values_and_explicit_flags_win():
    args = train.get_args(["--starpo_s"])
    assert (args.algo, args.filter_ratio, args.clip_low, args.clip_high, args.kl) == ("ppo", 0.25, 0.2, 0.28, "none")
    args = train.get_args(["--starpo_s", "--clip_high", "0.3", "--filter_ratio", "0.5"])
    assert (args.algo, args.filter_ratio, args.clip_high) == ("ppo", 0.5, 0.3)
    assert train.get_args([]).algo == "grpo" and train.get_args([]).filter_ratio == 1.0


def test_echo_trap_monitor_warns_on_std_collapse_and_grad_spike():
    calm = [{"group_reward_std": 0.4, "grad_norm": 1.0, "success": 0.3} for _ in range(12)]
    assert train.echo_trap_warnings(calm) == []
    blip = calm + [{"group_reward_std": 0.0, "grad_norm": 1.0, "success": 0.3}]
    assert train.echo_trap_warnings(blip) == []  # one flat step is noise, not collapse
    collapsed = calm + [{"group_reward_std": 0.01, "grad_norm": 1.0, "success": 0.3}] * 5
    assert "in-group reward std fell" in train.echo_trap_warnings(collapsed)[0]
    solved = calm + [{"group_reward_std": 0.0, "grad_norm": 1.0, "success": 1.0}] * 5
    assert train.echo_trap_warnings(solved) == []  # a solved task has flat groups for a good reason
    spike = calm + [{"group_reward_std": 0.4, "grad_norm": 50.0, "success": 0.3}]
    assert "gradient norm" in train.echo_trap_warnings(spike)[0]


def parameters_of(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_resume_gives_the_same_weights_as_an_unbroken_run(tmp_path):
    common = BANDIT + ["--algo", "ppo", "--ppo_epochs", "2", "--minibatch_size", "8", "--save_every", "2"]
    straight, _ = train.main(common + ["--steps", "4", "--out_dir", str(tmp_path / "straight")])
    train.main(common + ["--steps", "2", "--out_dir", str(tmp_path / "broken")])
    resumed, history = train.main(common + ["--steps", "4", "--out_dir", str(tmp_path / "broken"), "--resume"])
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    before, after = parameters_of(straight), parameters_of(resumed)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    lines = (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert (tmp_path / "broken" / "step_000004" / "critic" / "config.json").exists()
    assert (tmp_path / "broken" / "latest").read_text().strip() == "step_000004"
    with pytest.raises(AssertionError, match="already holds a run"):  # never silently overwrite a run
        train.main(common + ["--steps", "4", "--out_dir", str(tmp_path / "straight")])


def test_resume_after_lost_steps_logs_each_step_once(tmp_path):
    run = tmp_path / "run"
    common = BANDIT + ["--save_every", "2", "--out_dir", str(run)]
    train.main(common + ["--steps", "3"])
    # A crash after step 3 but before its checkpoint: the newest complete checkpoint is step 2.
    shutil.rmtree(run / "step_000003")
    (run / "latest").write_text("step_000002")
    train.main(common + ["--steps", "4", "--resume"])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_torchrun_two_processes_end_with_identical_weights(tmp_path):
    script = tmp_path / "run.py"
    # Each rank writes its weights' hash to a file of its own (two ranks printing to one pipe can interleave).
    script.write_text(
        "import hashlib, os, sys, torch, train\n"
        "policy, history = train.main(sys.argv[1:])\n"
        "digest = hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in policy.parameters())).hexdigest()\n"
        f"open(os.path.join({str(tmp_path)!r}, 'weights-' + os.environ['RANK']), 'w').write(digest)\n")
    # Warm up once here, so the two ranks only read the cache.
    train.warm_up(train.get_args(BANDIT))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         *BANDIT, "--steps", "2", "--out_dir", str(tmp_path / "ddp")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    digests = [(tmp_path / f"weights-{rank}").read_text() for rank in (0, 1)]
    assert len(digests[0]) == 64 and digests[0] == digests[1]
    metrics = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and metrics[-1]["kept_trajectories"] == 8  # 2 prompts x 4 samples on each rank


def test_grpo_learns_the_bandits_high_risk_arm(tmp_path):
    # The high-risk arm is worth 0.25 a pull, the safe one 0.1: GRPO must learn to prefer the risky arm
    # from noisy rewards (it pays nothing 3 times in 4). ~45 s of CPU.
    _, history = train.main(BANDIT + ["--algo", "grpo", "--steps", "60", "--prompts_per_step", "8",
                                           "--group_size", "8", "--eval_every", "30", "--eval_episodes", "128",
                                           "--out_dir", str(tmp_path / "bandit")])
    start, end = history[0]["eval_success"], history[-1]["eval_success"]
    assert start < 0.5  # the warm-up picks arms half and half (and sometimes names no arm at all)
    assert end > 0.6 and end > start + 0.15  # held-out seeds: the high-risk arm, most of the time
