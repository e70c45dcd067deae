"""
Serve the policy behind an OpenAI-compatible endpoint, and record what it sampled as trajectories.

    python -m nanoagent.serve --model runs/default/step_000100 --port 8000 --out_dir runs/served
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none python my_agent.py   # any agent, unchanged

Most agents are already written: a loop over the `openai` client's chat completions with tools. So the
policy sits behind `POST /v1/chat/completions` (non-streaming, `tools`, `tool_choice` "auto", `temperature`,
`max_tokens`, `seed`; fields it does not know are ignored, as OpenAI's and vLLM's servers do) and
`GET /v1/models`, and the agent runs as it is (AReaL's OpenAI proxy, verl's RemoteAgentLoop, Agent Lightning).
A reply holding Hermes `<tool_call>` blocks comes back as OpenAI `tool_calls`, read by tools.parse_tool_calls.

Token in, token out, through a text API. A request carries the conversation as text; rendering it again and
encoding it would not give the tokens the model sampled (rollout.py's docstring: the drift behind Agent-R1's
NaN losses). So the endpoint keeps every conversation's tokens (a rollout.Trajectory) and matches each
request's messages against them by prefix: the history it already answered stays as it was sampled, with
the sampler's log-probs (mask 1), and only the new messages (tool results, user turns) are encoded, the way
rollout() encodes an env's observations (mask 0). A history that does not extend what was sampled (the
client edited or summarised it, or wrote an assistant turn itself) starts a new segment: a new trajectory of
the same episode, rendered whole as its prompt, its `info["segment"]` counting up.

Batching. Each request's turn goes to one sampler thread, which waits `window_s` after the first for others:
the turns that arrive together (64 agents answering their tool results) share one sampler.generate, as in
rollout()'s lockstep, and turns that come while a batch runs make up the next.

Episodes (train.py --agent). `play` runs the user's program once per episode, with its own base URL
($OPENAI_BASE_URL = .../episodes/<id>/v1: its conversations are told apart from the others' by the URL), the
task seed ($NANOAGENT_TASK_SEED) and the episode's id ($NANOAGENT_EPISODE_ID) in its environment. The program
reports its reward as the last line of its output, a JSON object: {"reward": 1.0, "success": true}. The
reward goes on the last token of the episode's last turn. A program that crashes, runs past the time-out
(killed) or prints no reward loses its group for the step, and the log says why.
"""

import argparse
import json
import os
import queue
import shlex
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import rollout
import tools
from nanoagent.common import UserError, print0
from nanoagent.models import load_model, resolve_model_path
from nanoagent.report import TRAJECTORIES, append_jsonl, trajectory_records
from nanoagent.sampler import TorchSampler

ROLES = ("system", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the endpoint refuses, answered with OpenAI's error body."""

    def __init__(self, message, code=None, status=400):
        super().__init__(message)
        self.code, self.status = code, status


def text_of(content):
    """A message's content as text: a string, None, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        return "".join(part.get("text", "") for part in content)
    raise RequestError("content must be a string or a list of text parts (this endpoint reads text only)")


def read_messages(body):
    """The request's messages as the chat template takes them ({"role", "content", "tool_calls": [{"name",
    "arguments": {...}}]}, nothing else), checked: known roles, tool messages answering a call of the last
    assistant turn."""
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError("'messages' must be a non-empty list")
    messages, call_ids = [], set()
    for index, message in enumerate(body["messages"]):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise RequestError(f"messages[{index}]: unknown role {role!r}; this endpoint knows {', '.join(ROLES)}")
        read = {"role": role, "content": text_of(message.get("content"))}
        if role == "assistant" and message.get("tool_calls"):
            try:
                read["tool_calls"] = [{"name": call["function"]["name"],
                                       "arguments": json.loads(call["function"]["arguments"])}
                                      for call in message["tool_calls"]]
                call_ids = {call.get("id") for call in message["tool_calls"]}
            except (KeyError, TypeError, ValueError) as error:
                raise RequestError(f"messages[{index}]: malformed tool_calls ({error})") from error
        elif role == "assistant":
            call_ids = set()
        if role == "tool" and message.get("tool_call_id") not in call_ids:
            raise RequestError(f"messages[{index}]: tool message with tool_call_id {message.get('tool_call_id')!r} "
                               "answers no tool call of the assistant turn before it")
        messages.append(read)
    return messages


@dataclass
class Conversation:
    episode: str  # the episode's id from the URL ("" outside training)
    keys: list[str]  # its tools and messages so far, the last reply included, as JSON: what a request extends
    trajectory: rollout.Trajectory
    closing: list[int]  # the <|im_end|> a turn cut by max_tokens lacks, added before the next observation
    busy: bool = True  # a turn of it is being sampled: a concurrent request cannot extend it


class Server:
    """The endpoint's state: the sampler and its batching thread, and the conversations it is recording."""

    def __init__(self, sampler, tokenizer, max_new_tokens, max_total_tokens, temperature=None, window_s=0.05,
                 model_name="nanoagent", host="127.0.0.1", port=0):
        self.sampler, self.tokenizer, self.model_name = sampler, tokenizer, model_name
        self.max_new_tokens, self.max_total_tokens, self.window_s = max_new_tokens, max_total_tokens, window_s
        self.temperature = temperature  # None: the request's; train.py fixes it to the temperature it trains at
        self.end_of_turn = tokenizer.convert_tokens_to_ids(rollout.END_OF_TURN)
        self.stop_token_ids = [tokenizer.convert_tokens_to_ids(token) for token in rollout.STOP_TOKENS]
        self.conversations, self.lock, self.turns = [], threading.Lock(), queue.Queue()
        self.sample_seed, self.episodes_played = 0, 0
        self.http = ThreadingHTTPServer((host, port), Handler)
        self.http.endpoint = self
        self.url = f"http://{host}:{self.http.server_address[1]}"
        threading.Thread(target=self.sample_batches, daemon=True).start()
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def sample_batches(self):
        """The sampler thread: the turns that arrive within window_s of the first share one generate call
        (one per temperature: the sampler takes one)."""
        while True:
            batch, deadline = [self.turns.get()], time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(self.turns.get(timeout=left))
                except queue.Empty:
                    break
            for temperature in {turn[2] for turn in batch}:
                rows = [turn for turn in batch if turn[2] == temperature]  # (prompt, limit, temperature, seed, done)
                try:
                    generations = self.sampler.generate([row[0] for row in rows], [row[1] for row in rows],
                                                        temperature=temperature, stop_token_ids=self.stop_token_ids,
                                                        seed=[row[3] for row in rows])
                    for row, generation in zip(rows, generations):
                        row[4].set_result(generation)
                except Exception as error:  # the requests fail with it (a 500), the thread goes on
                    for row in rows:
                        row[4].set_exception(error)

    def extendable(self, episode, keys, messages):
        """The idle conversation of `episode` whose history `keys` extends with new messages, none of them an
        assistant turn of the client's own (the longest, if several), marked busy; None if there is none."""
        with self.lock:
            matches = [c for c in self.conversations if c.episode == episode and not c.busy
                       and len(keys) > len(c.keys) and keys[:len(c.keys)] == c.keys
                       and all(m["role"] != "assistant" for m in messages[len(c.keys) - 1:])]
            conversation = max(matches, key=lambda c: len(c.keys), default=None)
            if conversation is not None:
                conversation.busy = True
            return conversation

    def complete(self, episode, body):
        """One chat completion: the OpenAI response body; the turn is recorded in its conversation."""
        if body.get("stream"):
            raise RequestError("stream: this endpoint answers whole responses only; send stream=false")
        if (body.get("n") or 1) != 1:
            raise RequestError(f"n={body['n']}: this endpoint samples one choice per request")
        if (body.get("tool_choice") or "auto") != "auto":
            raise RequestError(f"tool_choice {body['tool_choice']!r}: this endpoint supports 'auto' only")
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or self.max_new_tokens
        if not isinstance(limit, int) or limit < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {limit!r}")
        messages, tool_schemas = read_messages(body), body.get("tools") or []
        keys = [json.dumps(tool_schemas, sort_keys=True)] + [json.dumps(m, sort_keys=True) for m in messages]
        conversation = self.extendable(episode, keys, messages)
        try:
            if conversation is not None:  # only the new messages are encoded, after the tokens already there
                history = conversation.trajectory.token_ids
                new_messages = messages[len(conversation.keys) - 1:]
                new_tokens = conversation.closing + rollout.observation_tokens(self.tokenizer, new_messages)
                segment, turn = conversation.trajectory.info["segment"], conversation.trajectory.num_turns
            else:  # a new conversation, or a new segment of this episode: the whole history is its prompt
                history, new_messages = [], messages
                new_tokens = rollout.encode_chat(self.tokenizer, messages, tool_schemas, add_generation_prompt=True)
                segment, turn = sum(c.episode == episode for c in self.conversations), 0
            length = len(history) + len(new_tokens)
            if length >= self.max_total_tokens:
                raise RequestError(f"the conversation is {length} tokens, the context budget {self.max_total_tokens}",
                                   code="context_length_exceeded")
            seed = body.get("seed")
            seed = rollout.sample_seed_for(self.sample_seed, episode, segment, turn) if seed is None else seed
            temperature = self.temperature if self.temperature is not None else body.get("temperature", 1.0)
            done = Future()
            self.turns.put((history + new_tokens, min(limit, self.max_total_tokens - length), temperature, seed, done))
            generation = done.result()
        except BaseException:
            if conversation is not None:  # unchanged: the client may still extend it
                conversation.busy = False
            raise
        if conversation is None:
            trajectory = rollout.Trajectory(
                token_ids=[], action_mask=[], logprobs=[], prompt_length=len(new_tokens), turn_rewards=[],
                turn_end_positions=[], turn_infos=[], score=0.0, group_id=0, seed=0, truncated=False, num_turns=0,
                messages=[], info={"success": False, "segment": segment})
            conversation = Conversation(episode, keys, trajectory, [])
            with self.lock:
                self.conversations.append(conversation)
        message, read_back, finish_reason = self.record(conversation, new_messages, new_tokens, generation)
        conversation.keys, conversation.busy = keys + [json.dumps(read_back, sort_keys=True)], False
        completion_tokens = len(generation.token_ids)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
                "usage": {"prompt_tokens": length, "completion_tokens": completion_tokens,
                          "total_tokens": length + completion_tokens}}

    def record(self, conversation, new_messages, new_tokens, generation):
        """Append the new messages' tokens (mask 0) and the sampled turn (mask 1, its log-probs) to the
        conversation's trajectory; returns the reply as OpenAI's message, the same as read_messages reads it
        back from the client, and the finish reason."""
        trajectory = conversation.trajectory
        rollout.append(trajectory, new_tokens, 0)
        rollout.append(trajectory, generation.token_ids, 1, generation.logprobs)
        trajectory.turn_end_positions.append(len(trajectory.token_ids) - 1)
        trajectory.turn_rewards.append(0.0)
        trajectory.num_turns += 1
        sampled, conversation.closing = rollout.close_turn(generation, self.end_of_turn)
        text = self.tokenizer.decode(sampled)  # for the client; never encoded again
        calls = tools.parse_tool_calls(text)
        trajectory.turn_infos.append({"tool_calls": len(calls), "invalid_calls": sum(bool(c.error) for c in calls),
                                      "format_error": False, "calls": [asdict(call) for call in calls]})
        trajectory.messages += new_messages + [{"role": "assistant", "content": text}]  # the turns as sampled
        if not calls or any(call.error for call in calls):  # no call, or a malformed one: the text as it is
            finish_reason = "stop" if generation.finish_reason == "stop" else "length"
            return {"role": "assistant", "content": text}, {"role": "assistant", "content": text}, finish_reason
        content = text[:text.index(tools.OPEN_TAG)].strip()  # what precedes the calls, as vLLM's Hermes parser
        message = {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}} for call in calls]}
        return message, {"role": "assistant", "content": content, "tool_calls": [
            {"name": call.name, "arguments": call.arguments} for call in calls]}, "tool_calls"

    def close(self):
        """Stop answering and free the port."""
        self.http.shutdown()
        self.http.server_close()

    def take(self, episode):
        """The conversations (segments) of an episode, in order, forgotten here."""
        with self.lock:
            taken = [c for c in self.conversations if c.episode == episode]
            self.conversations = [c for c in self.conversations if c.episode != episode]
        return taken

    def play(self, program, seeds, group_size, timeout_s, sample_seed=0):
        """Run `program` (a command line) group_size times for each task seed, all at once against this endpoint;
        returns the trajectories of the groups whose every member reported a reward (group_id: the seed's index)."""
        self.sample_seed, runs = sample_seed, []
        for group_id, seed in enumerate(seeds):
            for _ in range(group_size):
                episode, self.episodes_played = str(self.episodes_played), self.episodes_played + 1
                output = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty program cannot block on it
                environment = {**os.environ, "OPENAI_BASE_URL": f"{self.url}/episodes/{episode}/v1",
                               "OPENAI_API_KEY": "nanoagent", "NANOAGENT_TASK_SEED": str(seed),
                               "NANOAGENT_EPISODE_ID": episode}
                process = subprocess.Popen(shlex.split(program), env=environment, stdout=output,
                                           stderr=subprocess.STDOUT, text=True)
                runs.append((group_id, seed, episode, process, output))
        deadline, trajectories, dropped = time.monotonic() + timeout_s, [], {}
        for group_id, seed, episode, process, output in runs:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
                output.seek(0)
                lines = output.read().strip().splitlines() or [""]
                report = json.loads(lines[-1]) if process.returncode == 0 else None
                reward = float(report["reward"])
                conversations = self.take(episode)
                assert conversations, "it made no request"
            except subprocess.TimeoutExpired:
                process.kill()
                dropped.setdefault(group_id, f"episode {episode} (seed {seed}) ran past {timeout_s}s and was killed")
            except (ValueError, TypeError, KeyError, AssertionError) as problem:
                why = f"exit code {process.returncode}" if process.returncode else str(problem)
                dropped.setdefault(group_id, f"episode {episode} (seed {seed}) reported no reward ({why}); "
                                             f"its last line: {lines[-1][-200:]!r}")
            else:
                for conversation in conversations:
                    trajectory = conversation.trajectory
                    trajectory.turn_rewards[-1] = trajectory.score = reward
                    trajectory.group_id, trajectory.seed = group_id, seed
                    trajectory.info.update(success=bool(report.get("success", False)),
                                           tool_calls=sum(info["tool_calls"] for info in trajectory.turn_infos),
                                           invalid_calls=sum(info["invalid_calls"] for info in trajectory.turn_infos))
                    trajectories.append(trajectory)
            finally:
                self.take(episode)  # a killed program's half-played conversations go too
                output.close()
        for group_id, why in sorted(dropped.items()):
            print0(f"group {group_id} (seed {seeds[group_id]}) dropped: {why}")
        if len(dropped) == len(seeds):
            raise UserError(f"every group of the step was dropped (the log above says why): {program!r}")
        return [t for t in trajectories if t.group_id not in dropped]


class Handler(BaseHTTPRequestHandler):
    """HTTP for the Server at self.server.endpoint: /v1/... or /episodes/<id>/v1/... (an episode's own URL)."""
    protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connections

    def route(self):
        """(episode id, the path after /v1)."""
        parts = self.path.split("?")[0].rstrip("/").split("/v1", 1)
        return parts[0].removeprefix("/episodes/") if parts[0] else "", parts[1] if len(parts) > 1 else ""

    def do_GET(self):
        if self.route()[1] != "/models":
            return self.send_json(404, error(f"no route GET {self.path}", "not_found"))
        self.send_json(200, {"object": "list", "data": [{"id": self.server.endpoint.model_name, "object": "model",
                                                          "created": 0, "owned_by": "nanoagent"}]})

    def do_POST(self):
        episode, path = self.route()
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path != "/chat/completions":
            return self.send_json(404, error(f"no route POST {self.path}", "not_found"))
        try:
            request = json.loads(body)
        except ValueError as problem:
            return self.send_json(400, error(f"the body is not JSON: {problem}", "invalid_json"))
        try:
            if not isinstance(request, dict):
                raise RequestError("the body must be a JSON object")
            self.send_json(200, self.server.endpoint.complete(episode, request))
        except RequestError as problem:
            self.send_json(problem.status, error(str(problem), problem.code))
        except Exception as problem:  # a bug or a sampler failure: this request fails, the server goes on
            self.log_error("%s", repr(problem))
            self.send_json(500, error(f"the server failed: {problem!r}", "server_error"))

    def send_json(self, status, body):
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError as problem:  # the client went away mid-request: its turn stays recorded, nothing else
            print0(f"serve: a client left before its reply ({problem})")

    def log_message(self, format, *args):  # 64 agents' requests would bury the log: errors only
        if args and str(args[1]).startswith(("4", "5")):
            super().log_message(format, *args)


def error(message, code=None):
    """OpenAI's error body."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Serve a policy behind an OpenAI-compatible endpoint.")
    parser.add_argument("--model", required=True, help="Hub name, local checkpoint directory or 'tiny'")
    parser.add_argument("--host", default="127.0.0.1", help="the address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max_new_tokens", type=int, default=256, help="per reply, unless the request says less")
    parser.add_argument("--max_total_tokens", type=int, default=4096, help="per conversation")
    parser.add_argument("--out_dir", default="runs/served", help="where the conversations go on shutdown")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(resolve_model_path(args.model))
    server = Server(TorchSampler(model), tokenizer, args.max_new_tokens, args.max_total_tokens,
                    model_name=args.model, host=args.host, port=args.port)
    print(f"serving {args.model} at {server.url}/v1 (Ctrl-C writes the conversations to {args.out_dir})")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        trajectories = [c.trajectory for c in server.conversations if c.trajectory.num_turns]
        for group_id, trajectory in enumerate(trajectories):
            trajectory.group_id = group_id
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        append_jsonl(Path(args.out_dir) / TRAJECTORIES, trajectory_records(trajectories, tokenizer, 0))
        print(f"{len(trajectories)} conversations written to {Path(args.out_dir) / TRAJECTORIES}")


if __name__ == "__main__":
    main()
