"""
Rollouts: play whole multi-turn episodes with the current policy and record who wrote
every token.

One episode: the model writes a turn, the environment answers (tool results, game
observations), the model writes again, until the env says done. `rollout` plays P env
seeds x G samples each (G episodes of one seed form a GRPO group) in lockstep: every turn,
all episodes still running go into one sampler call, so a batch of 64 episodes costs one
batched generation per turn, not 64.

Token in, token out. A trajectory is built by appending token ids, never by decoding text
and encoding it again. Re-encoding is not the identity (BPE can merge across the boundary
between two turns, a turn cut mid-token decodes to different bytes), and then the trainer
scores tokens the sampler never chose: the log-prob ratio of those tokens is garbage,
which is how Agent-R1 (issue #30) and TRL (#5224) got NaN losses. So, for the chat
template of Qwen2.5 (which every nanoagent model speaks), with each token's mask:

    <|im_start|>system ... <|im_start|>assistant\n   the prompt (add_generation_prompt)  0
    <tool_call>...</tool_call><|im_end|>             the turn as sampled, its end token   1
    \n<|im_start|>user\n<tool_response>...           the env's observation as the       0
      </tool_response><|im_end|>\n<|im_start|>assistant\n   template writes it
    <answer>...</answer><|im_end|>                   the next sampled turn                1

Outside text is never markup. A message's content (a question, a tool result, a
document) is encoded as plain text: a `<|im_end|>` in a document is ordinary tokens, so
retrieved text cannot write an assistant turn (prompt injection). Only the template's own
markup gets special tokens: `encode_chat` renders it with a stand-in for each content and
encodes the two kinds of text apart.

The observation tokens come from `observation_tokens`, by suffix difference after a
dummy conversation; the history itself is never rendered again. Two places where the
template's text and the sampled tokens part ways:
  - The template writes "<|im_end|>\n" after every assistant turn, but the model samples
    only up to <|im_end|>. The "\n" is the environment's: it opens the observation tokens.
  - A turn cut by max_new_tokens has no <|im_end|>. The template would close the turn
    with one, so the environment appends <|im_end|> (mask 0) before the observation. The
    model never wrote it, and is not trained to.
Either way the token ids equal the template's rendering of the same messages (the tests
check it with the tiny and the real Qwen2.5 tokenizer), except where BPE would have
merged differently: there the sampled tokens win.

Stopping: the env says done, `max_turns` turns were played, or the next turn would not
fit in `max_total_tokens`. The last two flag the episode `truncated`, and
`truncated_reward` keeps its rewards ("keep") or scores it 0 ("zero", like DAPO's
overlong filtering, but kept in its group). A trajectory never ends on environment
tokens: observations are appended only when another turn follows.
"""

import hashlib
import json
import re
import statistics
from dataclasses import dataclass
from functools import lru_cache

import envs
from nanoagent.common import UserError, print0

END_OF_TURN = "<|im_end|>"  # Qwen2.5's end-of-turn token, what an assistant turn stops on
# The sampler stops a turn on either (as Qwen2.5-Instruct does).
STOP_TOKENS = (END_OF_TURN, "<|endoftext|>")
DUMMY_CONVERSATION = [  # any conversation ending with an assistant turn
    {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


@dataclass
class Trajectory:
    token_ids: list[int]  # prompt, then agent turns and env observations, as one token sequence
    action_mask: list[int]  # 1 exactly on the tokens the sampler chose
    logprobs: list[float]  # the sampler's log-prob of each token; 0.0 off the mask
    prompt_length: int  # number of opening prompt tokens
    turn_rewards: list[float]  # one env step reward per agent turn
    turn_end_positions: list[int]  # each turn's last agent token (where its reward goes)
    turn_infos: list[dict]  # each turn's step info (a ToolEnv's holds the tool calls it parsed)
    score: float  # sum of turn_rewards
    group_id: int  # index of the env seed: a group_id's trajectories form a GRPO group
    seed: int  # the env seed
    truncated: bool  # stopped by max_turns or the token budget, not by the env
    num_turns: int
    # the last step's info; "tool_calls", "invalid_calls", "format_errors" summed over turns
    info: dict
    messages: list[dict]  # the conversation the tokens spell, as chat messages (for display)


def render(tokenizer, messages, tools=None, add_generation_prompt=False):
    """The chat template's text for these messages (and tools)."""
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode(tokenizer, text):
    """Token ids of markup the project wrote: special tokens parsed, nothing added."""
    return tokenizer.encode(text, add_special_tokens=False)


def encode_text(tokenizer, text):
    """Token ids of outside text: a special token's spelling in it stays plain text."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


# While the template renders, message i's content is this stand-in (private-use characters).
STAND_IN, STAND_IN_PATTERN = "\ue000{}\ue001", re.compile("\ue000(\\d+)\ue001")


def render_with_stand_ins(tokenizer, messages, tools=None, add_generation_prompt=False):
    """(the template's text with a stand-in for each message content, the contents)."""
    contents, stood_in = [], []
    for message in messages:
        if isinstance(message.get("content"), str) and message["content"]:
            stood_in.append({**message, "content": STAND_IN.format(len(contents))})
            contents.append(message["content"])
        else:
            stood_in.append(message)
    return render(tokenizer, stood_in, tools, add_generation_prompt), contents


@lru_cache(maxsize=16)
def special_token_pattern(tokenizer):
    """A regex that finds the tokenizer's special tokens (<|im_end|>, ...) in text."""
    specials = sorted(
        (token.content for token in tokenizer.added_tokens_decoder.values() if token.special),
        key=len, reverse=True,
    )
    return re.compile("(" + "|".join(map(re.escape, specials)) + ")")


def encode_rendered(tokenizer, text, contents):
    """Token ids of text from render_with_stand_ins: the template's special tokens are special,
    the rest plain text with the contents put back. A tokenizer always splits text at special
    tokens and encodes the pieces apart, so for content without their spellings this is what
    encoding the whole rendered text gives (BPE merges across content edges included)."""
    token_ids = []
    # text, special, text, ...
    for index, piece in enumerate(special_token_pattern(tokenizer).split(text)):
        if index % 2:
            token_ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            piece = STAND_IN_PATTERN.sub(lambda match: contents[int(match[1])], piece)
            token_ids += encode_text(tokenizer, piece)
    return token_ids


def encode_chat(tokenizer, messages, tools=None, add_generation_prompt=False):
    """Token ids of a conversation as the chat template writes it, contents as plain text."""
    text, contents = render_with_stand_ins(tokenizer, messages, tools, add_generation_prompt)
    numbers = sorted(int(number) for number in STAND_IN_PATTERN.findall(text))
    assert numbers == list(range(len(contents))), (
        "the chat template must write every message's content once, unchanged"
    )
    return encode_rendered(tokenizer, text, contents)


def observation_tokens(tokenizer, observations):
    """The env's tokens after an assistant's <|im_end|>: the template's text for
    `observations` (tool results, user messages) and the next assistant header, by suffix
    difference."""
    # The template is part of the key (as text: it may be a dict of named templates).
    return list(cached_observation_tokens(
        tokenizer, str(tokenizer.chat_template), json.dumps(observations)
    ))


@lru_cache(maxsize=4096)
def cached_observation_tokens(tokenizer, chat_template, observations_json):
    """observation_tokens, remembered by the observations' text: a GRPO group mostly makes the
    same calls and reads the same results."""
    before, _ = render_with_stand_ins(tokenizer, DUMMY_CONVERSATION)
    after, contents = render_with_stand_ins(
        tokenizer, DUMMY_CONVERSATION + json.loads(observations_json), add_generation_prompt=True
    )
    assert after.startswith(before), (
        "the chat template rewrote earlier turns when new messages were added"
    )
    turn_end = before.rindex(END_OF_TURN) + len(END_OF_TURN)
    # The cut sits right after a special token, which the tokenizer always splits on, so
    # the suffix alone encodes to the ids the whole conversation would give.
    return tuple(encode_rendered(tokenizer, after[turn_end:], contents))


def sample_seed_for(sample_seed, env_seed, member, turn):
    """A sampling seed for one (episode, turn): the same whatever else is in the batch."""
    key = f"{sample_seed}/{env_seed}/{member}/{turn}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds must fit in a signed 64-bit int


def append(trajectory, token_ids, mask, logprobs=None):
    """Append tokens the agent wrote (mask 1, with log-probs) or the env did (mask 0)."""
    trajectory.token_ids += token_ids
    trajectory.action_mask += [mask] * len(token_ids)
    trajectory.logprobs += logprobs if logprobs is not None else [0.0] * len(token_ids)


def close_turn(generation, end_of_turn):
    """(the turn's ids without its stop token, for the env to read; the <|im_end|> the env
    appends if the turn has none)."""
    stopped = generation.finish_reason == "stop"
    sampled = generation.token_ids[:-1] if stopped else generation.token_ids
    closing = [] if generation.token_ids[-1] == end_of_turn else [end_of_turn]
    return sampled, closing


def start_episodes(tokenizer, make_env, seeds, group_size, max_total_tokens):
    """(env, trajectory, member) for member j of each seed's group: a fresh env, reset, and a
    trajectory holding its opening prompt (mask 0)."""
    episodes, prompts = [], {}  # rendered openings: a group's members mostly share one
    for group_id, seed in enumerate(seeds):
        for member in range(group_size):
            env = make_env()
            messages, tools = env.reset(seed, member)
            opening = json.dumps([messages, tools])
            if opening not in prompts:
                prompts[opening] = encode_chat(
                    tokenizer, messages, tools, add_generation_prompt=True
                )
            prompt = prompts[opening]
            trajectory = Trajectory(
                token_ids=[], action_mask=[], logprobs=[], prompt_length=len(prompt),
                turn_rewards=[], turn_end_positions=[], turn_infos=[], score=0.0,
                group_id=group_id, seed=seed, truncated=False, num_turns=0,
                messages=list(messages),
                info={"success": False, "tool_calls": 0, "invalid_calls": 0, "format_errors": 0},
            )
            append(trajectory, prompt, 0)
            # not even one token fits: it scores 0, with no turn
            trajectory.truncated = len(prompt) >= max_total_tokens
            episodes.append((env, trajectory, member))
    return episodes


def check_prompts_fit(make_env, tokenizer, max_total_tokens, sample=256):
    """train.py's start: stop if none of the first `sample` prompts leaves room for a turn
    (one over-long question is no reason: its episodes score 0, counted in `prompt_too_long`)."""
    lengths = [
        len(encode_chat(tokenizer, *make_env().reset(seed), add_generation_prompt=True))
        for seed in range(sample)
    ]
    fitting = sum(length < max_total_tokens for length in lengths)
    if fitting == 0:
        raise UserError(
            f"no prompt fits: the first {sample} opening prompts are {min(lengths)} to "
            f"{max(lengths)} tokens, and --max_total_tokens is {max_total_tokens}; "
            "raise --max_total_tokens"
        )
    if fitting < sample:
        print0(
            f"warning: {sample - fitting} of the first {sample} prompts are too long for "
            f"--max_total_tokens {max_total_tokens}; their episodes score 0 (metric "
            "prompt_too_long)"
        )


def add_step_info(info, step_info):
    """Trajectory.info after a step."""
    return {
        **step_info,
        "tool_calls": info["tool_calls"] + step_info["tool_calls"],
        "invalid_calls": info["invalid_calls"] + step_info["invalid_calls"],
        "format_errors": info["format_errors"] + int(step_info["format_error"]),
    }


def rollout(
    sampler, tokenizer, make_env, seeds, group_size, max_turns, max_new_tokens,
    max_total_tokens, temperature=1.0, sample_seed=0, truncated_reward="keep",
):
    """Play group_size episodes of every env seed, turn by turn: the trajectories, grouped by
    seed. make_env() returns a fresh env; episode j of seeds[i] is member j of group i. A turn
    gets at most max_new_tokens tokens and its own seed (sample_seed_for), a trajectory
    max_total_tokens."""
    assert truncated_reward in ("keep", "zero"), (
        f"truncated_reward must be 'keep' or 'zero', got {truncated_reward!r}"
    )
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    stop_token_ids = [tokenizer.convert_tokens_to_ids(token) for token in STOP_TOKENS]
    episodes = start_episodes(tokenizer, make_env, seeds, group_size, max_total_tokens)
    active = [episode for episode in episodes if not episode[1].truncated]
    for turn in range(max_turns):
        if not active:
            break
        running = [trajectory for _, trajectory, _ in active]
        generations = sampler.generate(
            [trajectory.token_ids for trajectory in running],
            [min(max_new_tokens, max_total_tokens - len(t.token_ids)) for t in running],
            temperature=temperature, stop_token_ids=stop_token_ids,
            seed=[sample_seed_for(sample_seed, t.seed, member, turn) for _, t, member in active],
        )
        texts, closings = [], []
        for (env, trajectory, member), generation in zip(active, generations):
            append(trajectory, generation.token_ids, 1, generation.logprobs)
            trajectory.turn_end_positions.append(len(trajectory.token_ids) - 1)
            trajectory.num_turns += 1
            # Decoding is fine: the text is never re-encoded.
            sampled, closing = close_turn(generation, end_of_turn)
            texts.append(tokenizer.decode(sampled))
            closings.append(closing)
            trajectory.messages.append({"role": "assistant", "content": texts[-1]})
        # All envs step together: the turn's tool calls run as one batch (one search
        # for all episodes).
        results = envs.step_envs([env for env, _, _ in active], texts)
        still_active = []
        for (env, trajectory, member), closing, result in zip(active, closings, results):
            trajectory.turn_rewards.append(result.reward)
            trajectory.turn_infos.append(result.info)
            trajectory.info = add_step_info(trajectory.info, result.info)
            if result.done:
                continue
            env_tokens = closing + observation_tokens(tokenizer, result.observations)
            length = len(trajectory.token_ids) + len(env_tokens)
            if turn == max_turns - 1 or length >= max_total_tokens:
                trajectory.truncated = True  # no further turn: stop on the agent's last token
                continue
            append(trajectory, env_tokens, 0)
            trajectory.messages += result.observations
            still_active.append((env, trajectory, member))
        active = still_active
    trajectories = [trajectory for _, trajectory, _ in episodes]
    for trajectory in trajectories:
        if trajectory.truncated and truncated_reward == "zero":
            trajectory.turn_rewards = [0.0] * len(trajectory.turn_rewards)
        trajectory.score = float(sum(trajectory.turn_rewards))
    return trajectories


def void_turns(trajectory):
    """Turns the env could read nothing from: no tool call and no answer or action (a
    format error). SimpleTIR (arXiv 2509.02479) found such "void turns" ahead of the
    gradient explosions of multi-turn RL."""
    return sum(info["tool_calls"] == 0 and info["format_error"] for info in trajectory.turn_infos)


def summarize(trajectories):
    """The numbers training logs and eval.py tabulates for a batch, one definition each:
      reward, reward_std  mean episode score (sum of step rewards) and its spread
      success, em, f1     the env's success flag; the final answer's exact match, token F1
      turns, tool_calls   per episode; invalid_call_rate: invalid calls over all calls
      void_turns          per episode, turns with neither a call nor an answer (void_turns)
      response_tokens     tokens the agent wrote per episode; trajectory_tokens, prompt_tokens
      truncated           episodes stopped by max_turns or the token budget, not by the env
      no_answer           tool-env episodes that ended without an <answer>
      prompt_too_long     episodes whose prompt left no room for a turn (they score 0)
    """
    mean = statistics.fmean
    calls = sum(t.info.get("tool_calls", 0) for t in trajectories)
    invalid_calls = sum(t.info.get("invalid_calls", 0) for t in trajectories)
    summary = {
        "reward": mean(t.score for t in trajectories),
        "reward_std": statistics.pstdev([t.score for t in trajectories]),
        "success": mean(float(t.info["success"]) for t in trajectories),
        "turns": mean(t.num_turns for t in trajectories),
        "tool_calls": mean(t.info.get("tool_calls", 0) for t in trajectories),
        "invalid_call_rate": invalid_calls / max(1, calls),
        "void_turns": mean(void_turns(t) for t in trajectories),
        "response_tokens": mean(sum(t.action_mask) for t in trajectories),
        "trajectory_tokens": mean(len(t.token_ids) for t in trajectories),
        "prompt_tokens": mean(t.prompt_length for t in trajectories),
        "truncated": mean(float(t.truncated) for t in trajectories),
        "no_answer": mean(
            float("answer" in t.info and t.info["answer"] is None) for t in trajectories
        ),
        "prompt_too_long": mean(float(t.num_turns == 0) for t in trajectories),
    }
    if all("em" in t.info for t in trajectories):
        summary["em"] = mean(t.info["em"] for t in trajectories)
        summary["f1"] = mean(t.info["f1"] for t in trajectories)
    return summary
