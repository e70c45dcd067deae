"""serve.py with the real `openai` client against a real server on localhost: token-exact trajectories,
tool calls, batching of concurrent conversations, OpenAI-style errors, episodes played by outside programs."""

import contextlib
import http.client
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch

import tools
from nanoagent.common import UserError
from nanoagent.models import tiny_model, tiny_tokenizer
from nanoagent.report import trajectory_records
from nanoagent.sampler import Generation, TorchSampler
from serve import Server, own_pid_namespace
from rollout import encode_chat, observation_tokens, render, sample_seed_for
from tests.test_rollout import REPLIES, TOOL_CALL, ScriptedSampler, scripted_replies

EXAMPLE_AGENT = Path(__file__).resolve().parent.parent / "examples" / "multihop_agent.py"
CALCULATOR = [tools.calculator_tool().schema()]
OPENING = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 3 + 4?"}]


class Recording:
    """A sampler that keeps every call's prompts, generations and batch size."""

    def __init__(self, sampler):
        self.sampler, self.calls, self.options = sampler, [], []

    def generate(self, prompts, max_new_tokens, **options):
        if options["temperature"] == 0.5:  # how a test makes the sampler fail
            raise RuntimeError("the sampler broke")
        generations = self.sampler.generate(prompts, max_new_tokens, **options)
        self.calls.append(([list(prompt) for prompt in prompts], generations))
        self.options.append(options)
        return generations


@pytest.fixture(scope="module")
def tiny():
    tokenizer = tiny_tokenizer()
    return tiny_model(tokenizer, seed=0), tokenizer


def serving(sampler, tokenizer, **options):
    server = Server(sampler, tokenizer, max_new_tokens=options.pop("max_new_tokens", 100),
                    max_total_tokens=options.pop("max_total_tokens", 1000), **options)
    return server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def sampler_threads():
    return [thread for thread in threading.enumerate() if thread.name.endswith("(sample_batches)")]


def sampler_threads_left(before):
    """The endpoints' sampler threads started since `before` (a list of them) that are still alive, given 10 s to
    end. A thread left alive after it ran torch keeps its OpenMP team: on 2 cores every later torch op in the
    process then runs about 1.5x slower (the team's worker sleeps between ops instead of spinning)."""
    started = [thread for thread in sampler_threads() if thread not in before]
    for thread in started:
        thread.join(timeout=10)
    return [thread for thread in started if thread.is_alive()]


def conversations_of(server, episode_id):
    return [conversation for conversation in server.conversations if conversation.episode_id == episode_id]


def assert_is_the_rendered_conversation(trajectory, tokenizer, texts, replies):
    """The trajectory of OPENING, three sampled turns `texts` (token ids `replies`) with a tool result and a user
    message between them is the template's rendering of that conversation, rollout()'s tokens for the same turns,
    and its mask 1 is exactly on the sampled tokens."""
    rendered = render(tokenizer, OPENING + [{"role": "assistant", "content": texts[0]},
                                            {"role": "tool", "content": "7"},
                                            {"role": "assistant", "content": texts[1]},
                                            {"role": "user", "content": "Please answer."},
                                            {"role": "assistant", "content": texts[2]}], CALCULATOR)
    assert trajectory.token_ids == tokenizer.encode(rendered[:-1], add_special_tokens=False)
    assert trajectory.prompt_length == len(encode_chat(tokenizer, OPENING, CALCULATOR, add_generation_prompt=True))
    mask = torch.tensor(trajectory.action_mask)
    assert torch.tensor(trajectory.token_ids)[mask == 1].tolist() == [t for ids, _ in replies for t in ids]


def test_tool_calls_come_back_as_openai_tool_calls_and_the_trajectory_is_the_sampled_tokens():
    tokenizer = tiny_tokenizer()
    replies = scripted_replies(tokenizer)  # a tool call, "Let me think.", an answer: each ends with <|im_end|>
    sampler = Recording(ScriptedSampler(tokenizer, replies))
    server, client = serving(sampler, tokenizer)
    messages = list(OPENING)
    first = client.chat.completions.create(model="m", messages=messages, tools=CALCULATOR)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls] == [
        ("calculator", {"expression": "3 + 4"})]
    messages += [choice.message, {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "7"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=CALCULATOR)
    assert second.choices[0].message.content == REPLIES[1] and second.choices[0].finish_reason == "stop"
    messages += [second.choices[0].message, {"role": "user", "content": "Please answer."}]
    third = client.chat.completions.create(model="m", messages=messages, tools=CALCULATOR,
                                           extra_body={"top_k": -1})  # neutral: accepted
    assert third.choices[0].message.content == REPLIES[2]
    [conversation] = conversations_of(server, "")
    server.close()
    trajectory = conversation.trajectory
    assert_is_the_rendered_conversation(trajectory, tokenizer, REPLIES, replies)
    for turn, (prompts, generations) in enumerate(sampler.calls):  # each turn's prompt: the tokens so far, as kept
        assert prompts == [trajectory.token_ids[:len(prompts[0])]]
        end = trajectory.turn_end_positions[turn] + 1
        assert trajectory.token_ids[end - len(generations[0].token_ids):end] == generations[0].token_ids
        assert trajectory.logprobs[end - len(generations[0].token_ids):end] == generations[0].logprobs
    assert sum(trajectory.action_mask) == sum(len(ids) for ids, _ in replies) and trajectory.num_turns == 3
    assert trajectory.turn_infos[0]["calls"] == [{"name": "calculator", "arguments": {"expression": "3 + 4"},
                                                  "error": None}]
    record = trajectory_records([trajectory], tokenizer, 0)[0]  # what the report reads
    assert [turn["text"] for turn in record["turns"]] == REPLIES and record["turns"][0]["answers"] == ["7"]


def test_the_trajectory_holds_exactly_what_the_torch_sampler_returned(tiny):
    model, tokenizer = tiny
    sampler = Recording(TorchSampler(model))
    server, client = serving(sampler, tokenizer, max_new_tokens=12)
    messages = list(OPENING)
    for turn in range(3):
        reply = client.chat.completions.create(model="m", messages=messages, tools=CALCULATOR, seed=turn)
        messages += [reply.choices[0].message, {"role": "user", "content": f"Go on {turn}."}]
    [conversation] = conversations_of(server, "")
    server.close()
    trajectory, position = conversation.trajectory, 0
    for turn, (prompts, generations) in enumerate(sampler.calls):
        [prompt], [generation] = prompts, generations
        assert prompt == trajectory.token_ids[:len(prompt)]  # the history as sampled: never re-encoded
        if turn:  # what came between two turns: the closing <|im_end|> of a cut turn and the new message, mask 0
            closing = [] if sampler.calls[turn - 1][1][0].finish_reason == "stop" else [
                tokenizer.convert_tokens_to_ids("<|im_end|>")]
            between = closing + observation_tokens(tokenizer, [{"role": "user", "content": f"Go on {turn - 1}."}])
            assert prompt[position:] == between and trajectory.action_mask[position:len(prompt)] == [0] * len(between)
        end = len(prompt) + len(generation.token_ids)
        assert trajectory.token_ids[len(prompt):end] == generation.token_ids
        assert trajectory.logprobs[len(prompt):end] == generation.logprobs
        assert trajectory.action_mask[len(prompt):end] == [1] * len(generation.token_ids)
        position = end
    assert position == len(trajectory.token_ids)


def test_a_history_that_does_not_extend_the_sampled_one_starts_a_new_segment():
    tokenizer = tiny_tokenizer()
    server, client = serving(ScriptedSampler(tokenizer, scripted_replies(tokenizer)), tokenizer)
    episode = openai.OpenAI(base_url=f"{server.url}/episodes/7/v1", api_key="none", max_retries=0)
    first = episode.chat.completions.create(model="m", messages=OPENING, tools=CALCULATOR).choices[0].message
    edited = [*OPENING, {"role": "assistant", "content": "I will just guess."}, {"role": "user", "content": "Go."}]
    episode.chat.completions.create(model="m", messages=edited, tools=CALCULATOR)
    client.chat.completions.create(model="m", messages=OPENING, tools=CALCULATOR)  # another conversation, not ep. 7's
    segments = conversations_of(server, "7")
    assert [c.trajectory.info["segment"] for c in segments] == [0, 1] and first.tool_calls
    assert segments[1].trajectory.prompt_length == len(encode_chat(tokenizer, edited, CALCULATOR,
                                                                   add_generation_prompt=True))
    assert len(conversations_of(server, "")) == 1
    server.close()


def bad_request(client, code=None, **request):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="m", **{"messages": OPENING, **request})
    assert raised.value.status_code == 400 and (code is None or raised.value.code == code)
    return str(raised.value)


def test_bad_requests_get_openai_errors_and_the_server_goes_on():
    tokenizer = tiny_tokenizer()
    before = sampler_threads()
    server, client = serving(ScriptedSampler(tokenizer, scripted_replies(tokenizer)), tokenizer, max_total_tokens=400)
    [sampling] = [thread for thread in sampler_threads() if thread not in before]
    assert "n=2" in bad_request(client, n=2)
    assert "unknown role" in bad_request(client, messages=[{"role": "wizard", "content": "hi"}])
    assert "answers no tool call" in bad_request(client, messages=[*OPENING, {"role": "tool", "tool_call_id": "x",
                                                                               "content": "7"}])
    bad_request(client, code="context_length_exceeded", messages=[{"role": "user", "content": "many words " * 300}])
    assert "tool_choice='required'" in bad_request(client, tool_choice="required")  # no tools
    connection = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    connection.request("POST", "/v1/chat/completions", body=b'{"messages": [', headers={"Content-Type": "json"})
    response = connection.getresponse()
    assert response.status == 400 and json.loads(response.read())["error"]["code"] == "invalid_json"
    whole = json.dumps({"messages": OPENING, "max_tokens": 3}).encode()
    for payload in (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 500\r\n\r\n{\"messa",  # leaves mid-body
                    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(whole), whole)):
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as raw:
            raw.sendall(payload)
    assert client.models.list().data[0].id == "nanoagent"
    assert client.chat.completions.create(model="m", messages=OPENING, tools=CALCULATOR).choices[0].message.tool_calls
    assert sampling.is_alive()
    server.close()
    assert sampler_threads_left(before) == []  # close ends the sampler thread


def post_raw(server, body, path="/v1/chat/completions"):
    """(status, reply bytes) of one POST of raw bytes or a JSON body, as any client sends it."""
    connection = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    connection.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())
    response = connection.getresponse()
    return response.status, response.read()


def post(server, body, path="/v1/chat/completions"):
    """(status, JSON reply) of one POST."""
    status, reply = post_raw(server, body, path)
    return status, json.loads(reply)


BAD_VALUES = [{"temperature": "hot"}, {"temperature": [1]}, {"temperature": -1},
              {"temperature": 2.5}, {"seed": "x"}, {"seed": 1.5}, {"seed": 2**64},
              {"max_tokens": True}, {"max_tokens": 0}, {"max_completion_tokens": "5"},
              {"top_p": 1.5}, {"stop": 5}, {"stop": ["a", 1]}, {"stop": [""]},
              {"n": 2}, {"presence_penalty": 0.5}, {"frequency_penalty": -1},
              {"logit_bias": {"7": 5}}, {"top_k": 5},
              {"messages": "hi"}, {"tools": "calculator"}, {"tools": [1]}]


def test_bad_values_get_a_400_naming_them_and_never_reach_the_sampler():
    tokenizer = tiny_tokenizer()
    sampler = Recording(ScriptedSampler(tokenizer, scripted_replies(tokenizer)))
    server, client = serving(sampler, tokenizer, max_new_tokens=5)
    for fields in BAD_VALUES:
        [field] = fields
        status, reply = post(server, {"model": "m", "messages": OPENING, **fields})
        problem = reply["error"]
        assert (status, problem["param"], problem["type"]) == (400, field, "invalid_request_error")
        assert problem["message"].startswith(field if field != "messages" else "'messages'"), reply
    # Not UTF-8, not an object, not JSON, no messages:
    for body in (b"\xff\xfe{}", b"[1]", b'{"messages": [', b"{}"):
        status, reply = post(server, body)
        assert status == 400 and reply["error"]["code"] in ("invalid_json", "invalid_value"), body
    assert post(server, b"{}", "/v1/nowhere")[0] == 404 and sampler.calls == []
    connection = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    connection.request("DELETE", "/v1/chat/completions")  # a method http.server answers itself
    response = connection.getresponse()
    assert response.status == 501 and json.loads(response.read())["error"]["type"]
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 400")  # answered, not left reading
    # A null temperature is the default; --max_new_tokens caps a reply, whatever max_tokens says.
    reply = client.chat.completions.create(model="m", messages=OPENING, temperature=None,
                                           max_tokens=50)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    assert sampler.options[0]["temperature"] == 1.0 and sampler.options[0]["top_p"] == 1.0
    server.close()


def test_an_unforeseen_failure_is_a_logged_500_with_openai_error_body_and_the_server_goes_on(capsys):
    tokenizer = tiny_tokenizer()
    sampler = Recording(ScriptedSampler(tokenizer, scripted_replies(tokenizer)))
    server, client = serving(sampler, tokenizer)
    status, reply = post(server, {"messages": OPENING, "temperature": 0.5})  # Recording fails
    assert status == 500 and reply["error"]["type"] == "server_error"
    assert "RuntimeError('the sampler broke')" in reply["error"]["message"]
    assert "RuntimeError('the sampler broke')" in capsys.readouterr().err
    assert client.chat.completions.create(model="m", messages=OPENING).choices[0].message.tool_calls
    server.close()


def test_stop_cuts_the_reply_as_vllm_does_and_the_trajectory_keeps_the_tokens_up_to_it():
    tokenizer = tiny_tokenizer()
    replies = scripted_replies(tokenizer)
    sampler = Recording(ScriptedSampler(tokenizer, replies))
    server, client = serving(sampler, tokenizer, temperature=0.7)
    first = client.chat.completions.create(model="m", messages=OPENING, top_p=0.1,
                                           stop=["zebra", '"arguments'])
    assert first.choices[0].message.content == '<tool_call>\n{"name": "calculator", '
    assert first.choices[0].finish_reason == "stop" and first.choices[0].message.tool_calls is None
    # The token that completes the stop string, from the tokenizer's own offsets: the turn's last.
    spans = tokenizer(TOOL_CALL, add_special_tokens=False, return_offsets_mapping=True)
    stop_end = TOOL_CALL.index('"arguments') + len('"arguments')
    end = 1 + next(t for t, (_, last) in enumerate(spans["offset_mapping"]) if last >= stop_end)
    messages = [*OPENING, first.choices[0].message, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="m", messages=messages)
    [conversation] = conversations_of(server, "")
    server.close()
    trajectory, prompt_length = conversation.trajectory, conversation.trajectory.prompt_length
    sampled = slice(prompt_length, prompt_length + end)
    assert trajectory.token_ids[sampled] == replies[0][0][:end]
    assert trajectory.action_mask[sampled] == [1] * end
    assert trajectory.logprobs[sampled] == sampler.calls[0][1][0].logprobs[:end]  # unchanged
    # The policy did not end the turn: the env's <|im_end|> closes it (mask 0), then the message.
    between = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    between += observation_tokens(tokenizer, messages[-1:])
    assert sampler.calls[1][0][0] == trajectory.token_ids[:prompt_length + end] + between
    assert trajectory.action_mask[prompt_length + end:][:len(between)] == [0] * len(between)
    # The trainer's sampling settings win over the request's (train.py --agent).
    assert [(o["temperature"], o["top_p"]) for o in sampler.options] == [(0.7, 1.0), (0.7, 1.0)]
    server, client = serving(Recording(ScriptedSampler(tokenizer, replies)), tokenizer)
    for top_p, sent in ((0.1, 0.1), (0, 1e-9)):  # top_p 0: the most likely token only
        client.chat.completions.create(model="m", messages=OPENING, top_p=top_p, temperature=0.3)
        options = server.sampler.options[-1]
        assert (options["top_p"], options["temperature"]) == (sent, 0.3)
    server.close()


def test_concurrent_first_requests_of_an_episode_get_segments_and_seeds_of_their_own():
    tokenizer = tiny_tokenizer()
    sampler = Recording(ScriptedSampler(tokenizer, scripted_replies(tokenizer)))
    server, _ = serving(sampler, tokenizer, window_s=0.5)
    episode = openai.OpenAI(base_url=f"{server.url}/episodes/e/v1", api_key="none", max_retries=0)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: episode.chat.completions.create(model="m", messages=OPENING),
                      range(4)))
    segments = sorted(c.trajectory.info["segment"] for c in conversations_of(server, "e"))
    seeds = sorted(seed for options in sampler.options for seed in options["seed"])
    server.close()
    assert segments == [0, 1, 2, 3]
    assert seeds == sorted(sample_seed_for(0, "e", segment, 0) for segment in range(4))


class Holding(Recording):
    """Holds its batches, after the first `free`, until play's episodes are over (a program that leaves
    mid-turn)."""
    free = 0

    def generate(self, prompts, max_new_tokens, **options):
        while len(self.calls) >= self.free and self.server.episodes:
            time.sleep(0.01)
        generations = super().generate(prompts, max_new_tokens, **options)
        self.returned = time.monotonic()
        return generations


def test_when_play_returns_its_episodes_are_over_and_nothing_of_theirs_is_sampled(tmp_path, capsys):
    tokenizer = tiny_tokenizer()
    sampler = Holding(ScriptedSampler(tokenizer, scripted_replies(tokenizer)))
    server, _ = serving(sampler, tokenizer)
    sampler.server = server
    # Two turns in flight when the program exits: the first being sampled, the second queued.
    leaving = program(tmp_path, "leaving", """import threading, time, openai
client = openai.OpenAI(max_retries=0)
for _ in range(2):
    threading.Thread(target=client.chat.completions.create, daemon=True,
                     kwargs={"model": "m", "messages": [{"role": "user", "content": "Q"}]}).start()
    time.sleep(0.5)
print('{"reward": 1.0}')
""")
    with pytest.raises(UserError, match="every group"):
        server.play(leaving, [0], group_size=1, timeout_s=60)
    returned = time.monotonic()
    assert "no request of it was answered" in capsys.readouterr().out
    assert len(sampler.calls) == 1 and sampler.returned < returned  # the queued turn: never sampled
    status, reply = post(server, {"messages": OPENING}, "/episodes/1.0/v1/chat/completions")
    assert (status, reply["error"]["code"]) == (404, "episode_closed")  # a late request
    assert post(server, {"messages": OPENING})[0] == 200  # outside play's episodes: served as ever
    server.close()


def test_a_turn_sampled_as_its_program_exits_is_not_recorded_in_the_trajectories_play_returned(tmp_path):
    tokenizer = tiny_tokenizer()
    sampler = Holding(ScriptedSampler(tokenizer, scripted_replies(tokenizer)))
    server, _ = serving(sampler, tokenizer)
    sampler.server, sampler.free = server, 1
    # One turn answered, then a second sent, whose sampling ends after the program exits and play collected its
    # trajectory: its reply reaches a handler thread while play (then the update) reads that trajectory.
    late = program(tmp_path, "late", """import threading, time, openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "Q"}]
reply = client.chat.completions.create(model="m", messages=messages, tool_choice="none")
messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Q2"}]
threading.Thread(target=client.chat.completions.create, daemon=True,
                 kwargs={"model": "m", "messages": messages, "tool_choice": "none"}).start()
time.sleep(0.5)
print('{"reward": 1.0}')
""")
    [trajectory] = server.play(late, [0], group_size=1, timeout_s=60)
    played = (list(trajectory.token_ids), list(trajectory.turn_rewards))
    time.sleep(0.5)  # the late turn's handler thread, given time to record it
    server.close()
    assert len(sampler.calls) == 2  # the late turn was sampled
    assert (list(trajectory.token_ids), list(trajectory.turn_rewards)) == played
    assert trajectory.num_turns == 1 and trajectory.turn_rewards == [1.0]


NAMED = {"type": "function", "function": {"name": "calculator"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_tool_choice_forces_the_calls_opening_with_mask_0_and_the_sampler_continues_it(tool_choice):
    tokenizer = tiny_tokenizer()
    opening = "<tool_call>\n"
    opening += '{"name": "calculator", "arguments": ' if tool_choice == NAMED else ""
    rest = tokenizer.encode(TOOL_CALL[len(opening):], add_special_tokens=False)
    rest += [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    sampler = Recording(ScriptedSampler(tokenizer, [(rest, "stop")]))
    server, client = serving(sampler, tokenizer)
    reply = client.chat.completions.create(model="m", messages=OPENING, tools=CALCULATOR,
                                           tool_choice=tool_choice)
    [conversation] = conversations_of(server, "")
    server.close()
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator",
                                                                         {"expression": "3 + 4"})
    prompt = encode_chat(tokenizer, OPENING, CALCULATOR, add_generation_prompt=True)
    forced = tokenizer.encode(opening, add_special_tokens=False)
    assert sampler.calls[0][0] == [prompt + forced]  # the sampler continues from the opening
    trajectory = conversation.trajectory
    assert trajectory.token_ids == prompt + forced + rest
    assert trajectory.prompt_length == len(prompt)
    assert trajectory.action_mask == [0] * (len(prompt) + len(forced)) + [1] * len(rest)


def test_tool_choice_none_parses_no_call_and_a_forced_call_that_does_not_parse_comes_back_as_text():
    tokenizer = tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = ScriptedSampler(tokenizer, [(tokenizer.encode(TOOL_CALL) + [end], "stop")])
    server, client = serving(sampler, tokenizer)
    reply = client.chat.completions.create(model="m", messages=OPENING, tools=CALCULATOR,
                                           tool_choice="none").choices[0]
    message = reply.message
    assert (message.content, message.tool_calls, reply.finish_reason) == (TOOL_CALL, None, "stop")
    sampler.replies = [(tokenizer.encode(" oops") + [end], "stop")]
    reply = client.chat.completions.create(model="m", messages=OPENING, tools=CALCULATOR,
                                           tool_choice="required").choices[0]
    assert (reply.message.content, reply.message.tool_calls) == ("<tool_call>\n oops", None)
    assert conversations_of(server, "")[-1].trajectory.turn_infos[0]["invalid_calls"] == 1
    server.close()


def test_a_streamed_reply_is_the_whole_reply_in_openai_chunks_and_is_recorded_as_one():
    tokenizer = tiny_tokenizer()
    replies = scripted_replies(tokenizer)
    server, client = serving(Recording(ScriptedSampler(tokenizer, replies)), tokenizer)
    stream = client.chat.completions.create(model="m", messages=OPENING, tools=CALCULATOR,
                                            stream=True, stream_options={"include_usage": True},
                                            logprobs=True)
    chunks = list(stream)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    [call] = [call for delta in deltas for call in delta.tool_calls or []]
    assert (call.index, call.function.name, json.loads(call.function.arguments)) == (
        0, "calculator", {"expression": "3 + 4"})
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(replies[0][0]) and not chunks[-1].choices
    logprobs = [token.logprob for token in chunks[0].choices[0].logprobs.content]
    assert logprobs == server.sampler.calls[0][1][0].logprobs[:-1]  # recorded, bar <|im_end|>
    status, raw = post_raw(server, {"messages": OPENING, "stream": True})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    # The client's rebuilt message extends the conversation: one trajectory.
    tool_call = {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
    messages = [*OPENING, {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    client.chat.completions.create(model="m", messages=messages, tools=CALCULATOR)
    assert [c.trajectory.num_turns for c in conversations_of(server, "")] == [2, 1]
    server.close()


def test_logprobs_are_the_recorded_ones_in_openai_shape_and_top_logprobs_are_refused():
    tokenizer = tiny_tokenizer()
    replies = scripted_replies(tokenizer)
    sampler = Recording(ScriptedSampler(tokenizer, replies))
    server, client = serving(sampler, tokenizer)
    reply = client.chat.completions.create(model="m", messages=OPENING, logprobs=True,
                                           top_logprobs=0)
    content = reply.choices[0].logprobs.content
    assert [token.logprob for token in content] == sampler.calls[0][1][0].logprobs[:-1]
    assert "".join(token.token for token in content) == TOOL_CALL
    assert bytes(content[0].bytes).decode() == content[0].token and content[0].top_logprobs == []
    assert client.chat.completions.create(model="m", messages=OPENING).choices[0].logprobs is None
    refusal = bad_request(client, "unsupported_value", logprobs=True, top_logprobs=2)
    assert "top_logprobs=2" in refusal
    server.close()


# The Responses API (POST /v1/responses), the Agents SDK's default model
CALCULATOR_FLAT = [{"type": "function", **schema["function"]} for schema in CALCULATOR]  # Responses' shape
INSTRUCTIONS, QUESTION = OPENING[0]["content"], OPENING[1]["content"]
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_responses_items_previous_response_id_and_streams_extend_one_token_exact_trajectory():
    tokenizer = tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = ["Let me compute.\n" + TOOL_CALL, *REPLIES[1:]]  # text and a tool call, "Let me think.", an answer
    replies = [(tokenizer.encode(text, add_special_tokens=False) + [end], "stop") for text in texts]
    sampler = Recording(ScriptedSampler(tokenizer, replies))
    server, client = serving(sampler, tokenizer)
    asked = {"model": "m", "instructions": INSTRUCTIONS, "tools": CALCULATOR_FLAT}
    with client.responses.stream(**asked, input=QUESTION) as stream:  # the client's own stream reader
        streamed = list(stream)
        first = stream.get_final_response()
    [message, call] = first.output  # the text before the call, then the call, as two items
    assert (message.type, first.output_text, first.status) == ("message", "Let me compute.", "completed")
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "calculator",
                                                                 {"expression": "3 + 4"})
    assert [event.type for event in streamed] == [
        "response.created", "response.in_progress", *MESSAGE_EVENTS, "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [event.snapshot for event in streamed if event.type.endswith("delta")] == [  # what the reader built
        "Let me compute.", call.arguments]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "7"}
    second = client.responses.create(**asked, previous_response_id=first.id, input=[answer])
    assert (second.output_text, second.status) == (REPLIES[1], "completed")
    assert second.usage.output_tokens == len(replies[1][0])
    assert second.usage.total_tokens == second.usage.input_tokens + second.usage.output_tokens
    # The whole item list sent again, as the Agents SDK does by default, streamed:
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             *[item.to_dict() for item in first.output], answer, *[item.to_dict() for item in second.output],
             {"role": "user", "content": "Please answer."}]
    events = list(client.responses.create(**asked, input=items, stream=True))
    assert [event.type for event in events] == ["response.created", "response.in_progress", *MESSAGE_EVENTS,
                                                "response.completed"]
    assert events[4].delta == REPLIES[2] and events[-1].response.output_text == REPLIES[2]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    [conversation] = conversations_of(server, "")
    server.close()
    trajectory = conversation.trajectory
    assert_is_the_rendered_conversation(trajectory, tokenizer, texts, replies)  # the tools in chat's shape
    assert trajectory.num_turns == 3 and trajectory.turn_infos[0]["tool_calls"] == 1


def test_a_responses_conversation_holds_exactly_what_the_torch_sampler_returned(tiny):
    model, tokenizer = tiny
    sampler = Recording(TorchSampler(model))
    server, client = serving(sampler, tokenizer, max_new_tokens=12)
    asked = {"model": "m", "instructions": INSTRUCTIONS, "tools": CALCULATOR_FLAT}
    first = client.responses.create(**asked, input=QUESTION)
    second = client.responses.create(**asked, input="Go on 0.", previous_response_id=first.id)
    [*_, completed] = client.responses.create(**asked, input="Go on 1.", previous_response_id=second.id,
                                              stream=True)
    [conversation] = conversations_of(server, "")
    server.close()
    trajectory, position = conversation.trajectory, 0
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for turn, ((prompts, generations), reply) in enumerate(zip(sampler.calls, [first, second, completed.response])):
        [prompt], [generation] = prompts, generations
        assert prompt == trajectory.token_ids[:len(prompt)]  # the history as sampled: never re-encoded
        if turn:  # what came between two turns: the closing <|im_end|> of a cut turn and the new message, mask 0
            closing = [] if sampler.calls[turn - 1][1][0].finish_reason == "stop" else [end_of_turn]
            between = closing + observation_tokens(tokenizer, [{"role": "user", "content": f"Go on {turn - 1}."}])
            assert prompt[position:] == between and trajectory.action_mask[position:len(prompt)] == [0] * len(between)
        end = len(prompt) + len(generation.token_ids)
        assert trajectory.token_ids[len(prompt):end] == generation.token_ids
        assert trajectory.logprobs[len(prompt):end] == generation.logprobs
        assert trajectory.action_mask[len(prompt):end] == [1] * len(generation.token_ids)
        text = tokenizer.decode([token for token in generation.token_ids if token != end_of_turn])
        assert reply.output_text == text and reply.usage.output_tokens == len(generation.token_ids)
        assert reply.status == ("completed" if generation.finish_reason == "stop" else "incomplete")
        position = end
    assert position == len(trajectory.token_ids)


RESPONSES_REFUSED = [{"tools": [{"type": "web_search"}]}, {"tools": "calculator"},
                     {"include": ["file_search_call.results"]}, {"reasoning": {"effort": "high"}},
                     {"background": True}, {"conversation": "conv_1"},
                     {"text": {"format": {"type": "json_object"}}}, {"previous_response_id": "resp_none"},
                     {"input": 5}, {"input": [{"type": "reasoning", "summary": []}]},
                     {"input": [{"role": "tool", "content": "7"}]},
                     {"max_output_tokens": 0}, {"top_logprobs": 2}, {"temperature": 3},
                     {"tool_choice": {"type": "web_search_preview"}}]


def test_responses_refuse_what_the_samplers_cannot_honour_with_a_400_naming_it():
    tokenizer = tiny_tokenizer()
    sampler = Recording(ScriptedSampler(tokenizer, scripted_replies(tokenizer)))
    server, client = serving(sampler, tokenizer)
    for fields in RESPONSES_REFUSED:
        field = next(iter(fields))
        status, reply = post(server, {"model": "m", "input": QUESTION, **fields}, "/v1/responses")
        problem = reply["error"]
        assert (status, problem["param"], problem["type"]) == (400, field, "invalid_request_error"), reply
        assert problem["message"].startswith(field), reply
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    status, reply = post(server, {"model": "m", "input": [image]}, "/v1/responses")
    assert status == 400 and "reads text only" in reply["error"]["message"]
    assert sampler.calls == []
    # Kept within its episode: store true or false, another episode's id is unknown.
    episode = openai.OpenAI(base_url=f"{server.url}/episodes/7/v1", api_key="none", max_retries=0)
    kept = episode.responses.create(model="m", input=QUESTION, store=True)
    with pytest.raises(openai.BadRequestError, match=kept.id):
        client.responses.create(model="m", input="Go on.", previous_response_id=kept.id)
    # max_output_tokens, temperature and top_p reach the sampler; a named function forces the call's opening.
    reply = client.responses.create(model="m", input=QUESTION, store=False, max_output_tokens=3, temperature=0.3,
                                    top_p=0.9, tools=CALCULATOR_FLAT,
                                    tool_choice={"type": "function", "name": "calculator"})
    assert (reply.status, reply.incomplete_details.reason, reply.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 3)
    assert (sampler.options[-1]["temperature"], sampler.options[-1]["top_p"]) == (0.3, 0.9)
    opening = tokenizer.encode('<tool_call>\n{"name": "calculator", "arguments": ', add_special_tokens=False)
    assert sampler.calls[-1][0][0][-len(opening):] == opening
    server.close()


def test_a_responses_program_plays_one_trajectory_an_episode_and_its_responses_go_with_it(tmp_path):
    tokenizer = tiny_tokenizer()
    server, _ = serving(ScriptedSampler(tokenizer, scripted_replies(tokenizer)), tokenizer)
    chained = program(tmp_path, "chained", """import openai
client = openai.OpenAI(max_retries=0)
first = client.responses.create(model="m", input="Q", tool_choice="none")
client.responses.create(model="m", input="Go on.", previous_response_id=first.id, tool_choice="none")
print('{"reward": 1.0}')
""")
    [trajectory] = server.play(chained, [0], group_size=1, timeout_s=60)
    assert trajectory.num_turns == 2 and trajectory.info["segment"] == 0 and trajectory.score == 1.0
    assert not server.responses  # forgotten when play ended the episode
    server.close()


def test_64_concurrent_conversations_complete_in_shared_sampler_calls(tiny):
    model, tokenizer = tiny
    sampler = Recording(TorchSampler(model))
    server, client = serving(sampler, tokenizer, max_new_tokens=8, window_s=0.2)

    def conversation(index):
        messages = [{"role": "user", "content": f"Question {index}?"}]
        for turn in range(2):
            reply = client.chat.completions.create(model="m", messages=messages, temperature=1.0)
            messages += [reply.choices[0].message, {"role": "user", "content": "And?"}]
        return reply

    with ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(conversation, range(64)))
    conversations = conversations_of(server, "")
    server.close()
    assert len(replies) == 64 and len(conversations) == 64
    assert all(c.trajectory.num_turns == 2 for c in conversations)
    batch_sizes = [len(prompts) for prompts, _ in sampler.calls]
    assert sum(batch_sizes) == 128 and len(batch_sizes) < 32, batch_sizes  # batched, not one call per request


def program(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return f"{sys.executable} {path}"


CALLER = """import json, os, openai
client = openai.OpenAI(max_retries=0)
reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Q"}], max_tokens=4)
seed = int(os.environ["NANOAGENT_TASK_SEED"])
"""


def test_play_runs_programs_and_drops_groups_that_crash_hang_or_do_not_report(tiny, tmp_path, capsys):
    model, tokenizer = tiny
    server, _ = serving(TorchSampler(model), tokenizer, max_new_tokens=4)
    good = program(tmp_path, "good", CALLER + 'print("log line")\nprint(json.dumps({"reward": seed / 10, '
                                              '"success": True}))\n')
    trajectories = server.play(good, [3, 5], group_size=2, timeout_s=60)
    assert [(t.group_id, t.seed, t.score, t.turn_rewards[-1]) for t in trajectories] == [
        (0, 3, 0.3, 0.3), (0, 3, 0.3, 0.3), (1, 5, 0.5, 0.5), (1, 5, 0.5, 0.5)]
    assert all(t.info["success"] and t.num_turns == 1 for t in trajectories) and not server.conversations
    flaky = program(tmp_path, "flaky", CALLER + """import time
if seed == 1: raise SystemExit("crashed")
if seed == 2: time.sleep(60)
print("no reward" if seed == 3 else json.dumps({"reward": 1.0}))
""")
    trajectories = server.play(flaky, [0, 1, 3], group_size=1, timeout_s=120)
    assert [t.seed for t in trajectories] == [0]
    log = capsys.readouterr().out
    assert "seed 1) dropped" in log and "exit code 1" in log and "crashed" in log
    assert "seed 3) dropped" in log and "no reward" in log
    with pytest.raises(UserError, match="every group"):  # the one that hangs is killed at the time-out
        server.play(flaky, [2], group_size=1, timeout_s=3)
    assert "seed 2) dropped" in capsys.readouterr().out and not server.conversations
    with pytest.raises(UserError, match="every group"):
        server.play(str(tmp_path / "no-such-program"), [0], group_size=1, timeout_s=30)
    assert "could not start" in capsys.readouterr().out
    server.close()


# As smolagents writes its memory back (docs/performance.md): a tool call as the agent's own text, so the turn
# after a call starts a segment; a turn of plain text comes back as sent and extends it.
RE_RENDERING = """import json, os, openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "What is 3 + 4?"}]
for turn in range(3):
    reply = client.chat.completions.create(model="m", messages=messages).choices[0].message
    calls = [call.function.model_dump() for call in reply.tool_calls or []]
    messages += [{"role": "assistant", "content": f"Calling tools: {calls}" if calls else reply.content},
                 {"role": "user", "content": "Observation: 7"}]
print(json.dumps({"reward": float(os.environ["NANOAGENT_EPISODE_ID"].endswith(".0"))}))
"""


def test_every_turn_of_an_episode_that_rewrites_its_history_gets_the_episode_reward_as_credit(tmp_path):
    import itertools
    import masks
    tokenizer = tiny_tokenizer()
    sampler = Recording(ScriptedSampler(tokenizer, scripted_replies(tokenizer)))  # a call, text, the answer
    server, _ = serving(sampler, tokenizer)
    trajectories = server.play(program(tmp_path, "re_rendering", RE_RENDERING), [0], group_size=2, timeout_s=60)
    server.close()
    # Two episodes (rewards 1 and 0) of 3 turns: 2 segments each, the first of 1 turn, the second of 2
    assert [(t.score, t.info["segment"], t.num_turns) for t in trajectories] == [
        (1.0, 0, 1), (1.0, 1, 2), (0.0, 0, 1), (0.0, 1, 2)]
    # Every sampled turn is in one segment, as sampled, with mask 1 (a run of mask 1 is a turn)
    runs = [tuple(token for token, _ in run) for t in trajectories
            for agent, run in itertools.groupby(zip(t.token_ids, t.action_mask), lambda pair: pair[1]) if agent]
    assert sorted(runs) == sorted(tuple(g.token_ids) for _, batch in sampler.calls for g in batch)
    # Every segment's last agent token carries its episode's reward, so every agent token gets credit:
    # its return (REINFORCE++, and GAE at gamma = lambda = 1 with V = 0) is the reward; GRPO's sign is its own.
    batch = masks.collate(trajectories, pad_token_id=0)
    action_mask = batch["action_mask"]  # (B, T)
    ends = [t.turn_end_positions[-1] for t in trajectories]
    assert action_mask[range(4), ends].all()
    assert batch["token_rewards"][range(4), ends].tolist() == [1.0, 1.0, 0.0, 0.0]
    scores = torch.tensor([t.score for t in trajectories])[:, None]  # (B, 1)
    _, returns = masks.compute_gae(batch["token_rewards"], torch.zeros(action_mask.shape), action_mask, 1.0, 1.0)
    assert torch.equal(returns, scores * action_mask)
    grpo = masks.grpo_advantages(scores[:, 0], [t.group_id for t in trajectories])[:, None] * action_mask
    assert ((grpo > 0) == (action_mask.bool() & (scores == 1))).all()
    assert ((grpo < 0) == (action_mask.bool() & (scores == 0))).all()


def test_a_rewritten_historys_earlier_segment_keeps_the_per_turn_rewards_of_the_turns_after_it(tmp_path):
    import masks
    tokenizer = tiny_tokenizer()
    server, _ = serving(ScriptedSampler(tokenizer, scripted_replies(tokenizer)), tokenizer)
    reports_turns = RE_RENDERING.replace(
        'print(json.dumps({"reward": float(os.environ["NANOAGENT_EPISODE_ID"].endswith(".0"))}))',
        'print(json.dumps({"reward": 1.0, "turn_rewards": [0.0, -0.1, 1.0]}))')
    trajectories = server.play(program(tmp_path, "turns", reports_turns), [0], group_size=1, timeout_s=60)
    server.close()
    # Segment 0 holds turn 0, segment 1 turns 1 and 2: each token's return is the episode's from its turn on,
    # as one trajectory would have it (REINFORCE++, GAE at gamma = lambda = 1 with V = 0).
    assert [(t.info["segment"], t.turn_rewards) for t in trajectories] == [(0, [pytest.approx(0.9)]), (1, [-0.1, 1.0])]
    batch = masks.collate(trajectories, pad_token_id=0)
    _, returns = masks.compute_gae(batch["token_rewards"], torch.zeros(batch["action_mask"].shape),
                                   batch["action_mask"], 1.0, 1.0)
    first_tokens = [(t.action_mask.index(1), t.turn_end_positions[0] + 1) for t in trajectories]
    assert [returns[row, start].item() for row, (start, _) in enumerate(first_tokens)] == pytest.approx([0.9, 0.9])


def alive(pid):
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def sleepers_reporting_to(directory):
    """Program source that starts processes that sleep, each appending its pid as the trainer sees it (/proc/self
    is read through the trainer's /proc, not the program's PID namespace) to directory/pids-<task seed>:
    `sleeper` is their argv, `wait_for(n)` returns once n pids are there."""
    return f"""import os, subprocess, sys, time
pids = os.path.join({str(directory)!r}, "pids-" + os.environ["NANOAGENT_TASK_SEED"])
sleeper = [sys.executable, "-c", "import os, sys, time; "
           "open(sys.argv[1], 'a').write(os.readlink('/proc/self') + ' '); time.sleep(600)", pids]
def wait_for(n):
    while not os.path.exists(pids) or len(open(pids).read().split()) < n:
        time.sleep(0.01)
"""


def test_a_program_is_killed_with_everything_it_started_at_its_time_out_and_when_it_exits(tmp_path):
    tokenizer = tiny_tokenizer()
    server, _ = serving(ScriptedSampler(tokenizer, scripted_replies(tokenizer)), tokenizer)
    spawner = program(tmp_path, "spawner", sleepers_reporting_to(tmp_path) + """
subprocess.Popen(sleeper)
wait_for(1)
if os.environ["NANOAGENT_TASK_SEED"] == "0":
    time.sleep(600)  # hangs: killed at the time-out
print('{"reward": 1.0}')  # leaves its helper running
""")
    with pytest.raises(UserError, match="every group"):  # neither made a request
        server.play(spawner, [0, 1], group_size=1, timeout_s=5)
    server.close()
    helpers = [int(pid) for seed in "01" for pid in (tmp_path / f"pids-{seed}").read_text().split()]
    deadline = time.monotonic() + 10  # the killed helpers' new parent reaps them
    while any(map(alive, helpers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(helpers) == 2 and not any(map(alive, helpers))


def test_children_that_leave_the_session_and_keep_stdout_open_neither_hold_play_nor_outlive_it(tmp_path):
    # Each program starts three sleepers that keep its stdout open: one in a session of its own, one double-forked
    # (orphaned at once), one that also drops its environment (the token): its PID namespace kills all three. Where
    # namespaces are refused nothing finds the last one, but play stops reading a second after the kill all the same.
    tokenizer = tiny_tokenizer()
    server, _ = serving(ScriptedSampler(tokenizer, scripted_replies(tokenizer)), tokenizer)
    detacher = program(tmp_path, "detacher", sleepers_reporting_to(tmp_path) + """
subprocess.Popen(sleeper, start_new_session=True)
wait_for(1)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, sleeper)
    os._exit(0)
os.wait()
wait_for(2)
subprocess.Popen(sleeper, start_new_session=True, env={})  # the last line of pids-<seed>
wait_for(3)
if os.environ["NANOAGENT_TASK_SEED"] == "0":
    time.sleep(600)  # hangs: killed at the time-out
print('{"reward": 1.0}')
""")
    start = time.monotonic()
    started = []
    try:
        with pytest.raises(UserError, match="every group"):  # neither made a request
            server.play(detacher, [0, 1], group_size=1, timeout_s=2)
        elapsed = time.monotonic() - start
        started = [[int(pid) for pid in (tmp_path / f"pids-{seed}").read_text().split()] for seed in "01"]
        killed = [pid for pids in started for pid in pids[:3 if own_pid_namespace() else 2]]
        deadline = time.monotonic() + 10  # the killed sleepers' new parent reaps them
        while any(map(alive, killed)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert elapsed < 2 + 5, f"play took {elapsed:.1f} s with a time-out of 2 s"
        assert [len(pids) for pids in started] == [3, 3] and not any(map(alive, killed))
        assert os.geteuid() != 0 or own_pid_namespace(), "root may always make a PID namespace"
    finally:
        server.close()
        for pid in [pid for pids in started for pid in pids]:  # the unmarked ones, too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_program_printing_hundreds_of_megabytes_leaves_the_trainers_memory_flat(tiny, tmp_path):
    model, tokenizer = tiny
    server, _ = serving(TorchSampler(model), tokenizer, max_new_tokens=4)
    flood = program(tmp_path, "flood", CALLER + """import sys
for _ in range(300):
    sys.stdout.write("x" * 2**20 + "\\n")
print(json.dumps({"reward": 0.5}))
""")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    [trajectory] = server.play(flood, [0], group_size=1, timeout_s=120)
    server.close()
    assert trajectory.score == 0.5  # its last line, after 300 MiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 50 * 1024


def test_a_dropped_groups_log_line_names_the_refusals_its_program_got(tmp_path, capsys):
    tokenizer = tiny_tokenizer()
    server, _ = serving(ScriptedSampler(tokenizer, scripted_replies(tokenizer)), tokenizer)
    refused = program(tmp_path, "refused", """import openai
client = openai.OpenAI(max_retries=0)
for _ in range(3):
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Q"}],
                                       tool_choice="any")
    except openai.BadRequestError:
        pass
print('{"reward": 1.0}')
""")
    with pytest.raises(UserError, match="every group"):
        server.play(refused, [0], group_size=1, timeout_s=60)
    server.close()
    assert "3 requests refused, the first: 400 tool_choice='any'" in capsys.readouterr().out


class BySeed:
    """Replies by sampling seed, {seed: text}: a turn's seed names its episode and turn, however rollout() and the
    endpoint each derive it (sample_seed_for)."""

    def __init__(self, tokenizer, replies):
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.replies = {seed: tokenizer.encode(text, add_special_tokens=False) + [end]
                        for seed, text in replies.items()}

    def generate(self, prompts, max_new_tokens, seed, **options):
        return [Generation(self.replies[row], [-0.01] * len(self.replies[row]), "stop") for row in seed]


ROOT = Path(__file__).resolve().parent.parent
# Sokoban seed 2 as an --agent program: the env's own game, played over the endpoint, each turn's step reward and
# state (the messages since the turn before, what states_before_turns reads) on its last line.
SOKOBAN_PLAYER = f"""import json, os, sys
sys.path.insert(0, {str(ROOT)!r})
import envs, openai
env = envs.SokobanEnv(max_turns=5)
messages, _ = env.reset(int(os.environ["NANOAGENT_TASK_SEED"]))
client = openai.OpenAI(max_retries=0)
turn_rewards, states, seen = [], [], [messages[1]["content"]]
while not env.done:
    text = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    result = env.step(text)
    turn_rewards.append(result.reward)
    states.append(seen)
    seen = [message["content"] for message in result.observations]
    messages += [{{"role": "assistant", "content": text}}, *result.observations]
print(json.dumps({{"reward": sum(turn_rewards), "success": env.success, "turn_rewards": turn_rewards,
                  "states": states}}))
"""


def test_an_agent_reporting_its_turns_gets_the_gigpo_advantages_of_the_same_game_played_as_an_env(tmp_path):
    import envs
    import masks
    import rollout
    import train
    # Seed 2's level: Down, Left, Down, Right solves it (+11). Member 1 bumps a wall (its state repeats) and later
    # writes no action (-0.1); member 2 walks back to a grid it saw. Repeated states, turn rewards beside the outcome.
    scripts = [["<answer>Down || Left</answer>", "<answer>Down || Right</answer>"],
               ["<answer>Up</answer>", "<answer>Down || Left</answer>", "I push.", "<answer>Down || Right</answer>"],
               ["<answer>Down || Left</answer>", "<answer>Up</answer>", "<answer>Down</answer>",
                "<answer>Down || Right</answer>"]]
    turns = [(member, turn, text) for member, script in enumerate(scripts) for turn, text in enumerate(script)]
    tokenizer = tiny_tokenizer()
    env_replies = {rollout.sample_seed_for(0, 2, member, turn): text for member, turn, text in turns}
    as_env = rollout.rollout(BySeed(tokenizer, env_replies), tokenizer, lambda: envs.SokobanEnv(max_turns=5), [2],
                             3, max_turns=5, max_new_tokens=100, max_total_tokens=10_000)
    # the endpoint's seeds: (the episode's index in the step, its segment, its turn)
    agent_replies = {rollout.sample_seed_for(0, str(member), 0, turn): text for member, turn, text in turns}
    server, _ = serving(BySeed(tokenizer, agent_replies), tokenizer, max_total_tokens=10_000)
    as_agent = server.play(program(tmp_path, "sokoban", SOKOBAN_PLAYER), [2], group_size=3, timeout_s=120)
    server.close()
    assert [t.token_ids for t in as_agent] == [t.token_ids for t in as_env]  # the same episodes
    assert [t.turn_rewards for t in as_env] == [[0.0, 11.0], [0.0, 0.0, -0.1, 11.0], [0.0, 0.0, 0.0, 11.0]]
    assert len(set(masks.anchor_groups(as_env))) < sum(t.num_turns for t in as_env)  # states repeat
    args = SimpleNamespace(algo="gigpo", gamma=0.95, omega=1.0, dr_grpo=False)
    credits = []
    for trajectories in (as_env, as_agent):  # train.py's step 4, as its loop calls it
        batch = masks.collate(trajectories, tokenizer.pad_token_id)
        loss_mask = batch["action_mask"][:, 1:].float()
        advantages, _, _ = train.credit(args, trajectories, slice(None), batch, batch["token_rewards"], loss_mask,
                                        None, None)
        credits.append((advantages, batch["token_rewards"]))  # the token rewards: PPO's and REINFORCE++'s
    assert torch.equal(credits[0][0], credits[1][0]) and torch.equal(credits[0][1], credits[1][1])
    assert credits[0][0].abs().sum() > 0


TURN_REPORTER = """import json, os, sys, openai
client = openai.OpenAI(max_retries=0)
def ask(messages):
    return client.chat.completions.create(model="m", messages=messages).choices[0].message.content
first = [{"role": "user", "content": "Q1"}]
first.append({"role": "assistant", "content": ask(first)})
ask([{"role": "user", "content": "Q2"}])  # another conversation: a segment of its own
ask(first + [{"role": "user", "content": "Go on."}])  # the first one's second turn
print(json.dumps(json.loads(sys.argv[1])[int(os.environ["NANOAGENT_TASK_SEED"])]))
"""


def test_reported_turns_go_to_the_turns_in_the_order_they_were_answered_and_a_bad_report_drops_its_group(
        tmp_path, capsys):
    import masks
    tokenizer = tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = [(tokenizer.encode(text, add_special_tokens=False) + [end], "stop") for text in ("Hm.", "Done.")]
    server, _ = serving(ScriptedSampler(tokenizer, replies), tokenizer)
    reports = [{"reward": 1.0, "turn_rewards": [0.1, 0.2, 0.7], "states": ["start", {"q": 2}, "start"]},
               {"reward": 1.0, "turn_rewards": [0.1, 0.9]},
               {"reward": 1.0, "states": "start"},
               {"reward": 1.0, "turn_rewards": [0.1, "0.2", 0.7]}]
    command = f"{program(tmp_path, 'reporter', TURN_REPORTER)} {shlex.quote(json.dumps(reports))}"
    first, second = server.play(command, [0, 1, 2, 3], group_size=1, timeout_s=60)
    server.close()
    # Answered in the order segment 0, segment 1, segment 0: the first segment's turns are the first and third;
    # the second segment's one turn also carries the third's reward, which came after it.
    assert [(t.info["segment"], t.turn_rewards, t.score) for t in (first, second)] == [
        (0, [0.1, 0.7], 1.0), (1, [pytest.approx(0.9)], 1.0)]
    # The first segment's two turns met "start", whatever their messages were: one anchor group
    assert [info["state"] for info in first.turn_infos + second.turn_infos] == ['"start"', '"start"', '{"q": 2}']
    assert masks.anchor_groups([first, second]) == [0, 0, 1]
    log = capsys.readouterr().out
    assert "(seed 1) dropped: an episode failed (its turn_rewards must be a list of 3 numbers, one a turn: [0.1" in log
    assert "(seed 2) dropped: an episode failed (its states must be a list of 3 states, one a turn: 'start'" in log
    assert ("(seed 3) dropped: an episode failed (its turn_rewards must be a list of 3 numbers, one a turn: "
            "[0.1, '0.2', 0.7]") in log


# Agents written with the real frameworks, run in their own environment (.ci/run builds it from
# requirements-agents.txt: their pins are not the trainer's, and --agent takes any command line).
FRAMEWORK_AGENTS = Path(__file__).resolve().parent / "agents"
AGENTS_PYTHON = os.environ.get("NANOAGENT_AGENTS_PYTHON")
FINAL_ANSWER = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "7"}}\n</tool_call>'


class Continuing(ScriptedSampler):
    """ScriptedSampler's replies, continuing a forced opening (tool_choice "required") as a policy
    would, instead of writing it again."""

    def generate(self, prompts, max_new_tokens, **options):
        opening = "<tool_call>\n"
        generations = super().generate(prompts, max_new_tokens, **options)
        for row, prompt in enumerate(prompts):
            if self.tokenizer.decode(prompt).endswith(opening):
                text = self.tokenizer.decode(generations[row].token_ids)[len(opening):]
                token_ids = self.tokenizer.encode(text, add_special_tokens=False)
                generations[row] = Generation(token_ids, [-0.5] * len(token_ids), "stop")
        return generations


@pytest.mark.skipif(not AGENTS_PYTHON and not os.environ.get("CI"),
                    reason="NANOAGENT_AGENTS_PYTHON unset (.ci/run sets it); CI always runs these")
# smolagents writes a call back as its own text ("Calling tools: [...]"), an assistant turn the
# client wrote: each of its turns starts a segment (serve.py's docstring), token-exact all the same.
# The Agents SDK's default model speaks the Responses API: whole, streamed, chained by previous_response_id.
@pytest.mark.parametrize("agent, answer, segments", [("langchain_agent", "The answer is 7.", 1),
                                                     ("openai_agents_chat", "The answer is 7.", 1),
                                                     ("openai_agents_responses", "The answer is 7.", 1),
                                                     ("openai_agents_responses --streamed", "The answer is 7.", 1),
                                                     ("openai_agents_responses --chained", "The answer is 7.", 1),
                                                     ("pydantic_ai_agent", "The answer is 7.", 1),
                                                     ("smolagents_agent", FINAL_ANSWER, 2)])
def test_agents_written_with_the_frameworks_play_token_exact_episodes(agent, answer, segments):
    tokenizer = tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = [(tokenizer.encode(text, add_special_tokens=False) + [end], "stop")
               for text in (TOOL_CALL, answer)]  # a call of the calculator, then the answer
    sampler = Recording(Continuing(tokenizer, replies))
    server, _ = serving(sampler, tokenizer, max_total_tokens=100_000)
    name, *flags = agent.split()
    command = f"{AGENTS_PYTHON} {FRAMEWORK_AGENTS / name}.py {' '.join(flags)}"
    trajectories = server.play(command, [0], group_size=1, timeout_s=120)
    server.close()
    assert not server.responses  # forgotten with their episode
    assert [t.info["segment"] for t in trajectories] == list(range(segments))
    assert {t.score for t in trajectories} == {1.0} and sum(t.num_turns for t in trajectories) == 2
    generations = [generation for _, batch in sampler.calls for generation in batch]
    sampled = [(token, logprob) for t in trajectories
               for token, logprob, mask in zip(t.token_ids, t.logprobs, t.action_mask) if mask]
    assert sampled == [pair for g in generations for pair in zip(g.token_ids, g.logprobs)]


def test_the_example_agent_plays_an_episode_through_the_endpoint(tiny):
    model, tokenizer = tiny
    server, _ = serving(TorchSampler(model), tokenizer, max_new_tokens=16)
    [trajectory] = server.play(f"{sys.executable} {EXAMPLE_AGENT}", [4], group_size=1, timeout_s=60)
    server.close()
    assert trajectory.num_turns >= 1 and trajectory.score in (0.0, 1.0)
    assert "search" in tokenizer.decode(trajectory.token_ids[:trajectory.prompt_length])  # its tool, in the prompt


def test_the_example_agent_reports_each_turns_reward_and_what_it_knew():
    sys.path.insert(0, str(EXAMPLE_AGENT.parent))
    import multihop_agent
    question, answer, facts = multihop_agent.new_task(4)
    entity = question.split()[-2]  # "Where was the director of Amber born?"
    call = f'<tool_call>\n{json.dumps({"name": "search", "arguments": {"query": entity}})}\n</tool_call>'
    tokenizer = tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = [(tokenizer.encode(text, add_special_tokens=False) + [end], "stop")
               for text in (call, "Let me think.", f"<answer>{answer}</answer>")]  # a search, a void turn, the answer
    server, _ = serving(ScriptedSampler(tokenizer, replies), tokenizer)
    [trajectory] = server.play(f"{sys.executable} {EXAMPLE_AGENT}", [4], group_size=1, timeout_s=60)
    server.close()
    assert trajectory.turn_rewards == [0.0, -0.1, 1.0] and trajectory.score == 1.0
    # The void turn and the one after it knew the same: GiGPO compares them
    found = multihop_agent.search(entity, facts)
    assert [json.loads(info["state"]) for info in trajectory.turn_infos] == [
        [question, []], [question, [found]], [question, [found]]]


def test_the_example_agent_draws_the_tasks_of_synthetic_qa():
    sys.path.insert(0, str(EXAMPLE_AGENT.parent))
    import multihop_agent
    import envs
    for seed in [0, 1, 7, 10_000_000]:
        env = envs.SyntheticQAEnv(hops=2)
        messages, schemas = env.reset(seed)
        question, answer, facts = multihop_agent.new_task(seed)
        assert messages == [{"role": "system", "content": multihop_agent.SYSTEM}, {"role": "user", "content": question}]
        assert env.answers == [answer] and json.dumps(schemas) == json.dumps([multihop_agent.SEARCH])
        for name in [*{subject for subject, _, _ in facts}, "Nobody", " amber. "]:
            assert env.tools["search"].function(name) == multihop_agent.search(name, facts)


def test_train_takes_its_episodes_from_the_agent_program_and_resumes_as_an_unbroken_run(tmp_path):
    import train
    from nanoagent.report import TRAJECTORIES, read_jsonl
    # The main job's warm-up (cached): groups whose rewards differ, so the weights move at each step.
    flags = ["--agent", f"{sys.executable} {EXAMPLE_AGENT}", "--prompts_per_step", "4", "--group_size", "4",
             "--eval_every", "2", "--eval_episodes", "2", "--save_every", "1"]
    before = sampler_threads()
    straight, history = train.main(flags + ["--steps", "2", "--out_dir", str(tmp_path / "straight")])
    assert sampler_threads_left(before) == []  # the run closed its endpoint
    assert [h["step"] for h in history] == [0, 1, 2] and history[1]["kept_trajectories"] == 16
    assert history[2]["group_reward_std"] > 0  # the resumed step moves the weights
    assert history[1]["logprob_mismatch"] < 1e-4  # the endpoint's log-probs are the policy's
    records = read_jsonl(tmp_path / "straight" / TRAJECTORIES, [])
    assert {record["seed"] for record in records if record["step"] == 1} == {0}  # the first group's two members
    assert "agent" in records[0]["tokens"]["author"]
    # Broken after step 1 (its checkpoint the last) and resumed: the same episodes (their sampling seeds come from
    # the step), the same weights.
    shutil.copytree(tmp_path / "straight", tmp_path / "broken")
    shutil.rmtree(tmp_path / "broken" / "step_000002")
    resumed, again = train.main(flags + ["--steps", "2", "--out_dir", str(tmp_path / "broken"), "--resume"])
    assert [h.get("success") for h in again] == [h.get("success") for h in history]
    for name, tensor in resumed.state_dict().items():
        assert torch.allclose(tensor, straight.state_dict()[name], atol=1e-6), name
