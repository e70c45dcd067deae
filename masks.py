"""
Masks, reward placement and advantage estimators for multi-turn agent RL.

An agent trajectory is one token sequence written by two authors: the model (its
reasoning, tool calls, answers) and the environment (the prompt, tool responses, game
observations, chat-template glue). Training must tell them apart. A 10-token example:

    t  token               written by    action_mask  reward
    0  "What is 2+3*4?"    env (prompt)  0
    1  <tool_call>         agent         1
    2  "2+3*4"             agent         1
    3  </tool_call>        agent         1            0.0  <- turn 1 ends here (process reward)
    4  <tool_response>     env           0
    5  "14"                env           0
    6  </tool_response>    env           0
    7  <answer>            agent         1
    8  "14"                agent         1
    9  </answer>           agent         1            1.0  <- final reward, last agent token

The **action (loss) mask** says where gradient flows: log π(token) counts only for
tokens the policy chose. Tokens 4-6 are the calculator's; training on them would teach
the model to imitate tools (and hallucinate observations), not use them.

The **advantage mask** says which positions take part in credit assignment. GAE runs
over t = 1,2,3,7,8,9 as if 4-6 were not there: the TD error of token 3 bootstraps from
V at token 7, the agent's next decision (δ_3 = r_3 + γ V_7 − V_3), and
A_3 = δ_3 + γλ A_7. The tool's tokens are the environment's move, not agent timesteps.
GAE over every token would discount once per tool-output token (a long search result
would cost its call credit), and the critic's guesses on tokens the agent never acts on
would leak into its advantages.
With the skip, environment tokens inserted between turns change no agent token's
advantage (the tests check it). Both masks are one tensor here, `action_mask`; they
are named apart because they answer different questions.

**Reward placement.** A turn's reward goes on the last token the agent wrote in it, the
final reward on the trajectory's last agent token (token 9 above). Never on an env
token: every estimator reads rewards only where the mask is 1, so it would be silently
lost. The trap is a trajectory that *ends* on a tool response (max_turns right after
a call, or truncation): "reward on the last token" would drop it. `place_rewards` moves
such positions back to the nearest agent token before them, and the estimators assert
that no reward is left off the mask.

Also here: the masked reductions the loss needs (aggregation modes, KL estimators),
`collate` (trajectories -> (B, T) tensors, masks and placed rewards included), the
advantage estimators: GAE (PPO's, with a critic), GRPO / Dr.GRPO, GiGPO, REINFORCE++, and
the losses through the mask: PPO's clipped policy and value losses.
This file imports nothing from the project: rollout.py makes trajectories, this file
reads them (and nanoagent/report.py shows who wrote what).
All per-token tensors are (B, T): B trajectories, T token positions, padding has mask 0.
"""

import torch
from torch.nn.utils.rnn import pad_sequence


# -----------------------------------------------------------------------------
# Masked reductions

def masked_sum(values, mask, dim=None):
    """Sum of values where mask is 1; where(), not values * mask: inf/nan off it stay out."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values, mask, dim=None):
    """Mean of values where mask is 1 (over all, or along dim); 0 for an empty mask."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_variance(values, mask, global_sum=None):
    """(mean, values - mean with 0 off the mask, unbiased variance) where mask is 1. With
    the batch split over ranks, global_sum (nanoagent.parallel.sum_over_ranks) makes them
    the whole batch's."""
    total = (lambda tensor: tensor) if global_sum is None else global_sum
    sum_and_count = total(torch.stack([masked_sum(values, mask), mask.sum().to(values.dtype)]))
    mean = sum_and_count[0] / sum_and_count[1].clamp(min=1)
    centered = torch.where(mask.bool(), values - mean, torch.zeros_like(values))
    variance = total(masked_sum(centered ** 2, mask)) / (sum_and_count[1] - 1).clamp(min=1)
    return mean, centered, variance


def masked_whiten(values, mask, eps=1e-8, global_sum=None):
    """(values - mean) / std where mask is 1 (masked_variance); 0 off the mask."""
    _, centered, variance = masked_variance(values, mask, global_sum)
    return centered * torch.rsqrt(variance + eps)


def explained_variance(values, returns, mask, global_sum=None):
    """1 - Var[returns - values] / Var[returns] where mask is 1, a float: how much of the
    returns the critic predicts (CleanRL logs it beside approx KL). 1 is perfect, 0 no
    better than a constant, below 0 worse; nan when the returns do not vary."""
    variance_of_returns = masked_variance(returns, mask, global_sum)[2]
    if variance_of_returns == 0:
        return float("nan")
    return (1 - masked_variance(returns - values, mask, global_sum)[2] / variance_of_returns).item()


def aggregate_loss(loss_per_token, mask, mode, norm_constant=None, global_sum=None):
    """
    A (B, T) per-token loss -> a scalar over the masked tokens. Modes:
      "token-mean": every agent token in the batch weighs the same (DAPO); long
        trajectories made more decisions and count more.
      "seq-mean-token-mean": mean over each trajectory's tokens, then over trajectories
        (original GRPO): a token in a long one weighs less, the length bias Dr.GRPO
        points out.
      "seq-mean-token-sum-norm": each trajectory's token sum over a constant
        (norm_constant, default T), then the mean (Dr.GRPO): one token weight, which
        does not move with the batch.
    With the batch split over ranks, global_sum counts the whole batch's tokens (or
    trajectories): each rank's result is its share of the batch's loss.
    """
    if mode == "token-mean":
        total, count = masked_sum(loss_per_token, mask), mask.sum()
    elif mode == "seq-mean-token-mean":  # a trajectory with no agent tokens counts 0
        total = masked_mean(loss_per_token, mask, dim=-1).sum()
        count = mask.new_tensor(mask.shape[0])
    elif mode == "seq-mean-token-sum-norm":
        norm_constant = mask.shape[-1] if norm_constant is None else norm_constant
        total = (masked_sum(loss_per_token, mask, dim=-1) / norm_constant).sum()
        count = mask.new_tensor(mask.shape[0])
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}")
    if global_sum is not None:
        count = global_sum(count)
    return total / count.clamp(min=1)


def kl_estimate(logprobs, ref_logprobs, mask, kind="k3"):
    """
    Per-token KL(π || π_ref) estimate from log-probs of tokens sampled from π, (B, T),
    0 off the mask. With log_ratio = log π − log π_ref (Schulman, "Approximating KL
    divergence"):
      k1 = log_ratio                        unbiased, high variance, can be negative
      k2 = log_ratio² / 2                   biased, low variance, always ≥ 0
      k3 = exp(−log_ratio) − 1 + log_ratio  unbiased, low variance, ≥ 0: GRPO's KL loss
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio ** 2
    elif kind == "k3":
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kind!r}")
    return torch.where(mask.bool(), kl, torch.zeros_like(kl))


# -----------------------------------------------------------------------------
# Reward placement

def last_agent_positions(action_mask):
    """Per row, the index of the last token of each agent segment (a run of 1s)."""
    mask = action_mask.bool()  # (B, T)
    next_is_agent = torch.zeros_like(mask)
    next_is_agent[:, :-1] = mask[:, 1:]
    segment_end = mask & ~next_is_agent  # agent tokens followed by env tokens or the end
    return [row.nonzero().flatten().tolist() for row in segment_end]


def place_rewards(turn_rewards, turn_end_positions, action_mask):
    """Scatter per-turn rewards onto a (B, T) token-reward tensor: turn_rewards[b][k]
    lands on turn_end_positions[b][k], turn k's last agent token (the final turn's reward
    holds the outcome), or, if that is an env token, on the nearest agent token before it."""
    B, T = action_mask.shape
    assert len(turn_rewards) == len(turn_end_positions) == B, (
        "need one list of rewards and positions per row"
    )
    token_rewards = torch.zeros(B, T, dtype=torch.float32, device=action_mask.device)
    for b in range(B):
        assert len(turn_rewards[b]) == len(turn_end_positions[b]), (
            f"row {b}: one position per turn reward"
        )
        agent_positions = action_mask[b].nonzero().flatten()  # (n_agent,)
        for reward, position in zip(turn_rewards[b], turn_end_positions[b]):
            earlier = agent_positions[agent_positions <= position]
            assert len(earlier) > 0, f"row {b}: no agent token at or before position {position}"
            # += : two turns moved onto one token both count
            token_rewards[b, earlier[-1]] += reward
    return token_rewards


def assert_rewards_on_mask(token_rewards, action_mask):
    off_mask = torch.where(action_mask.bool(), torch.zeros_like(token_rewards), token_rewards)
    assert (off_mask == 0).all(), (
        "reward on a non-agent token would be lost: place it with place_rewards"
    )


def padded(rows, fill=0, dtype=torch.long):
    """Lists of numbers -> one (B, T) tensor, each row from column 0, `fill` after it."""
    tensors = [torch.tensor(row, dtype=dtype) for row in rows]
    return pad_sequence(tensors, batch_first=True, padding_value=fill)


def collate(trajectories, pad_token_id):
    """Right-pad rollout.Trajectory objects into the trainer's (B, T) tensors:
    action_mask[b, t] = 1 iff row b's token t was sampled, sampler_logprobs[b, t] is its
    log-prob, token_rewards[b, t] the rewards of the turns ending at t (place_rewards);
    prompt_lengths[b] counts row b's opening prompt tokens."""
    def column(field):  # one field of every trajectory, in order
        return [getattr(trajectory, field) for trajectory in trajectories]
    batch = {
        "input_ids": padded(column("token_ids"), pad_token_id),
        "attention_mask": padded([[1] * len(token_ids) for token_ids in column("token_ids")]),
        "action_mask": padded(column("action_mask")),
        "sampler_logprobs": padded(column("logprobs"), dtype=torch.float32),
    }
    batch["token_rewards"] = place_rewards(
        column("turn_rewards"), column("turn_end_positions"), batch["action_mask"]
    )  # (B, T)
    batch["prompt_lengths"] = torch.tensor(column("prompt_length"))  # (B,)
    batch["truncated"] = torch.tensor(column("truncated"))  # (B,)
    return batch


# -----------------------------------------------------------------------------
# Advantage estimators

def compute_gae(token_rewards, values, action_mask, gamma, lam, last_values=None):
    """GAE over agent tokens only, env tokens skipped. Inputs (B, T); returns (advantages,
    returns), (B, T), 0 off the mask, not whitened. last_values (B,): V(s_end) after each
    row's last agent token, 0 (default) where the episode ended (bootstrap_values)."""
    assert_rewards_on_mask(token_rewards, action_mask)
    B, T = token_rewards.shape
    mask = action_mask.bool()
    advantages = torch.zeros_like(values)
    # Carried right-to-left, (B,) each: V and A of the next *agent* token (past the end:
    # V(s_end) and 0). Env tokens leave them be: the recursion jumps over a tool response.
    next_value = values.new_zeros(B) if last_values is None else last_values.to(values.dtype)
    next_advantage = values.new_zeros(B)
    for t in reversed(range(T)):
        # δ_t = r_t + γ V(next agent) − V_t
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage  # A_t = δ_t + γλ A(next agent)
        advantages[:, t] = torch.where(mask[:, t], advantage, 0.0)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
    returns = torch.where(mask, advantages + values, 0.0)  # the critic's regression target
    return advantages, returns


def bootstrap_values(values, attention_mask, truncated):
    """V(s_end) after each episode cut by the token or turn budget, 0 after one the env ended:
    (B,), compute_gae's last_values. A budget is our time limit, not the task's end, so GAE
    bootstraps from the critic there (Pardo et al. 2018, "Time Limits in RL"); a terminal
    state would teach the critic that running out of room is worth 0."""
    last = attention_mask.sum(dim=1) - 1  # (B,) each row's last real token
    return torch.where(truncated, values.gather(1, last[:, None]).squeeze(1), 0.0)


def grpo_advantages(scores, group_ids, scale_by_std=True, eps=1e-6):
    """GRPO: A = (score − group mean) / (group std + eps) (unbiased std) per trajectory,
    (N,) from scores and group_ids (N,); its agent tokens get it. scale_by_std=False is
    Dr.GRPO: the std division up-weights prompts almost always solved or failed. A group
    of equal scores (or of one) gets exactly 0, which float rounding would not give."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    group_ids = torch.as_tensor(group_ids, device=scores.device)
    _, group_index = torch.unique(group_ids, return_inverse=True)  # (N,) in 0..G-1
    G = int(group_index.max()) + 1
    count = scores.new_zeros(G).index_add_(0, group_index, torch.ones_like(scores))  # (G,)
    mean = scores.new_zeros(G).index_add_(0, group_index, scores) / count
    centered = scores - mean[group_index]  # (N,)
    squares = scores.new_zeros(G).index_add_(0, group_index, centered ** 2)
    std = (squares / (count - 1).clamp(min=1)).sqrt()  # unbiased; a group of one has std 0
    group_max = scores.new_full((G,), -torch.inf).scatter_reduce(0, group_index, scores, "amax")
    group_min = scores.new_full((G,), torch.inf).scatter_reduce(0, group_index, scores, "amin")
    no_signal = (group_max == group_min)[group_index]  # (N,)
    advantages = centered / (std[group_index] + eps) if scale_by_std else centered
    return torch.where(no_signal, 0.0, advantages)


def states_before_turns(messages):
    """The state each assistant turn acted on: the messages since the turn before (no
    system prompt), as text. A bump into a wall leaves a game's grid, its state, as is."""
    states, seen = [], []
    for message in messages:
        if message["role"] == "assistant":
            states.append(repr(seen))
            seen = []
        elif message["role"] != "system":
            seen.append(message["content"])
    return states


def anchor_groups(trajectories):
    """An id per turn of each trajectory: a group's turns that met one state share it. A
    turn's state is its info["state"] where given (an --agent program's report, serve.py),
    else states_before_turns."""
    ids = {}
    return [ids.setdefault((t.group_id, info.get("state", state)), len(ids))
            for t in trajectories
            for info, state in zip(t.turn_infos, states_before_turns(t.messages))]


def gigpo_advantages(trajectories, gamma, omega=1.0, scale_by_std=True):
    """
    GiGPO (Feng et al. 2025, arXiv 2505.10978): turn-level credit without a critic. In a
    group (one env seed), the turns that acted on one state form an anchor group. A
    turn's step return is R_k = r_k + γ R_{k+1}; its step advantage compares R_k within
    its anchor group (grpo_advantages). A turn alone with its state gets 0: with no
    repeated state this is GRPO. Returns, per trajectory, A_episode + ω A_step per turn.
    """
    scores, group_ids = [t.score for t in trajectories], [t.group_id for t in trajectories]
    episode = grpo_advantages(scores, group_ids, scale_by_std).tolist()  # (N,)
    step_returns = []
    for trajectory in trajectories:
        returns, step_return = [], 0.0
        for reward in reversed(trajectory.turn_rewards):
            step_return = reward + gamma * step_return
            returns.insert(0, step_return)
        step_returns += returns
    anchors = anchor_groups(trajectories)
    assert len(anchors) == len(step_returns), "one assistant message per turn reward"
    step = grpo_advantages(step_returns, anchors, scale_by_std).tolist() if step_returns else []
    per_turn, start = [], 0
    for trajectory, episode_advantage in zip(trajectories, episode):
        turns = step[start:start + len(trajectory.turn_rewards)]
        per_turn.append([episode_advantage + omega * advantage for advantage in turns])
        start += len(turns)
    return per_turn


def spread_over_turns(turn_values, turn_end_positions, action_mask):
    """(B, T): turn k's value on the agent tokens after turn k-1's end up to turn k's;
    0 elsewhere."""
    spread = torch.zeros(action_mask.shape, dtype=torch.float32, device=action_mask.device)
    for b, (values, ends) in enumerate(zip(turn_values, turn_end_positions)):
        start = 0
        for value, end in zip(values, ends):
            spread[b, start:end + 1] = value
            start = end + 1
    return torch.where(action_mask.bool(), spread, 0.0)


def reinforce_pp_advantages(token_rewards, action_mask, gamma, global_sum=None):
    """
    REINFORCE++: no critic, no groups. Each agent token gets its discounted return-to-go
    over later agent tokens, G_t = r_t + γ G(next agent token), whitened over the batch's
    agent tokens (a global baseline; all ranks' with global_sum). (B, T), 0 off the mask.
    """
    assert_rewards_on_mask(token_rewards, action_mask)
    B, T = token_rewards.shape
    mask = action_mask.bool()
    returns = torch.zeros_like(token_rewards)
    next_return = token_rewards.new_zeros(B)  # (B,) G of the next agent token
    for t in reversed(range(T)):
        next_return = torch.where(
            mask[:, t], token_rewards[:, t] + gamma * next_return, next_return
        )
        returns[:, t] = torch.where(mask[:, t], next_return, 0.0)
    return masked_whiten(returns, action_mask, global_sum=global_sum)


# -----------------------------------------------------------------------------
# The losses through the mask (train.py's update)


def policy_loss(
    logprobs, old_logprobs, advantages, mask, clip_low, clip_high, loss_agg, norm_constant,
    penalty=None, global_sum=None,
):
    """PPO's clipped surrogate with decoupled bounds (DAPO's clip-higher), through the mask.

    ratio = π(a|s) / π_old(a|s) per token; the loss is max(-A ratio, -A clip(ratio,
    1 - clip_low, 1 + clip_high)) plus `penalty` (B, T-1), the KL and entropy terms, one
    `loss_agg` over mask-1 tokens for all (else the modes would reweigh the penalty). With
    global_sum, this rank's share (aggregate_loss). Returns (loss, ratio (B, T-1))."""
    ratio = (logprobs - old_logprobs).exp()  # (B, T-1); exactly 1 on the first on-policy pass
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    surrogate = torch.max(-advantages * ratio, -advantages * clipped)
    per_token = surrogate if penalty is None else surrogate + penalty
    return aggregate_loss(per_token, mask, loss_agg, norm_constant, global_sum), ratio


def value_loss(values, old_values, returns, value_clip):
    """PPO's clipped value loss per token, 0.5 max((V - R)^2, (clip(V) - R)^2), with V
    clipped to old_values +- value_clip: (B, T-1), all aligned with the loss mask."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)


def truncated_importance_weights(trainer_logprobs, sampler_logprobs, cap):
    """TIS: min(π_trainer_old / π_sampler, cap) per token, (B, T-1). PPO's ratio assumes π_old
    sampled the tokens, but a bf16 vLLM engine's probabilities differ (TRL's
    vllm_importance_sampling_correction, verl's rollout correction)."""
    return (trainer_logprobs - sampler_logprobs).exp().clamp(max=cap)
