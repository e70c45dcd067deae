"""
Watch a run for the failures agent RL is known for: the signals train.py logs every step
and the warnings it prints (and, with --on_echo_trap stabilize, acts on).

RAGEN's Echo Trap: groups stop disagreeing (group_reward_std falls), so GRPO has nothing
to learn from, while success stays low. RAGEN-2's template collapse: responses stop
depending on their prompts, read from cross-scoring a few prompts' first turns against
each other (cross_prompt_logprobs, prompt_dependence). And a collapse: success falls far
below its best. `monitor_warnings` warns on the first and the last only, named apart (its
messages say each). The leading signals studied (template collapse, gradient-norm spikes,
...) are logged, not warned on: none led a collapse at this scale without also firing on
healthy runs (docs/results.md, "The monitor on healthy runs"; bench/reproduce.py
collapse_signals and docs/papers.md, "Which signals lead a collapse").
"""

import math
import statistics
from collections import Counter

import torch

import masks
from nanoagent.models import token_logprobs

# The template-collapse probe's prompts: it costs N^2 short rows.
PROBE_PROMPTS = 8


def cross_prompt_logprobs(
    model, trajectories, pad_token_id, temperature, share_prompts, device,
    num_prompts=PROBE_PROMPTS,
):
    """RAGEN-2's cross-scoring (arXiv 2604.06268): the first turn of one episode of each of
    the first `num_prompts` distinct prompts, teacher-forced after each of those prompts:
    (N, N), [i, j] the mean log-prob per token of response j after prompt i, on every rank;
    None with fewer than 2 prompts. First turns only: later ones read their episode's
    observations, which give its prompt away."""
    episodes = {}  # prompt tokens -> the first episode that played a turn after it
    for t in trajectories:
        if t.num_turns > 0 and len(episodes) < num_prompts:
            episodes.setdefault(tuple(t.token_ids[:t.prompt_length]), t)
    if len(episodes) < 2:
        return None
    prompts = [list(prompt) for prompt in episodes]
    responses = [
        t.token_ids[t.prompt_length:t.turn_end_positions[0] + 1] for t in episodes.values()
    ]
    rows = [prompt + response for prompt in prompts for response in responses]  # i * N + j
    input_ids = masks.padded(rows, fill=pad_token_id).to(device)  # (N*N, T)
    attention_mask = masks.padded([[1] * len(row) for row in rows]).to(device)  # (N*N, T)
    prompt_lengths = torch.tensor(  # (N*N,)
        [len(prompt) for prompt in prompts for _ in responses], device=device
    )
    # (T-1,): column t predicts token t + 1; positions: the responses' tokens
    columns = torch.arange(input_ids.shape[1] - 1, device=device)
    positions = attention_mask[:, 1:] * (columns >= prompt_lengths[:, None] - 1)
    logprobs = token_logprobs(  # (N*N, T-1)
        model, input_ids, attention_mask, temperature, positions,
        prompt_lengths=prompt_lengths if share_prompts else None,
    )[0]
    return (logprobs.sum(dim=1) / positions.sum(dim=1)).view(len(prompts), len(prompts))


def prompt_dependence(logprobs):
    """RAGEN-2's template-collapse signals from the (N, N) matrix [i, j] = log p(r_j | x_i):
    retrieval_accuracy, the share of responses whose own prompt scores them highest (chance
    1/N), and the mutual information mean_j [log p(r_j | x_j) - log (1/N) sum_i p(r_j |
    x_i)], 0 when responses ignore their prompts. Both fall before success does, RAGEN-2
    reports, while entropy stays high. {} without a matrix."""
    if logprobs is None:
        return {}
    n = logprobs.shape[0]
    # (N,) log p(r_j) under the mixture of prompts
    marginal = torch.logsumexp(logprobs, dim=0) - math.log(n)
    own_best = logprobs.argmax(dim=0) == torch.arange(n, device=logprobs.device)  # (N,)
    return {
        "retrieval_accuracy": own_best.float().mean().item(), "retrieval_chance": 1 / n,
        "mutual_information": (logprobs.diagonal() - marginal).mean().item(),
    }


def zero_variance_share(group_stds):
    """The share of groups whose members all scored alike (group_stds: {group: std of its
    scores}, before any filter): they give GRPO no gradient (with success rate p and group
    size g, a group has signal with probability 1 - p^g - (1-p)^g); when most are, KL and
    entropy drive the update (arXiv 2606.18487)."""
    return statistics.fmean(std == 0 for std in group_stds.values())


def mean_anchor_group_size(trajectories):
    """How many turns of its group met each turn's state, on average (1: none repeats)."""
    anchors = masks.anchor_groups(trajectories)
    sizes = Counter(anchors)
    return statistics.fmean(sizes[anchor] for anchor in anchors) if anchors else 0.0


def recent_change(history, key, window=5):
    """history[-1][key] against its mean over the `window` steps before (0.5: up 50%). Response
    length jumped (verl-agent#188, rllm#226) and turns dropped as tool calls stopped (verl
    PR#4998) ahead of collapses."""
    before = [h[key] for h in history[-window - 1:-1] if key in h]
    baseline = statistics.fmean(before) if before else 0.0
    return history[-1][key] / baseline - 1 if baseline else 0.0


COLLAPSE_FLOOR, COLLAPSE_BEST, STALLED_SUCCESS = 0.5, 0.2, 0.2


def monitor_warnings(history, window=5):
    """{signal: message} after the last step, on `window`-step means: "stalled" (the Echo
    Trap) or "collapse"; a message says what it measured, its record, and what to try."""
    def smoothed(key, end):
        return statistics.fmean(h[key] for h in history[max(0, end - window):end])
    warnings, steps = {}, len(history)
    if steps < 2 * window:
        return warnings
    now, success = smoothed("group_reward_std", steps), smoothed("success", steps)
    peak = max(smoothed("group_reward_std", end) for end in range(window, steps + 1))
    best = max(smoothed("success", end) for end in range(window, steps + 1))
    if peak > 0.05 and now < 0.2 * peak and success < STALLED_SUCCESS:
        warnings["stalled"] = (
            f"group_reward_std {now:.3f} ({window}-step mean) is below 0.2x its peak "
            f"{peak:.3f} while success {success:.2f} < {STALLED_SUCCESS}: groups answer alike "
            "and GRPO has nothing to learn from (RAGEN's Echo Trap; its record: "
            "docs/results.md, \"The monitor on healthy runs\"); try another --seed, or "
            "--filter_ratio 0.25 (StarPO-S)"
        )
    if best > COLLAPSE_BEST and success < COLLAPSE_FLOOR * best:
        warnings["collapse"] = (
            f"success {success:.2f} ({window}-step mean) is below {COLLAPSE_FLOOR}x its best "
            f"{best:.2f}: the collapse studies' own rule, so it marks a collapse as it "
            "happens, never ahead (docs/results.md, \"The monitor on healthy runs\"); resume "
            "from an earlier checkpoint with a lower --lr, or --starpo_s"
        )
    return warnings


# --on_echo_trap stabilize: RAGEN's remedy for the Echo Trap (StarPO-S's top 25% of
# groups) plus a smaller step, at most every ECHO_TRAP_COOLDOWN steps, so one episode of
# warnings (the smoothed signals stay low a while) acts once. A collapse only warns: the
# policy has already fallen, and its remedy is a resume from a checkpoint before the fall,
# which a run cannot do to itself.
ECHO_TRAP_FILTER_RATIO, ECHO_TRAP_LR_FACTOR, ECHO_TRAP_COOLDOWN = 0.25, 0.5, 10


def stabilize_on_echo_trap(control, step, warnings):
    """`control` after `warnings`, a new dict when it acts: on "stalled" only, smaller steps
    from groups that still disagree."""
    last = control["last_action_step"]
    if "stalled" not in warnings or (last is not None and step - last < ECHO_TRAP_COOLDOWN):
        return control
    return {
        "lr": control["lr"] * ECHO_TRAP_LR_FACTOR, "last_action_step": step,
        "filter_ratio": min(control["filter_ratio"], ECHO_TRAP_FILTER_RATIO),
    }
