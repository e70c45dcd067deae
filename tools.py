"""
Tools: how an LLM agent acts on the world (Agent-R1's Tool: it executes one action and
returns raw output; envs.py decides what that output is worth).

A tool is a Python function plus a JSON schema for its arguments, which the chat
template renders into the system prompt (`apply_chat_template(messages, tools=[...])`),
in the words the model was trained on. Qwen2.5 (and vLLM's `hermes` parser) use the
Hermes format: the model simply writes, as assistant text,

    <tool_call>
    {"name": "search", "arguments": {"query": "capital of France"}}
    </tool_call>

parse_tool_calls() finds these blocks, run_tool_call() executes one, and the result goes
back as a {"role": "tool"} message, which the Qwen template renders as

    <|im_start|>user
    <tool_response>
    ...observation...
    </tool_response><|im_end|>

Those are environment tokens: the model did not sample them, so masks.py gives them
loss mask 0 and the policy learns only from what it wrote (the call).

Errors go back to the model as text. A malformed call, an unknown tool, a wrong
argument, an exception, a timeout: each is an observation the model reads next turn, so
it learns what a valid call is from the consequences (a wasted turn, a lower reward),
and a bad call never crashes training.

Batches. A tool with a `batch_function` gets a turn's calls from all episodes at once:
the retriever answers them with one HTTP request, encoder forward or BM25 pass; the
python tool runs them side by side, each in nanoagent/sandbox.py.
"""
import ast
import json
import math
import operator
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from nanoagent import sandbox
from nanoagent.retrieval import BM25Retriever


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema: {"type": "object", "properties": {...}, "required": [...]}
    function: Callable[..., str]
    # Optional: many calls at once, [each call's arguments] -> [each call's output].
    batch_function: Callable[[list[dict]], list[str]] | None = None
    bounded: bool = False  # it bounds its own run time (the sandbox does): no time-out

    def schema(self) -> dict:
        """The OpenAI function format HF chat templates (and vLLM) take as `tools=`."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


def string_parameters(name: str, description: str) -> dict:
    """Tool.parameters of a tool that takes one required string argument, `name`."""
    return {
        "type": "object", "properties": {name: {"type": "string", "description": description}},
        "required": [name],
    }


@dataclass
class ToolCall:
    name: str | None
    arguments: dict | None
    error: str | None = None  # a message for the model when the call could not be parsed

# -----------------------------------------------------------------------------
# Parsing: text the model wrote -> ToolCalls

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
UNCLOSED = f"unclosed {OPEN_TAG}: no {CLOSE_TAG} follows it (was the output cut off?)"


def parse_tool_calls(text: str, tool_names=None, max_calls: int = 4) -> list[ToolCall]:
    """Every <tool_call>{json}</tool_call> block in `text`, in order, bad ones with
    `error` set. As strict as vLLM's Hermes parser, which serves the agent: a block ends
    at the first </tool_call> and holds only JSON shaped
    {"name": str, "arguments": {...}}. A server runs no call of a turn with a malformed
    block, nor do we: RL learns what a stray block costs. Stricter: "arguments" must be
    an object (vLLM passes a string on), and an unclosed last block is an error. Calls
    past `max_calls` are dropped, with one error entry."""
    calls, position = [], 0
    while (start := text.find(OPEN_TAG, position)) != -1:
        close = text.find(CLOSE_TAG, start)
        if close == -1:
            calls.append(ToolCall(None, None, UNCLOSED))
            break
        position = close + len(CLOSE_TAG)
        try:
            payload = json.loads(text[start + len(OPEN_TAG):close])  # skips JSON's whitespace only
        except (ValueError, RecursionError) as error:  # RecursionError: absurdly deep nesting
            message = f"invalid JSON inside {OPEN_TAG}: {getattr(error, 'msg', error)}"
            calls.append(ToolCall(None, None, message))
            continue
        calls.append(_tool_call_from_json(payload))
    if any(call.error for call in calls):
        spoiled = (
            f"not run: another {OPEN_TAG} block of this turn is malformed, "
            "so no call of the turn runs"
        )
        return [
            call if call.error else ToolCall(call.name, call.arguments, spoiled) for call in calls
        ]
    if len(calls) > max_calls:
        calls = calls[:max_calls] + [ToolCall(
            None, None, f"too many tool calls: at most {max_calls} per turn, the rest were ignored"
        )]
    for index, call in enumerate(calls):
        if tool_names is not None and call.error is None and call.name not in tool_names:
            calls[index] = ToolCall(
                call.name, call.arguments,
                f"unknown tool {call.name!r}; available tools: {', '.join(sorted(tool_names))}",
            )
    return calls


def _tool_call_from_json(payload) -> ToolCall:
    """Checks the decoded block's shape, {"name": str, "arguments": {...}}."""
    if not isinstance(payload, dict):
        return ToolCall(
            None, None,
            'a tool call must be a JSON object with "name" and "arguments", '
            f'got {_json_type(payload)}',
        )
    name, arguments = payload.get("name"), payload.get("arguments")
    if not isinstance(name, str):
        return ToolCall(None, None, 'the tool call has no "name" string')
    if not isinstance(arguments, dict):
        what = "missing" if "arguments" not in payload else f"a JSON {_json_type(arguments)}"
        return ToolCall(
            name, None, f'"arguments" of tool {name!r} must be a JSON object, but it is {what}'
        )
    return ToolCall(name, arguments)

# -----------------------------------------------------------------------------
# Validating and running one call

# "boolean" first: bool is a subclass of int, so _json_type must test it before "integer"
JSON_TYPES = {
    "boolean": (bool,), "string": (str,), "integer": (int,), "number": (int, float),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def _json_type(value) -> str:
    """The JSON name of a value's type, as the model wrote it ("string", ...)."""
    names = (name for name, types in JSON_TYPES.items() if isinstance(value, types))
    return next(names, type(value).__name__)


def validate_arguments(tool: Tool, arguments: dict) -> str | None:
    """Checks `arguments` against the tool's schema (required, unknown and wrongly typed
    keys): an error message for the model, or None."""
    if not isinstance(arguments, dict):
        return f"tool {tool.name!r}: arguments must be a JSON object, got {_json_type(arguments)}"
    properties = tool.parameters.get("properties", {})
    required = tool.parameters.get("required", [])
    problems = [f"missing required argument {key!r}" for key in required if key not in arguments]
    for key, value in arguments.items():
        if key not in properties:
            problems.append(f"unknown argument {key!r} (expected: {', '.join(properties)})")
            continue
        expected, actual = properties[key].get("type"), _json_type(value)
        integer_as_number = expected == "number" and actual == "integer"
        if expected in JSON_TYPES and actual != expected and not integer_as_number:
            problems.append(f"argument {key!r} must be a {expected}, got {actual}")
    return f"tool {tool.name!r}: " + "; ".join(problems) if problems else None


def run_tool_call(
    call: ToolCall, tools: dict[str, Tool], timeout_s=5.0, max_output_chars=2000
) -> tuple[str, bool]:
    """Executes one parsed call: (observation for the model, ok). ok is False when the call
    failed (parse error, unknown tool, bad arguments, exception, timeout), True for a
    tool's own error answer (the calculator's "division by zero")."""
    return run_tool_calls([call], [tools], timeout_s, max_output_chars)[0]


def run_tool_calls(
    calls: list[ToolCall], tool_sets: list[dict[str, Tool]], timeout_s=5.0,
    max_output_chars=2000,
) -> list[tuple[str, bool]]:
    """run_tool_call on many calls, call i with tool_sets[i] (each episode's own). Valid
    calls to a tool with a batch_function run as one batch, others alone (an exception
    stays its call's), in a worker thread (tool_worker) for at most timeout_s. Python
    cannot kill a thread, so a stuck tool keeps it: tools must bound their own work."""
    results, batches = [None] * len(calls), {}  # batches: id(tool) -> (tool, its call indices)
    for i, (call, tools) in enumerate(zip(calls, tool_sets)):
        if (problem := call_problem(call, tools)) is not None:
            results[i] = f"Error: {problem}", False
        elif tools[call.name].batch_function is not None:
            batches.setdefault(id(tools[call.name]), (tools[call.name], []))[1].append(i)
        else:
            results[i] = run_in_worker(
                tools[call.name], [call.arguments], timeout_s, max_output_chars
            )[0]
    for tool, indices in batches.values():
        arguments = [calls[i].arguments for i in indices]
        outcomes = run_in_worker(tool, arguments, timeout_s, max_output_chars)
        for i, outcome in zip(indices, outcomes):
            results[i] = outcome
    return results


def call_problem(call: ToolCall, tools: dict[str, Tool]) -> str | None:
    """Why this call cannot run, or None."""
    if call.error is not None:
        return call.error
    if call.name not in tools:
        return f"unknown tool {call.name!r}; available tools: {', '.join(sorted(tools))}"
    return validate_arguments(tools[call.name], call.arguments)


def run_in_worker(
    tool: Tool, arguments: list[dict], timeout_s, max_output_chars
) -> list[tuple[str, bool]]:
    """Runs the tool on these calls' arguments (one call, or a batch) in this thread's
    worker: (output, ok) each. An exception or a timeout fails every call of the run."""
    function = tool.batch_function or (lambda calls: [tool.function(**call) for call in calls])
    result, done = {}, threading.Event()
    tool_worker().put((function, arguments, result, done))
    if not done.wait(None if tool.bounded else timeout_s):
        _workers.queue = None  # that thread is stuck: the next call starts a new one
        error = f"Error: tool {tool.name!r} timed out after {timeout_s} s"
        return [(error, False)] * len(arguments)
    if "error" in result:
        error = f"Error: tool {tool.name!r} failed: {result['error']}"[:max_output_chars]
        return [(error, False)] * len(arguments)
    return [(truncate(str(output), max_output_chars), True) for output in result["outputs"]]


def truncate(output: str, max_chars: int) -> str:
    """Cuts a tool's output visibly: the model knows it saw only part."""
    if len(output) <= max_chars:
        return output
    return output[:max_chars] + f"\n... [truncated {len(output) - max_chars} characters]"


_workers = threading.local()  # a worker per calling thread: callers never queue behind others


def tool_worker():
    """The task queue of this thread's tool worker, a daemon thread running a call at a
    time: long-lived, as a thread per call costs more than a synthetic search
    (docs/performance.md)."""
    if getattr(_workers, "queue", None) is None:
        _workers.queue = queue.SimpleQueue()
        threading.Thread(target=serve_tool_calls, args=(_workers.queue,), daemon=True).start()
    return _workers.queue


def serve_tool_calls(tasks):
    while True:
        function, arguments, result, done = tasks.get()
        try:
            outputs = function(arguments)
            assert len(outputs) == len(arguments), (
                f"{len(outputs)} outputs for {len(arguments)} calls"
            )
            result["outputs"] = outputs
        except Exception as error:  # any bug in any tool becomes text, never a crashed batch
            result["error"] = f"{type(error).__name__}: {error}"
        done.set()

# -----------------------------------------------------------------------------
# Calculator: arithmetic by walking Python's ast with an allow-list, never eval/exec

MAX_EXPRESSION_CHARS = 300
MAX_RESULT_BITS = 3400  # about 1000 digits: enough for arithmetic, too few to hang
BINARY_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.Pow: operator.pow,
}
UNARY_OPERATORS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node):
    """Evaluates an arithmetic ast node: only numbers and + - * / ** (...)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # type(): no bool
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPERATORS:
        return UNARY_OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        # The one operator that can explode (9**9**9 has ~370M digits), bounded *before*
        # computing: base**exponent has at least (bits(base) - 1) * exponent bits.
        if isinstance(node.op, ast.Pow) and type(left) is int and type(right) is int and right > 0 \
                and (abs(left).bit_length() - 1) * right > MAX_RESULT_BITS:
            raise ValueError("result too large")
        value = BINARY_OPERATORS[type(node.op)](left, right)
        if type(value) is int and value.bit_length() > MAX_RESULT_BITS:
            raise ValueError("result too large")
        if isinstance(value, complex):  # (-8) ** 0.5 is complex in Python
            raise ValueError("the result is not a real number")
        return value
    raise ValueError(
        f"only numbers, + - * / ** and parentheses are allowed (found {type(node).__name__})"
    )


def calculate(expression: str) -> str:
    """An arithmetic expression's value as text, or an "Error: ..." text; never raises."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"Error: expression too long (at most {MAX_EXPRESSION_CHARS} characters)"
    # Models write math symbols too; ^ means power in math (in Python, XOR).
    for symbol, python in (("×", "*"), ("÷", "/"), ("−", "-"), ("^", "**")):
        expression = expression.replace(symbol, python)
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "Error: division by zero"
    except SyntaxError:
        return "Error: not a valid arithmetic expression"
    except OverflowError:  # float overflow, or an int too large to become a float
        return "Error: result too large"
    except (ValueError, RecursionError, MemoryError) as error:
        return f"Error: {error}"
    if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf
        return "Error: the result is not a finite number"
    # 6/3 -> "2", 0.1+0.2 -> "0.3"
    return str(value) if isinstance(value, int) else format(value, ".12g")


def calculator_tool() -> Tool:
    """The "calculator" tool: {"expression": str} -> the value as text."""
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / ** (or ^) and parentheses, "
        "e.g. (2.5 + 3) * -4.",
        parameters=string_parameters("expression", "The arithmetic expression to evaluate."),
        function=calculate,
    )

# -----------------------------------------------------------------------------
# Search: the model's query -> a retriever (nanoagent/retrieval.py) -> passages as text


def search_tool(passages_or_retriever, top_k: int = 3, max_chars: int = 1500) -> Tool:
    """The "search" tool: {"query": str} -> the top_k passages as "[i] title\\ntext",
    cut to max_chars, from {"title", "text"} passages (BM25 here) or a retriever of
    nanoagent.retrieval (an index or a server)."""
    retriever = passages_or_retriever
    if isinstance(retriever, list):
        retriever = BM25Retriever(retriever)

    def as_text(query, hits):
        if not hits:
            return f"No results for {query!r}."
        text = "\n\n".join(
            f"[{rank}] {hit['title']}\n{hit['text']}" for rank, hit in enumerate(hits, 1)
        )
        return text if len(text) <= max_chars else text[:max_chars] + " ... [truncated]"

    def search_batch(arguments: list[dict]) -> list[str]:
        queries = [call["query"] for call in arguments]
        hits = retriever.retrieve(queries, top_k)
        return [as_text(query, query_hits) for query, query_hits in zip(queries, hits)]

    return Tool(
        name="search",
        description=(
            "Search the knowledge base; returns the most relevant passages with their titles."
        ),
        parameters=string_parameters("query", "What to search for, in a few keywords."),
        function=lambda query: search_batch([{"query": query}])[0], batch_function=search_batch,
    )

# -----------------------------------------------------------------------------
# Python: the model's program, run in the sandbox (nanoagent/sandbox.py says what it stops)


def python_tool(limits: sandbox.Limits = sandbox.Limits(output_bytes=1500)) -> Tool:
    """The "python" tool: {"code": str} -> what the program printed, or why it was
    stopped (its output cap is below run_tool_calls' cut: the sandbox's note is read). A
    crash is the tool's answer, not a bad call."""
    def run_batch(arguments: list[dict]) -> list[str]:
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            return list(pool.map(
                lambda call: sandbox.run_python(call["code"], limits)[0], arguments
            ))

    return Tool(
        name="python",
        description="Run a Python program (standard library only) and return what it printed.",
        parameters=string_parameters("code", "The program; print() what you need to see."),
        function=lambda code: run_batch([{"code": code}])[0], batch_function=run_batch,
        bounded=True,
    )
