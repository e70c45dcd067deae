"""
Serve the policy behind an OpenAI-compatible endpoint, and record what it samples as
trajectories.

    python serve.py --model runs/default/step_000100 --port 8000
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none python my_agent.py
    # any agent, unchanged; Ctrl-C writes runs/served/trajectories.jsonl

Agents are mostly written already, as loops over the `openai` client, so the policy
answers `POST /v1/chat/completions` and `GET /v1/models`, like AReaL's proxy or Agent
Lightning: `tools`, `tool_choice`, `temperature`, `top_p`, `max_tokens` (at most
--max_new_tokens), `seed`, `stop` (cut as vLLM cuts), `logprobs` (the recorded ones),
`stream` (the whole reply in OpenAI's chunks). Other fields are ignored, as OpenAI's and
vLLM's servers do, but sampling options the samplers cannot honour are refused
(NEUTRAL). Hermes `<tool_call>` blocks in a reply come back as OpenAI `tool_calls`;
tool_choice "required" or a named function forces their opening (opening_for). A bad
value gets a 400 naming it, whatever fails later a 500 (OpenAI's error body). Under
train.py --agent the trainer's temperature (and top_p 1) win: the update scores at those.

`POST /v1/responses` (the Responses API, the OpenAI Agents SDK's default model) becomes a
chat completion and back (the last section): `input` as text or items (messages, function
calls, their outputs), `instructions`, function `tools`, `tool_choice`,
`max_output_tokens`, `temperature`, `top_p`, `stream` (OpenAI's events);
`previous_response_id` continues a response of the episode, kept while it runs (whatever
`store` says). Built-in tools, `include`, `reasoning`, `background`, `conversation`,
`prompt` and structured `text` get a 400.

Token in, token out through a text API: encoding the request's text again would not
give the sampled tokens (rollout.py's docstring). So each conversation keeps its tokens
(a rollout.Trajectory); a request whose messages extend a conversation's history
continues it: the turns sampled stay as sampled, with their log-probs (mask 1), and
only the new messages are encoded, as rollout() encodes observations (mask 0). A
history that does not extend one (edited, summarised, an assistant turn the client
wrote) starts a new segment: a new trajectory with the whole history as its prompt,
info["segment"] counting up.

Batching: the sampler thread waits `window_s` after a turn arrives; the turns that came
meanwhile (64 agents sending tool results) share one sampler.generate, rollout()'s
lockstep, and those that come during it the next.

Episodes (train.py --agent): `play` runs the user's program once per episode, in a
session of its own, with its own base URL ($OPENAI_BASE_URL = .../episodes/<id>/v1),
the task seed ($NANOAGENT_TASK_SEED) and the episode's id ($NANOAGENT_EPISODE_ID) in
its environment. Its last line of output is its reward, {"reward": 1.0, "success":
true}, each segment's score, on its last token. For per-turn credit the line may also
list the turns, in the order their replies came (across segments): "turn_rewards" (on
each turn's last token instead, the last holding the outcome, as an env's) and "states"
(any JSON, what each turn acted on: its GiGPO anchor group's key, masks.anchor_groups).
A segment's last turn also carries the rewards of the later turns of other segments
(undiscounted): a turn's return is the episode's from it on. Not per request: a framework
sends its own, and a turn's reward comes after its reply. A program that crashes, hangs
past the time-out, reports no reward or turns that are not its episode's loses its group
for the step; the log says why.
When it ends or times out, run_program kills every process it started, wherever it moved,
and its episode is closed: a late request gets a 404, a queued turn or one sampled as it
ended is dropped, and nothing is sampled during the update.
"""

import argparse
import functools
import itertools
import json
import math
import os
import queue
import re
import shlex
import shutil
import subprocess
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import rollout
import tools
from nanoagent import sandbox
from nanoagent.common import UserError, print0
from nanoagent.models import load_model, resolve_model_path
from nanoagent.report import TRAJECTORIES, append_jsonl, trajectory_records
from nanoagent.sampler import Generation, TorchSampler

ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
    """A refused request: its HTTP status, OpenAI's error fields (the field at fault, a code)."""

    def __init__(self, message, param=None, code="invalid_value", status=400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


NEUTRAL = {
    "n": 1, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
    "logit_bias": {}, "top_k": -1, "min_p": 0, "best_of": 1, "top_logprobs": 0,
    # the Responses API's (/v1/responses)
    "include": [], "reasoning": {}, "background": False, "conversation": None, "prompt": None,
    "text": {"format": {"type": "text"}},
}


def checked(body, field, default, low, high, kind=(int, float)):
    """body[field] if a `kind` (a bool is not a number) in [low, high]; `default` if
    absent or null."""
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        kind_name = "an integer" if kind is int else "a number"
        raise RequestError(f"{field}={value!r}: must be {kind_name} in [{low}, {high}]", field)
    return value


def read_options(body, max_new_tokens):
    """The request's sampling options, checked."""
    for field, neutral in NEUTRAL.items():
        if body.get(field) not in (None, neutral):
            raise RequestError(
                f"{field}={body[field]!r}: the samplers here cannot honour it (only {neutral!r})",
                field, "unsupported_value",
            )
    limit = checked(body, "max_tokens", max_new_tokens, 1, math.inf, int)
    limit = min(max_new_tokens, checked(body, "max_completion_tokens", limit, 1, math.inf, int))
    temperature = checked(body, "temperature", 1.0, 0, 2)
    # top_p 0 (the most likely token, as OpenAI reads it): the samplers' top-p keeps the top one
    top_p = max(checked(body, "top_p", 1.0, 0, 1), 1e-9)
    seed = checked(body, "seed", None, -2**63, 2**63 - 1, int)
    stop = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
    if not isinstance(stop, list) or not all(isinstance(text, str) and text for text in stop):
        raise RequestError(f"stop={body['stop']!r}: must be a string or a list of strings", "stop")
    return limit, temperature, top_p, seed, stop


def opening_for(tool_choice, tool_schemas):
    """The text tool_choice makes a reply open with: "" for "auto" and "none", a tool
    call's opening for "required", up to the arguments for a named function. The
    sampler continues it (mask 0); a forced call that still does not parse comes back as
    text, an invalid call in the turn's info."""
    names = [schema.get("function", {}).get("name") for schema in tool_schemas]
    if tool_choice in (None, "auto", "none"):
        return ""
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if tool_choice == "required" and names or name in names and name is not None:
        named = f'{{"name": {json.dumps(name)}, "arguments": ' if name else ""
        return f"{tools.OPEN_TAG}\n{named}"
    raise RequestError(
        f"tool_choice={tool_choice!r}: must be 'auto', 'none', 'required' or a tool of tools as "
        "{'type': 'function', 'function': {'name': NAME}}", "tool_choice",
    )


def read_messages(messages):
    """The messages as the chat template takes them ({"role", "content", "tool_calls":
    [{"name", "arguments": {...}}]}), checked: known roles, and a tool message answers a
    call of the assistant turn before it."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    read, call_ids = [], set()
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise RequestError(
                f"messages[{index}]: unknown role {role!r}; "
                f"this endpoint knows {', '.join(ROLES)}", "messages"
            )
        content = message.get("content") or ""
        if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text"
            and isinstance(part.get("text"), str) for part in content
        ):
            content = "".join(part["text"] for part in content)  # text parts, as smolagents sends
        if not isinstance(content, str):
            raise RequestError(
                f"messages[{index}]: content must be a string or text parts "
                "(this endpoint reads text only)", "messages"
            )
        read.append({"role": role, "content": content})
        if role == "assistant":
            try:
                calls = [
                    (call.get("id"), {
                        "name": call["function"]["name"],
                        "arguments": json.loads(call["function"]["arguments"])
                    })
                    for call in message.get("tool_calls") or []
                ]
            except (KeyError, TypeError, AttributeError, ValueError) as problem:
                raise RequestError(
                    f"messages[{index}]: malformed tool_calls ({problem!r})", "messages"
                ) from problem
            read[-1].update({"tool_calls": [call for _, call in calls]} if calls else {})
            call_ids = {call_id for call_id, _ in calls}
        if role == "tool" and message.get("tool_call_id") not in call_ids:
            raise RequestError(
                f"messages[{index}]: tool message with tool_call_id "
                f"{message.get('tool_call_id')!r} answers no tool call of the assistant turn "
                "before it", "messages",
            )
    return read


@dataclass
class Conversation:
    episode_id: str  # the episode's id from the URL ("" outside training)
    keys: list[str]  # what a request extends: its tools, messages, last reply, as JSON
    trajectory: rollout.Trajectory
    closing: list[int]  # the <|im_end|> a turn cut by max_tokens lacks, before the next
    busy: bool = True  # a turn of it is being sampled: no request can extend it


class Turn(NamedTuple):
    """A turn waiting for the sampler thread."""
    prompt: list[int]
    limit: int  # max new tokens
    temperature: float
    top_p: float
    seed: int
    episode_id: str
    done: Future  # set to its Generation


class Server:
    """The endpoint: the sampler, its thread, the conversations, the HTTP server."""

    def __init__(
        self, sampler, tokenizer, max_new_tokens, max_total_tokens, temperature=None,
        window_s=0.05, model_name="nanoagent", host="127.0.0.1", port=0,
    ):
        self.sampler, self.tokenizer, self.model_name = sampler, tokenizer, model_name
        self.max_new_tokens, self.max_total_tokens, self.window_s = (
            max_new_tokens, max_total_tokens, window_s)
        self.temperature = temperature  # None: the request's; train.py's wins
        self.end_of_turn = tokenizer.convert_tokens_to_ids(rollout.END_OF_TURN)
        self.stop_token_ids = tokenizer.convert_tokens_to_ids(list(rollout.STOP_TOKENS))
        self.conversations, self.lock, self.turns = [], threading.Lock(), queue.Queue()  # of Turn
        # play's running episodes, {id: (its step's sampling seed, its key)}; its calls
        self.episodes, self.plays = {}, 0
        self.order = itertools.count()  # numbers the turns as recorded, all episodes'
        self.refusals = {}  # their refused requests, {id: ["400 why", ...]}, for its log
        self.responses = {}  # /v1/responses', {episode_id: {id: its input and output items}}
        self.sampling = threading.Lock()  # held while the sampler thread samples a batch
        self.http = HTTPServer((host, port), Handler)
        self.http.endpoint, self.url = self, f"http://{host}:{self.http.server_address[1]}"
        threading.Thread(target=self.sample_batches, daemon=True).start()
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def sample_batches(self):
        """The sampler thread (the module docstring's Batching)."""
        for turn in iter(self.turns.get, None):  # None: close
            batch, deadline = [turn], time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(self.turns.get(timeout=left))
                except queue.Empty:
                    break
            with self.sampling:  # play waits for it: then its turns are never sampled
                with self.lock:
                    closed = [turn for turn in batch if not self.is_open(turn.episode_id)]
                for turn in closed:
                    turn.done.set_exception(RequestError(
                        f"episode {turn.episode_id!r} ended", code="episode_closed", status=404))
                self.sample([turn for turn in batch if turn not in closed])

    def sample(self, batch):
        """Sample turns, per temperature and top_p, and set their results."""
        for options in {(turn.temperature, turn.top_p) for turn in batch}:
            rows = [turn for turn in batch if (turn.temperature, turn.top_p) == options]
            try:
                generations = self.sampler.generate(
                    [row.prompt for row in rows], [row.limit for row in rows],
                    temperature=options[0], top_p=options[1],
                    stop_token_ids=self.stop_token_ids, seed=[row.seed for row in rows],
                )
                for row, generation in zip(rows, generations):
                    row.done.set_result(generation)
            except Exception as problem:  # a 500 for those requests; the thread goes on
                for row in rows:
                    row.done.set_exception(problem)

    def is_open(self, episode_id):
        """Play's episodes (ids "<its call>.<index>") are served while they run, other
        ids always."""
        call = episode_id.split(".")[0]
        return episode_id in self.episodes or not call.isdigit() or int(call) > self.plays

    def conversation_for(self, episode_id, keys, messages):
        """The idle conversation of `episode` (the longest) whose history `keys` extends
        by messages that are not assistant turns, else a new one (its next segment),
        registered at once: concurrent first requests get segments, so seeds, of their
        own."""
        with self.lock:
            if not self.is_open(episode_id):  # a killed program's late request
                raise RequestError(
                    f"episode {episode_id!r} is not running", code="episode_closed", status=404)
            matches = [
                c for c in self.conversations if c.episode_id == episode_id and not c.busy
                and len(keys) > len(c.keys) and keys[:len(c.keys)] == c.keys
                and all(m["role"] != "assistant" for m in messages[len(c.keys) - 1:])
            ]
            conversation = max(matches, key=lambda c: len(c.keys), default=None)
            if conversation is None:
                segment = sum(c.episode_id == episode_id for c in self.conversations)
                conversation = Conversation(episode_id, [], rollout.Trajectory(
                    token_ids=[], action_mask=[], logprobs=[], prompt_length=0, turn_rewards=[],
                    turn_end_positions=[], turn_infos=[], score=0.0, group_id=0, seed=0,
                    truncated=False, num_turns=0, messages=[],
                    info={"success": False, "segment": segment}), [])
                self.conversations.append(conversation)
            conversation.busy = True
            return conversation

    def complete(self, episode_id, body):
        """One chat completion, recorded in its conversation: OpenAI's response body."""
        limit, temperature, top_p, seed, stop = read_options(body, self.max_new_tokens)
        if self.temperature is not None:
            temperature, top_p = self.temperature, 1.0
        messages, tool_schemas = read_messages(body.get("messages")), body.get("tools") or []
        if not isinstance(tool_schemas, list) or not all(isinstance(s, dict) for s in tool_schemas):
            raise RequestError("tools must be a list of function schemas", "tools")
        opening = opening_for(body.get("tool_choice"), tool_schemas)
        keys = [json.dumps(value, sort_keys=True) for value in [tool_schemas, *messages]]
        conversation = self.conversation_for(episode_id, keys, messages)
        trajectory = conversation.trajectory
        try:
            if trajectory.num_turns:  # it goes on: only the new messages are encoded
                new_messages = messages[len(conversation.keys) - 1:]
                observation = rollout.observation_tokens(self.tokenizer, new_messages)
                new_tokens = conversation.closing + observation
            else:  # a new conversation or segment: the history is its prompt
                new_messages = messages
                new_tokens = rollout.encode_chat(
                    self.tokenizer, messages, tool_schemas, add_generation_prompt=True)
                trajectory.prompt_length = len(new_tokens)
            # A forced opening is not the policy's choice (mask 0)
            new_tokens = new_tokens + rollout.encode_text(self.tokenizer, opening)
            length = len(trajectory.token_ids) + len(new_tokens)
            if length >= self.max_total_tokens:
                raise RequestError(
                    f"the conversation is {length} tokens, the context budget "
                    f"{self.max_total_tokens}", "messages", "context_length_exceeded",
                )
            if seed is None:
                seed = rollout.sample_seed_for(
                    *self.episodes.get(episode_id, (0, episode_id)),
                    trajectory.info["segment"], trajectory.num_turns
                )
            limit = min(limit, self.max_total_tokens - length)
            done = Future()
            self.turns.put(Turn(
                trajectory.token_ids + new_tokens, limit, temperature, top_p, seed, episode_id,
                done))
            generation = done.result()
            with self.lock:  # play_one collects under it: a late turn is recorded whole or not
                if not self.is_open(episode_id):  # sampled as its program ended
                    raise RequestError(
                        f"episode {episode_id!r} ended", code="episode_closed", status=404)
                message, finish_reason, sampled, logprobs = self.record(
                    conversation, new_messages, new_tokens, generation, stop, opening,
                    parse=body.get("tool_choice") != "none",
                )
        except BaseException:
            with self.lock:  # the client may still extend it; a new one is forgotten
                conversation.busy = False
                if not trajectory.num_turns and conversation in self.conversations:
                    self.conversations.remove(conversation)
            raise
        # This turn as the client sends it back, read by read_messages
        conversation.keys = keys + [json.dumps(read_messages([message])[0], sort_keys=True)]
        conversation.busy = False
        wanted = body.get("logprobs")
        pieces = [self.tokenizer.decode([token]) for token in sampled] if wanted else []
        return chat_completion(
            self.model_name, message, finish_reason, length, len(generation.token_ids),
            list(zip(pieces, logprobs)) if wanted else None,
        )

    def record(self, conversation, new_messages, new_tokens, generation, stop, opening, parse):
        """Append the new messages' tokens (mask 0), the sampled turn (mask 1, with its
        log-probs) to the trajectory; returns the reply as OpenAI's message (`opening`,
        then the sampled text), the finish reason, the text's tokens and log-probs. A
        stop string cuts the reply as vLLM does: the text before it, the tokens up to the
        one completing it."""
        sampled, conversation.closing = rollout.close_turn(generation, self.end_of_turn)
        text = self.tokenizer.decode(sampled)  # for the client; never encoded again
        if any(string in text for string in stop):
            end = next(end for end in range(1, len(sampled) + 1) if any(
                string in self.tokenizer.decode(sampled[:end]) for string in stop))
            text = self.tokenizer.decode(sampled[:end])
            text = text[:min(text.index(string) for string in stop if string in text)]
            sampled = sampled[:end]
            generation = Generation(sampled, generation.logprobs[:end], "stop")
            # the policy did not end its turn: the env does
            conversation.closing = [self.end_of_turn]
        text = opening + text
        trajectory = conversation.trajectory
        rollout.append(trajectory, new_tokens, 0)
        rollout.append(trajectory, generation.token_ids, 1, generation.logprobs)
        trajectory.turn_end_positions.append(len(trajectory.token_ids) - 1)
        trajectory.turn_rewards.append(0.0)
        trajectory.num_turns += 1
        calls = tools.parse_tool_calls(text) if parse else []
        trajectory.turn_infos.append({
            "order": next(self.order),  # a report's turns are in this order (play_one)
            "tool_calls": len(calls), "invalid_calls": sum(bool(c.error) for c in calls),
            "format_error": False, "calls": [asdict(call) for call in calls],
        })
        trajectory.messages += new_messages + [{"role": "assistant", "content": text}]
        reply_tokens = sampled, generation.logprobs[:len(sampled)]
        if not calls or any(call.error for call in calls):  # none, or a malformed one
            return {"role": "assistant", "content": text}, generation.finish_reason, *reply_tokens
        # the text before the calls, as vLLM's Hermes parser
        content = text[:text.index(tools.OPEN_TAG)].strip()
        return {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for call in calls
        ]}, "tool_calls", *reply_tokens

    def play_one(self, program, episode_id, group_id, seed, timeout_s):
        """Run `program` for one episode of task `seed`: its conversations' trajectories
        (segments), with the reward it reported, or why it failed (a string); forgotten
        here either way."""
        environment = {
            **os.environ, "OPENAI_BASE_URL": f"{self.url}/episodes/{episode_id}/v1",
            "OPENAI_API_KEY": "nanoagent", "NANOAGENT_TASK_SEED": str(seed),
            "NANOAGENT_EPISODE_ID": episode_id,
        }
        try:
            returncode, output, errors = run_program(program, environment, timeout_s)
        except OSError as problem:
            return f"could not start: {problem}"
        finally:
            with self.lock:
                del self.episodes[episode_id]
                trajectories = [c.trajectory for c in self.conversations
                                if c.episode_id == episode_id and c.trajectory.num_turns]
                self.conversations = [c for c in self.conversations if c.episode_id != episode_id]
                self.responses.pop(episode_id, None)
        if returncode is None:
            return f"ran past {timeout_s}s and was killed"
        last_line = (output.strip().splitlines() or [""])[-1]
        try:
            report = json.loads(last_line)
        except ValueError:
            report = None
        reward = report.get("reward") if isinstance(report, dict) else None
        reward = float(reward) if isinstance(reward, (int, float)) else None
        turns = sorted(  # (trajectory, index) of each turn, as recorded
            ((t, k) for t in trajectories for k in range(t.num_turns)),
            key=lambda turn: turn[0].turn_infos[turn[1]]["order"])
        why = (
            f"exit code {returncode}: {errors.strip()[-300:]}" if returncode != 0
            else "no reward reported" if reward is None
            else "no request of it was answered" if not trajectories
            else misreported(report, len(turns))
        )
        if why:
            if refused := self.refusals[episode_id]:
                why += f"; {len(refused)} requests refused, the first: {refused[0]}"
            return f"{why}; its last line: {last_line[-200:]!r}"
        for trajectory in trajectories:
            trajectory.turn_rewards[-1] = trajectory.score = reward
            trajectory.group_id, trajectory.seed = group_id, seed
            trajectory.info.update(
                success=bool(report.get("success")),
                tool_calls=sum(info["tool_calls"] for info in trajectory.turn_infos),
                invalid_calls=sum(info["invalid_calls"] for info in trajectory.turn_infos),
            )
        turn_rewards, states = report.get("turn_rewards"), report.get("states")
        for index, (trajectory, k) in enumerate(turns):
            if turn_rewards is not None:
                trajectory.turn_rewards[k] = float(turn_rewards[index])
                # a segment's last turn also carries the later turns' rewards (module docstring)
                if k == trajectory.num_turns - 1:
                    trajectory.turn_rewards[k] += sum(map(float, turn_rewards[index + 1:]))
            if states is not None:  # as text: a dictionary key
                trajectory.turn_infos[k]["state"] = json.dumps(states[index], sort_keys=True)
        return trajectories

    def play(self, program, seeds, group_size, timeout_s, sample_seed=0):
        """Run `program` (a command line) group_size times for each task seed, all at
        once: the trajectories of the groups whose every member reported a reward,
        group_id the seed's index."""
        episodes = [(group_id, seed) for group_id, seed in enumerate(seeds)
                    for _ in range(group_size)]
        # Episode ids new at each call: a killed program's late request joins no later
        # episode. Sampling seeds from the step's and the episode's place in it: a resumed
        # run samples what an unbroken one would.
        self.plays += 1
        ids = [f"{self.plays}.{index}" for index in range(len(episodes))]
        with self.lock:
            self.episodes = {id: (sample_seed, str(index)) for index, id in enumerate(ids)}
            self.refusals = {id: [] for id in ids}
        with ThreadPoolExecutor(len(episodes)) as pool:
            results = list(pool.map(
                lambda index: self.play_one(program, ids[index], *episodes[index], timeout_s),
                range(len(episodes)),
            ))
        with self.sampling:  # a batch holding a killed program's turn ends first
            pass
        dropped = {}
        for (group_id, seed), result in zip(episodes, results):
            if isinstance(result, str):
                dropped.setdefault(
                    group_id,
                    f"group {group_id} (seed {seed}) dropped: an episode failed ({result})"
                )
        for why in dropped.values():
            print0(why)
        if len(dropped) == len(seeds):
            raise UserError(f"every group was dropped (the log above says why): {program!r}")
        return [trajectory for (group_id, _), result in zip(episodes, results)
                if group_id not in dropped for trajectory in result]

    def close(self):
        self.http.shutdown()
        self.http.server_close()
        self.turns.put(None)


def misreported(report, turns):
    """Why a report's turn_rewards or states is not a list of one entry a turn, or None."""
    for key, kind, name in (("turn_rewards", (int, float), "numbers"),
                            ("states", object, "states")):
        given = report.get(key)
        if given is not None and not (isinstance(given, list) and len(given) == turns
                                      and all(isinstance(entry, kind) for entry in given)):
            return f"its {key} must be a list of {turns} {name}, one a turn: {given!r:.100}"
    return None


def run_program(command, environment, timeout_s):
    """Run a command line in a session and a PID namespace of its own; at its time-out or
    its exit, kill every process it started, wherever it moved, and read its output a
    second more at most: (its exit code, None if it timed out; its output's tail; its
    errors')."""
    token = os.urandom(8).hex()  # sandbox.kill_all's mark, where there is no namespace
    argv = shlex.split(command)
    if not argv or not shutil.which(argv[0], path=environment.get("PATH")):  # unshare's 127
        raise FileNotFoundError(f"no program {argv[:1]} to run (not found, or not executable)")
    with subprocess.Popen(
        own_pid_namespace() + argv,
        env={**environment, "NANOAGENT_SANDBOX": token},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    ) as process:
        output, errors, stopped = sandbox.collect(
            process, timeout_s, 8192, kill=lambda: sandbox.kill_all(process, token), tail=True
        )
    returncode = None if stopped else process.returncode
    return returncode, output.decode(errors="replace"), errors.decode(errors="replace")


@functools.cache
def own_pid_namespace() -> list[str]:
    """The argv prefix that runs a program as the first process of a new PID namespace
    (util-linux's unshare, in a user namespace unless we are root): when it exits or is
    killed, the kernel kills the namespace's every process, whatever their session,
    environment or parent. [] where that is refused."""
    prefix = ["unshare", "--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        prefix += ["--user", "--map-root-user"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
        problem = probe.returncode and (probe.stderr.strip() or f"exit code {probe.returncode}")
    except (OSError, subprocess.TimeoutExpired) as error:
        problem = str(error)
    if not problem:
        return [*prefix, "--"]
    warnings.warn(
        f"{shlex.join(prefix)} fails here ({problem}): a process that an agent program"
        " starts and that leaves its session and drops its environment outlives the"
        " program; allow user namespaces (sysctl kernel.unprivileged_userns_clone=1)",
        RuntimeWarning, stacklevel=2)
    return []


def chat_completion(model_name, message, finish_reason, prompt_tokens, completion_tokens, logprobs):
    """OpenAI's chat completion body; logprobs: the (token's text, log-prob) pairs the
    trajectory records, or None when not asked for."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": model_name,
        "choices": [{
            "index": 0, "message": message, "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else {"content": [
                {"token": piece, "logprob": logprob, "bytes": list(piece.encode()),
                 "top_logprobs": []} for piece, logprob in logprobs
            ]},
        }],
        "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens},
    }


class HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # 64 agents connect at once (the default is 5)


class Handler(BaseHTTPRequestHandler):
    """HTTP for the Server at self.server.endpoint."""
    protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connections

    def route(self):
        """(episode id, the path after /v1): ("7", "/models") for /episodes/7/v1/models."""
        match = re.fullmatch(r"(?:/episodes/([^/]+))?/v1(/[\w/]*?)/?(?:\?.*)?", self.path)
        return (match[1] or "", match[2]) if match else ("", "")

    def do_GET(self):
        if self.route()[1] != "/models":
            return self.send_json(404, error(f"no route GET {self.path}", code="not_found"))
        self.send_json(200, {"object": "list", "data": [{
            "id": self.server.endpoint.model_name, "object": "model", "created": 0,
            "owned_by": "nanoagent",
        }]})

    def do_POST(self):
        episode_id, path = self.route()
        try:
            try:  # read whole first: the connection stays usable whatever it holds
                body = self.rfile.read(max(0, int(self.headers.get("Content-Length") or 0)))
                request = json.loads(body.decode())
            except ValueError as problem:  # no length, not UTF-8, not JSON
                raise RequestError(
                    f"the body is not UTF-8 JSON: {problem}", code="invalid_json") from problem
            if path not in ("/chat/completions", "/responses"):
                raise RequestError(f"no route POST {self.path}", code="not_found", status=404)
            if not isinstance(request, dict):
                raise RequestError("the body must be a JSON object", code="invalid_json")
            if path == "/responses":
                reply = respond(self.server.endpoint, episode_id, request)
                reply = response_events(reply) if request.get("stream") else reply
                return self.send_json(200, reply)
            status, reply = 200, self.server.endpoint.complete(episode_id, request)
            if request.get("stream"):
                reply = events(reply, (request.get("stream_options") or {}).get("include_usage"))
        except RequestError as problem:
            status, reply = problem.status, error(str(problem), problem.param, problem.code)
            self.server.endpoint.refusals.get(episode_id, []).append(f"{status} {problem}")
        except Exception as problem:  # a bug or a sampler failure: a 500, the server goes on
            self.log_error("%r", problem)
            reply = error(f"the server failed: {problem!r}", None, "server_error", "server_error")
            status = 500
        self.send_json(status, reply)

    def send_json(self, status, body):
        """Send a JSON body, or Server-Sent Events (bytes)."""
        streamed = isinstance(body, bytes)
        data = body if streamed else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header(
                "Content-Type", "text/event-stream" if streamed else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError as problem:  # the client left: its turn stays recorded
            print0(f"serve: a client left before its reply ({problem!r})")

    # http.server's own errors, in OpenAI's body too
    def send_error(self, code, message=None, explain=None):
        self.close_connection = True
        self.send_json(code, error(message or f"HTTP {code}", code="invalid_request"))

    # 64 agents' requests would bury the log: errors only
    def log_request(self, code="-", size="-"):
        if str(code).startswith(("4", "5")):
            super().log_request(code, size)


def events(completion, include_usage):
    """A completion as OpenAI streams one (Server-Sent Events of chat.completion.chunk),
    though it was sampled whole: the reply, its tool calls, the finish reason, the usage
    if asked, [DONE]."""
    [choice], message = completion["choices"], completion["choices"][0]["message"]
    deltas = [{"role": "assistant", "content": message["content"]}]
    if "tool_calls" in message:
        deltas.append({"tool_calls": [
            {"index": index, **call} for index, call in enumerate(message["tool_calls"])
        ]})
    chunks = [
        [{"index": 0, "delta": delta, "finish_reason": None,
          "logprobs": None if index else choice["logprobs"]}]
        for index, delta in enumerate(deltas)
    ]
    chunks.append([{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}])
    head = {key: completion[key] for key in ("id", "created", "model")}
    lines = [{**head, "object": "chat.completion.chunk", "choices": choices} for choices in chunks]
    if include_usage:
        lines.append({**lines[-1], "choices": [], "usage": completion["usage"]})
    return "".join(f"data: {json.dumps(line)}\n\n" for line in lines).encode() + b"data: [DONE]\n\n"


def error(message, param=None, code=None, kind="invalid_request_error"):
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -----------------------------------------------------------------------------
# The Responses API: a request becomes a chat completion (Server.complete: recorded,
# batched, token-exact as any), its reply a Response


def responses_to_chat(body, items):
    """A Responses request, after `items` (its previous response's input and output), as
    a chat completion request; and all its items. A message and the function calls after
    it are one assistant turn, as chat's tool_calls are."""
    new, tools = body.get("input"), body.get("tools") or []
    new = [{"role": "user", "content": new}] if isinstance(new, str) else new
    if not isinstance(new, list):
        raise RequestError(f"input={new!r:.200}: must be a string or a list of items", "input")
    instructions, items = body.get("instructions"), items + new
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        item = item if isinstance(item, dict) else {"type": item}  # not an item: refused below
        kind, text = item.get("type", "message"), item.get("content", item.get("output"))
        if isinstance(text, list):  # input_text/output_text parts: chat's, read_messages joins them
            text = [{**part, "type": "text"} if isinstance(part, dict) and part.get("type") in (
                "input_text", "output_text") else part for part in text]
        role = "system" if item.get("role") == "developer" else item.get("role")
        if kind == "message" and role in ("user", "system", "assistant"):
            messages.append({"role": role, "content": text})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "function_call":
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            call = {"name": item.get("name"), "arguments": item.get("arguments")}
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item.get("call_id"), "function": call})
        else:
            raise RequestError(
                f"input: cannot read {item!r:.200} (this endpoint reads user, system, developer "
                "and assistant messages, function_call and function_call_output items)", "input")
    if not isinstance(tools, list) or any(
            not isinstance(tool, dict) or tool.get("type") != "function" for tool in tools):
        raise RequestError(f"tools={tools!r:.200}: only function tools are served here", "tools",
                           "unsupported_value")
    choice = body.get("tool_choice")
    named = isinstance(choice, dict) and choice.get("type") == "function"
    return {
        "messages": messages, "tool_choice": {"function": choice} if named else choice,
        "tools": [{"type": "function", "function": {
            key: value for key, value in tool.items() if key != "type"}} for tool in tools],
        "max_tokens": checked(body, "max_output_tokens", None, 1, math.inf, int),
        **{field: body.get(field) for field in ("temperature", "top_p", *NEUTRAL)},
    }, items


def chat_to_response(completion):
    """A chat completion as a Response: a message item (its text, if any, or no call), then
    function_call items; "incomplete" if cut by max_output_tokens, as OpenAI's."""
    [choice], usage = completion["choices"], completion["usage"]
    message, cut = choice["message"], choice["finish_reason"] == "length"
    status, calls = "incomplete" if cut else "completed", message.get("tool_calls", [])
    text = {"type": "output_text", "text": message["content"] or "", "annotations": []}
    output = [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
               "role": "assistant", "content": [text]}] if text["text"] or not calls else []
    output += [{"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                "status": "completed", **call["function"]} for call in calls]
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "model": completion["model"],
        "created_at": completion["created"], "status": status, "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"]},
    }


def respond(server, episode_id, body):
    """POST /v1/responses: the Response, its items kept for previous_response_id (the
    module docstring)."""
    kept, previous = server.responses.get(episode_id, {}), body.get("previous_response_id")
    if previous is not None and str(previous) not in kept:
        raise RequestError(f"previous_response_id={previous!r}: no response of this episode "
                           "has it", "previous_response_id", "previous_response_not_found")
    chat, items = responses_to_chat(body, kept.get(str(previous), []))
    response = chat_to_response(server.complete(episode_id, chat))
    server.responses.setdefault(episode_id, {})[response["id"]] = items + response["output"]
    return response


def response_events(response):
    """A Response as OpenAI streams one (Server-Sent Events), though it was sampled whole:
    created, in progress, each output item's events, then completed (or incomplete)."""
    begun = {"response": {**response, "status": "in_progress", "output": []}}
    events = [("created", begun), ("in_progress", begun)]
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            [part], at = item["content"], {**at, "content_index": 0}
            empty, middle = {"content": []}, [
                ("content_part.added", {**at, "part": {**part, "text": ""}}),
                ("output_text.delta", {**at, "delta": part["text"], "logprobs": []}),
                ("output_text.done", {**at, "text": part["text"], "logprobs": []}),
                ("content_part.done", {**at, "part": part})]
        else:
            empty, middle = {"arguments": ""}, [
                ("function_call_arguments.delta", {**at, "delta": item["arguments"]}),
                ("function_call_arguments.done", {**at, "arguments": item["arguments"]})]
        events += [("output_item.added", {"output_index": index,
                                          "item": {**item, **empty, "status": "in_progress"}}),
                   *middle, ("output_item.done", {"output_index": index, "item": item})]
    events.append((response["status"], {"response": response}))
    return "".join(
        f"data: {json.dumps({'type': f'response.{kind}', **fields, 'sequence_number': n})}\n\n"
        for n, (kind, fields) in enumerate(events)).encode()


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Serve a policy behind an OpenAI-compatible endpoint."
    )
    add = parser.add_argument
    add("--model", required=True,
        help="Hub name, local checkpoint directory or .gguf file, 'tiny' or 'smollm2-135m'")
    add("--host", default="127.0.0.1", help="the address to bind (default: this machine only)")
    add("--port", type=int, default=8000)
    add("--max_new_tokens", type=int, default=256, help="per reply, unless the request says less")
    add("--max_total_tokens", type=int, default=4096, help="per conversation")
    add("--out_dir", default="runs/served", help="where the conversations go on Ctrl-C")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(resolve_model_path(args.model))
    server = Server(
        TorchSampler(model), tokenizer, args.max_new_tokens, args.max_total_tokens,
        model_name=args.model, host=args.host, port=args.port
    )
    print(f"serving {args.model} at {server.url}/v1")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:  # each conversation its own group, the report's unit
        trajectories = [
            replace(c.trajectory, group_id=group_id)
            for group_id, c in enumerate(server.conversations)
        ]
        path = Path(args.out_dir) / TRAJECTORIES
        path.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(path, trajectory_records(trajectories, tokenizer, 0))
        print(f"{len(trajectories)} conversations written to {path}")


if __name__ == "__main__":
    main()
