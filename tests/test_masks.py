import math
import random
import statistics
from types import SimpleNamespace

import pytest
import torch

from masks import (aggregate_loss, anchor_groups, compute_gae, explained_variance, gigpo_advantages, grpo_advantages,
                   kl_estimate, last_agent_positions, masked_mean, masked_whiten, place_rewards,
                   reinforce_pp_advantages, spread_over_turns, states_before_turns, value_loss)


# -----------------------------------------------------------------------------
# Random multi-turn batches and slow references written with plain Python loops

def random_batch(seed, B=6, T=40):
    """Rows: prompt, then agent turns alternating with env segments (may end on env), ragged, padded.
    Returns (mask, values, rewards) as float64 (B, T) and the per-row (turn_rewards, turn_ends) lists."""
    rng = random.Random(seed)
    mask = [[0] * T for _ in range(B)]
    rewards = [[0.0] * T for _ in range(B)]
    turn_rewards, turn_ends = [], []
    for b in range(B):
        length = rng.randint(T // 2, T)
        t = rng.randint(1, 4)  # prompt tokens stay 0
        row_rewards, row_ends = [], []
        while t < length:
            agent_len = min(rng.randint(1, 5), length - t)
            for i in range(t, t + agent_len):
                mask[b][i] = 1
            end = t + agent_len - 1
            row_rewards.append(rng.choice([0.0, 0.0, -0.5, 1.0, rng.uniform(-1, 1)]))
            row_ends.append(end)
            rewards[b][end] = row_rewards[-1]
            t = end + 1 + rng.randint(1, 4)  # an env segment (tool response); the row may end inside one
        turn_rewards.append(row_rewards)
        turn_ends.append(row_ends)
    values = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]  # also on env/pad: must be ignored
    as_tensor = lambda x: torch.tensor(x, dtype=torch.float64)
    return as_tensor(mask), as_tensor(values), as_tensor(rewards), turn_rewards, turn_ends


def slow_gae(rewards, values, mask, gamma, lam):
    """Closed form on the compacted agent tokens: A_k = sum_j (γλ)^(j-k) δ_j, δ_j = r_j + γ V_(j+1) − V_j."""
    B, T = mask.shape
    advantages = [[0.0] * T for _ in range(B)]
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t] == 1]
        v = [float(values[b][t]) for t in idx] + [0.0]
        deltas = [float(rewards[b][t]) + gamma * v[k + 1] - v[k] for k, t in enumerate(idx)]
        for k, t in enumerate(idx):
            advantages[b][t] = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, len(idx)))
            returns[b][t] = advantages[b][t] + v[k]
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


def slow_reinforce_pp(rewards, mask, gamma):
    """Return-to-go over the compacted agent tokens, then mean/stdev over all agent tokens of the batch."""
    B, T = mask.shape
    returns = {}
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t] == 1]
        for k, t in enumerate(idx):
            returns[b, t] = sum(gamma ** (j - k) * float(rewards[b][idx[j]]) for j in range(k, len(idx)))
    mean, std = statistics.mean(returns.values()), statistics.stdev(returns.values())
    out = torch.zeros(B, T, dtype=torch.float64)
    for (b, t), g in returns.items():
        out[b, t] = (g - mean) / std
    return out


def slow_grpo(scores, group_ids, scale_by_std, eps):
    out = []
    for i, score in enumerate(scores):
        group = [scores[j] for j in range(len(scores)) if group_ids[j] == group_ids[i]]
        if len(set(group)) == 1:
            out.append(0.0)
        elif scale_by_std:
            out.append((score - statistics.mean(group)) / (statistics.stdev(group) + eps))
        else:
            out.append(score - statistics.mean(group))
    return torch.tensor(out)


# -----------------------------------------------------------------------------
# GAE

@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_slow_reference(gamma, lam):
    for seed in range(5):
        mask, values, rewards, _, _ = random_batch(seed)
        advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
        ref_advantages, ref_returns = slow_gae(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(advantages, ref_advantages)
        torch.testing.assert_close(returns, ref_returns)
        assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


def test_gae_hand_computed():
    # agent tokens at 0, 1, 4; env tokens 2, 3 carry a large value the critic guessed, which must be ignored.
    mask = torch.tensor([[1.0, 1, 0, 0, 1]])
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 1]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # δ_4 = 1 − 0.4 = 0.6                A_4 = 0.6
    # δ_1 = 0.9·0.4 − 0.2 = 0.16         A_1 = 0.16 + 0.72·0.6 = 0.592
    # δ_0 = 0.9·0.2 − 0.5 = −0.32        A_0 = −0.32 + 0.72·0.592 = 0.10624
    torch.testing.assert_close(advantages, torch.tensor([[0.10624, 0.592, 0, 0, 0.6]]))
    torch.testing.assert_close(returns, torch.tensor([[0.60624, 0.792, 0, 0, 1.0]]))
    # γ = λ = 1: every agent token's advantage is the final reward minus its own value.
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.8, 0, 0, 0.6]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0, 0, 1.0]]))


def test_gae_bootstraps_a_cut_episode_from_its_last_value():
    # The same episode as above, cut by the budget: V(s_end) = 0.5 after its last agent token.
    mask = torch.tensor([[1.0, 1, 0, 0, 1], [1.0, 1, 0, 0, 1]])
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4]] * 2)
    rewards = torch.tensor([[0.0, 0, 0, 0, 1]] * 2)
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, last_values=torch.tensor([0.5, 0.0]))
    # δ_4 = 1 + 0.9·0.5 − 0.4 = 1.05     A_4 = 1.05
    # δ_1 = 0.9·0.4 − 0.2 = 0.16         A_1 = 0.16 + 0.72·1.05 = 0.916
    # δ_0 = 0.9·0.2 − 0.5 = −0.32        A_0 = −0.32 + 0.72·0.916 = 0.33952
    torch.testing.assert_close(advantages[0], torch.tensor([0.33952, 0.916, 0, 0, 1.05]))
    torch.testing.assert_close(returns[0], torch.tensor([0.83952, 1.116, 0, 0, 1.45]))
    torch.testing.assert_close(advantages[1], torch.tensor([0.10624, 0.592, 0, 0, 0.6]))  # ended: no bootstrap
    # Against the slow reference: bootstrapping is a reward of γ V(s_end) on the last agent token.
    for seed in range(3):
        mask, values, rewards, _, _ = random_batch(seed)
        last_values = torch.randn(mask.shape[0], dtype=values.dtype)
        shifted = rewards.clone()
        for b, positions in enumerate(last_agent_positions(mask)):
            if positions:
                shifted[b, positions[-1]] += 0.95 * last_values[b]
        advantages, returns = compute_gae(rewards, values, mask, 0.95, 0.9, last_values)
        ref_advantages, ref_returns = slow_gae(shifted, values, mask, 0.95, 0.9)
        torch.testing.assert_close(advantages, ref_advantages)
        torch.testing.assert_close(returns, ref_returns)


def test_inserting_env_tokens_changes_no_agent_advantage():
    mask, values, rewards, _, _ = random_batch(seed=11, B=4, T=30)
    rng = random.Random(0)
    new_rows = []  # (mask, values, rewards) rows with 1-6 extra env tokens after every agent segment
    for b in range(mask.shape[0]):
        m, v, r = [], [], []
        for t in range(mask.shape[1]):
            m.append(float(mask[b, t])), v.append(float(values[b, t])), r.append(float(rewards[b, t]))
            if mask[b, t] == 1 and (t + 1 == mask.shape[1] or mask[b, t + 1] == 0):
                for _ in range(rng.randint(1, 6)):
                    m.append(0.0), v.append(rng.gauss(0, 5)), r.append(0.0)
        new_rows.append((m, v, r))
    T_new = max(len(m) for m, _, _ in new_rows)
    pad = lambda row: row + [0.0] * (T_new - len(row))
    new_mask = torch.tensor([pad(m) for m, _, _ in new_rows], dtype=torch.float64)
    new_values = torch.tensor([pad(v) for _, v, _ in new_rows], dtype=torch.float64)
    new_rewards = torch.tensor([pad(r) for _, _, r in new_rows], dtype=torch.float64)
    agent_only = lambda x, m: [x[b][m[b] == 1] for b in range(len(x))]
    before, _ = compute_gae(rewards, values, mask, 0.9, 0.7)
    after, _ = compute_gae(new_rewards, new_values, new_mask, 0.9, 0.7)
    for a, b in zip(agent_only(before, mask), agent_only(after, new_mask)):
        torch.testing.assert_close(a, b)
    before = reinforce_pp_advantages(rewards, mask, 0.9)
    after = reinforce_pp_advantages(new_rewards, new_mask, 0.9)
    for a, b in zip(agent_only(before, mask), agent_only(after, new_mask)):
        torch.testing.assert_close(a, b)


# -----------------------------------------------------------------------------
# Reward placement

def test_last_agent_positions():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert last_agent_positions(mask) == [[2, 4, 7], [3], []]


def test_place_rewards_matches_random_batches():
    for seed in range(5):
        mask, _, rewards, turn_rewards, turn_ends = random_batch(seed)
        torch.testing.assert_close(place_rewards(turn_rewards, turn_ends, mask), rewards.float())
        assert last_agent_positions(mask) == turn_ends


def test_reward_of_trajectory_ending_on_env_token_is_kept():
    # prompt | turn 1 (a call) | tool response | turn 2 (a call, then max_turns hit) | tool response, end
    mask = torch.tensor([[0.0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0]])
    # The caller reports each turn's end as the end of its whole block, tool response included.
    token_rewards = place_rewards([[0.25, -1.0]], [[5, 10]], mask)
    assert token_rewards.tolist() == [[0, 0, 0, 0.25, 0, 0, 0, -1.0, 0, 0, 0]]
    assert place_rewards([[0.25, -1.0]], [last_agent_positions(mask)[0]], mask).equal(token_rewards)
    values = torch.zeros(1, 11)
    advantages, _ = compute_gae(token_rewards, values, mask, gamma=1.0, lam=1.0)
    assert advantages[0, 7] == -1.0 and advantages[0, 1] == -0.75
    # A reward naively left on the final (env) token would be lost: the estimators refuse it.
    naive = torch.zeros(1, 11)
    naive[0, -1] = -1.0
    with pytest.raises(AssertionError, match="non-agent token"):
        compute_gae(naive, values, mask, 1.0, 1.0)
    with pytest.raises(AssertionError, match="non-agent token"):
        reinforce_pp_advantages(naive, mask, 1.0)


def test_place_rewards_sums_turns_moved_onto_one_token():
    mask = torch.tensor([[0, 1, 0, 0]])
    assert place_rewards([[0.5, 1.0]], [[2, 3]], mask).tolist() == [[0, 1.5, 0, 0]]
    with pytest.raises(AssertionError, match="no agent token"):
        place_rewards([[1.0]], [[0]], mask)


# -----------------------------------------------------------------------------
# GRPO and REINFORCE++

def test_grpo_matches_slow_reference():
    rng = random.Random(3)
    for scale_by_std in (True, False):
        for _ in range(5):
            group_ids = [rng.randint(0, 5) for _ in range(24)]
            scores = [rng.choice([0.0, 1.0, 0.5, rng.uniform(-1, 1)]) for _ in range(24)]
            expected = slow_grpo(scores, group_ids, scale_by_std, 1e-6)
            torch.testing.assert_close(grpo_advantages(scores, group_ids, scale_by_std), expected)


def test_grpo_hand_computed_and_edge_cases():
    scores = [1.0, 0.0, 1.0, 0.0, 0.5, 0.1, 0.1, 0.1]
    group_ids = [7, 7, 7, 7, 3, 9, 9, 9]  # ids need not be contiguous
    # group 7: mean 0.5, unbiased std sqrt(1/3), so ±0.5 / 0.57735 = ±0.866025
    # group 3 (one sample): 0, not the raw score 0.5; group 9 (all equal): exactly 0 despite float rounding
    advantages = grpo_advantages(scores, group_ids)
    torch.testing.assert_close(advantages, torch.tensor([0.866025, -0.866025, 0.866025, -0.866025, 0, 0, 0, 0]))
    assert (advantages[4:] == 0).all()
    dr_grpo = grpo_advantages(scores, group_ids, scale_by_std=False)
    assert dr_grpo.tolist() == [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0]
    assert grpo_advantages([1.0, 1.0, 1.0], [0, 0, 0], eps=0.0).tolist() == [0, 0, 0]  # NaN-free even with eps 0
    assert torch.isfinite(grpo_advantages([1e-9, 0.0], [0, 0])).all()


def episode(group_id, states, rewards):
    """A trajectory as gigpo_advantages reads it: the states its turns acted on and their rewards."""
    messages = [{"role": "system", "content": "rules"}]
    for state, reward in zip(states, rewards):
        messages += [{"role": "user", "content": state}, {"role": "assistant", "content": "move"}]
    return SimpleNamespace(group_id=group_id, turn_rewards=list(rewards), score=sum(rewards),
                           messages=messages, turn_infos=[{} for _ in rewards])


def slow_gigpo(trajectories, gamma, omega, scale_by_std, eps=1e-6):
    """The paper's formulas in plain loops: A(τ) = (R(τ) − mean) / std over the group's episodes;
    for turn k, R_k = Σ_{j≥k} γ^(j−k) r_j and A_S = (R_k − mean) / std over the turns of the same group
    that acted on the same state (0 for an anchor group that does not vary); A = A(τ) + ω A_S."""
    def relative(value, group):
        if len(set(group)) == 1:
            return 0.0
        spread = statistics.stdev(group) + eps if scale_by_std else 1.0
        return (value - statistics.mean(group)) / spread
    turns = []  # (group, state, step return) of every turn of every trajectory
    for t in trajectories:
        states = states_before_turns(t.messages)
        for k, state in enumerate(states):
            step_return = sum(gamma ** (j - k) * t.turn_rewards[j] for j in range(k, len(states)))
            turns.append((t.group_id, state, step_return))
    out, index = [], 0
    for t in trajectories:
        group = [other.score for other in trajectories if other.group_id == t.group_id]
        episode_advantage = relative(t.score, group)
        row = []
        for _ in t.turn_rewards:
            group_id, state, step_return = turns[index]
            anchor = [r for g, s, r in turns if (g, s) == (group_id, state)]
            row.append(episode_advantage + omega * relative(step_return, anchor))
            index += 1
        out.append(row)
    return out


def test_gigpo_hand_computed():
    # One level, two episodes. Both start in state "A" (anchor group of two, as every group's first
    # turn is); episode 0 moves to "B" and solves it; episode 1 bumps a wall, stays in "A", then fails.
    trajectories = [episode(0, ["A", "B"], [-0.1, 1.0]), episode(0, ["A", "A"], [-0.1, -0.1])]
    # Episode scores 0.9 and -0.2: mean 0.35, unbiased std 0.7778, A(τ) = ±0.707107.
    # Step returns (γ = 0.5): episode 0: -0.1 + 0.5 * 1.0 = 0.4, then 1.0; episode 1: -0.15, -0.1.
    # Anchor "A": {0.4, -0.15, -0.1}: mean 0.05, std 0.304138, so +1.150793, -0.657596, -0.493197;
    # anchor "B" holds one turn: 0.
    (first, second), (third, fourth) = gigpo_advantages(trajectories, gamma=0.5, omega=1.0)
    assert first == pytest.approx(0.707107 + 1.150793, abs=1e-5)
    assert second == pytest.approx(0.707107, abs=1e-5)
    assert third == pytest.approx(-0.707107 - 0.657596, abs=1e-5)
    assert fourth == pytest.approx(-0.707107 - 0.493197, abs=1e-5)
    expected = slow_gigpo(trajectories, 0.5, 1.0, True)
    assert [first, second, third, fourth] == pytest.approx(expected[0] + expected[1])


def test_gigpo_matches_slow_reference():
    rng = random.Random(5)
    for scale_by_std in (True, False):
        for _ in range(5):
            trajectories = []
            for _ in range(16):
                turns = rng.randint(1, 6)
                states = [rng.choice("ABCDE") for _ in range(turns)]
                rewards = [rng.choice([0.0, -0.1, 1.0, rng.uniform(-1, 1)]) for _ in range(turns)]
                trajectories.append(episode(rng.randint(0, 3), states, rewards))
            gamma, omega = rng.choice([1.0, 0.95, 0.5]), rng.choice([1.0, 0.5])
            expected = slow_gigpo(trajectories, gamma, omega, scale_by_std)
            got = gigpo_advantages(trajectories, gamma, omega, scale_by_std)
            for row, expected_row in zip(got, expected):
                assert row == pytest.approx(expected_row, abs=1e-5)


def test_gigpo_without_repeated_states_is_grpo():
    rng = random.Random(6)
    trajectories = [episode(g, [f"{g}/{i}/{k}" for k in range(3)], [rng.uniform(-1, 1) for _ in range(3)])
                    for g in range(3) for i in range(4)]
    grpo = grpo_advantages([t.score for t in trajectories], [t.group_id for t in trajectories]).tolist()
    for row, expected in zip(gigpo_advantages(trajectories, gamma=0.95), grpo):
        assert row == [expected] * 3


def test_a_turns_own_state_keys_its_anchor_group_over_its_messages():
    # Messages that never repeat, states that do (an --agent program's report, serve.py): the states decide.
    reported = [episode(0, ["A1", "B1"], [-0.1, 1.0]), episode(0, ["A2", "A3"], [-0.1, -0.1])]
    for trajectory, states in zip(reported, (["A", "B"], ["A", "A"])):
        trajectory.turn_infos = [{"state": state} for state in states]
    shown = [episode(0, ["A", "B"], [-0.1, 1.0]), episode(0, ["A", "A"], [-0.1, -0.1])]
    assert anchor_groups(reported) == anchor_groups(shown) == [0, 1, 0, 0]
    assert gigpo_advantages(reported, gamma=0.5) == gigpo_advantages(shown, gamma=0.5)


def test_states_before_turns_reads_the_observations_a_turn_acted_on():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "t1"},
                {"role": "tool", "content": "t2"}, {"role": "assistant", "content": "a2"}]
    assert states_before_turns(messages) == [repr(["u"]), repr(["t1", "t2"])]


def test_turn_advantages_land_on_their_own_turns_agent_tokens_only():
    # Row 0: prompt 0-1, turn 0 at 2-3, env 4-5, turn 1 at 6-8, env 9. Row 1: prompt 0, turn 0 at 1-2,
    # env 3, then a turn cut by the token budget whose end moved back onto turn 0's last token.
    action_mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    spread = spread_over_turns([[0.5, -2.0], [3.0, 7.0]], [[3, 8], [2, 2]], action_mask)
    assert spread.tolist() == [[0, 0, 0.5, 0.5, 0, 0, -2.0, -2.0, -2.0, 0],
                               [0, 3.0, 3.0, 0, 0, 0, 0, 0, 0, 0]]


def test_reinforce_pp_matches_slow_reference():
    for seed in range(5):
        mask, _, rewards, _, _ = random_batch(seed)
        for gamma in (1.0, 0.9):
            advantages = reinforce_pp_advantages(rewards, mask, gamma)
            torch.testing.assert_close(advantages, slow_reinforce_pp(rewards, mask, gamma))
            assert (advantages[mask == 0] == 0).all()


def test_reinforce_pp_hand_computed():
    mask = torch.tensor([[1.0, 1, 0, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 1]])
    # returns-to-go with γ = 0.5 over agent tokens 0, 1, 3: 0.25, 0.5, 1.0; mean 7/12,
    # unbiased std sqrt(0.1458333) = 0.3818813; whitened: -0.872872, -0.218218, 1.091089
    advantages = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[-0.872872, -0.218218, 0, 1.091089]]))


# -----------------------------------------------------------------------------
# Masked reductions, loss aggregation, KL

def test_masked_mean_and_whiten_ignore_off_mask_values():
    values = torch.tensor([[1.0, 2.0, torch.inf], [3.0, torch.nan, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_mean(values, mask) == 2.75
    assert masked_mean(values, mask, dim=-1).tolist() == [1.5, 4.0]
    whitened = masked_whiten(values, mask)
    assert whitened[0, 2] == 0 and whitened[1, 1] == 0
    kept = whitened[mask == 1]
    assert abs(kept.mean()) < 1e-6 and abs(kept.std() - 1) < 1e-6


def test_explained_variance_hand_computed_and_against_a_slow_reference():
    returns = torch.tensor([[1.0, 2.0, 99.0], [3.0, -7.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])  # kept returns 1, 2, 3, 4
    assert explained_variance(returns.clone(), returns, mask) == 1.0  # a perfect critic
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask) == pytest.approx(0.0, abs=1e-7)
    # values 1, 1, 4, 4: errors 0, 1, -1, 0 (variance 2/3 against the returns' 5/3): 1 - 2/5
    values = torch.tensor([[1.0, 1.0, 0.0], [4.0, 0.0, 4.0]])
    assert explained_variance(values, returns, mask) == pytest.approx(0.6)
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask))  # returns that do not vary
    random_returns, random_values = torch.randn(4, 9), torch.randn(4, 9)
    random_mask = torch.rand(4, 9) < 0.6
    kept_returns, kept_values = random_returns[random_mask].tolist(), random_values[random_mask].tolist()
    errors = [r - v for r, v in zip(kept_returns, kept_values)]
    slow = 1 - statistics.variance(errors) / statistics.variance(kept_returns)
    assert explained_variance(random_values, random_returns, random_mask) == pytest.approx(slow, rel=1e-5)


def test_aggregate_loss_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, torch.inf, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert aggregate_loss(loss, mask, "token-mean") == 2.5  # (1+2+3+4) / 4 tokens
    assert aggregate_loss(loss, mask, "seq-mean-token-mean") == 3.0  # (mean 2 + mean 4) / 2 rows
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm") == 1.25  # (6 + 4) / 4 (T) / 2 rows
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=10) == 0.5
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "mean")


def test_kl_estimators_hand_computed():
    logprobs = torch.log(torch.tensor([[0.5, 0.5]]))
    ref_logprobs = torch.log(torch.tensor([[0.25, 0.9]]))
    mask = torch.tensor([[1, 0]])
    # log_ratio = ln 2 = 0.693147; k2 = ln²2 / 2 = 0.240227; k3 = 1/2 − 1 + ln 2 = 0.193147
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, mask, "k1"), torch.tensor([[0.693147, 0]]))
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, mask, "k2"), torch.tensor([[0.240227, 0]]))
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, mask, "k3"), torch.tensor([[0.193147, 0]]))


def test_k1_and_k3_are_unbiased_and_k3_is_nonnegative():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    true_kl = float((p * (p / q).log()).sum())  # 0.274887
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logprobs, ref_logprobs = p.log()[samples][None], q.log()[samples][None]  # (1, N)
    mask = torch.ones_like(logprobs)
    for kind in ("k1", "k3"):
        assert abs(kl_estimate(logprobs, ref_logprobs, mask, kind).mean() - true_kl) < 0.01, kind
    assert (kl_estimate(logprobs, ref_logprobs, mask, "k3") >= 0).all()


# -----------------------------------------------------------------------------
# Gradient isolation with a tiny model

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_masked_policy_loss_gets_no_gradient_from_env_positions(mode):
    from nanoagent.models import tiny_model, tiny_tokenizer
    model = tiny_model(tiny_tokenizer(), seed=0)
    torch.manual_seed(0)
    input_ids = torch.randint(0, 800, (2, 13))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0]])  # (B, T-1)
    advantages = torch.randn(2, 12)
    logits = model(input_ids).logits[:, :-1]  # (B, T-1, V): position t predicts token t+1
    logits.retain_grad()
    logprobs = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    loss = aggregate_loss(-advantages * logprobs, mask, mode)
    loss.backward()
    env = mask == 0
    assert (logits.grad[env] == 0).all(), "an environment token sent gradient into the model"
    assert (logits.grad[~env].abs().sum(-1) > 0).all()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    # Perturbing the env tokens' log-probs, even to ±inf, leaves the loss exactly unchanged.
    noise = torch.where(env, torch.randn(2, 12) * 100, 0.0)
    noise[0, 0], noise[1, -1] = -torch.inf, torch.inf
    perturbed = aggregate_loss(-advantages * (logprobs.detach() + noise), mask, mode)
    assert perturbed == loss.detach()


def test_clipped_value_loss_matches_hand_computed_values():
    # 0.5 max((V - R)^2, (clip(V, V_old +- 0.2) - R)^2), token by token: the clip binds only where it makes the
    # loss larger (PPO's pessimistic value loss).
    values, old = torch.tensor([[1.0, 0.5, 0.0]]), torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[0.0, 1.0, 0.1]])
    expected = []
    for v, o, r in zip(values[0].tolist(), old[0].tolist(), returns[0].tolist()):
        clipped = o + max(-0.2, min(0.2, v - o))
        expected.append(0.5 * max((v - r) ** 2, (clipped - r) ** 2))
    assert expected == pytest.approx([0.5, 0.125, 0.02])  # token 3: the clipped 0.3 is further from R than 0.0
    assert torch.allclose(value_loss(values, old, returns, 0.2), torch.tensor([expected]))
