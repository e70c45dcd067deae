"""examples/multihop_agent.py written with LangChain, as its docs write a tool loop: ChatOpenAI with
the search tool bound (OpenAI's own schema, so the prompt is the example's), invoked until it
answers. train.py --agent trains it (docs/results.md, "A LangChain agent through the endpoint"):

    python train.py --agent "AGENTS_PYTHON tests/agents/langchain_multihop.py"

Its last line is its reward, as train.py --agent reads it."""

import json
import os
import re
import sys
from pathlib import Path

import openai
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from multihop_agent import HINT, MAX_TOKENS_PER_REPLY, MAX_TURNS, SEARCH, SYSTEM  # noqa: E402
from multihop_agent import new_task, normalize, search  # noqa: E402

question, answer, facts = new_task(int(os.environ.get("NANOAGENT_TASK_SEED", "10000000")))
model = ChatOpenAI(model="policy", base_url=os.environ["OPENAI_BASE_URL"], api_key="none",
                   max_retries=0, max_tokens=MAX_TOKENS_PER_REPLY).bind_tools([SEARCH])
messages, given = [SystemMessage(SYSTEM), HumanMessage(question)], None
for _ in range(MAX_TURNS):
    try:
        reply = model.invoke(messages)
    except openai.BadRequestError:  # the conversation outgrew the model's context: no answer
        break
    messages.append(reply)
    found = re.search(r"<answer>(.*?)</answer>", reply.content or "", re.DOTALL)
    if found:
        given = found[1].strip()
        break
    messages += [ToolMessage(search(call["args"].get("query", ""), facts), tool_call_id=call["id"])
                 for call in reply.tool_calls]
    if not reply.tool_calls:
        messages.append(HumanMessage(HINT))
success = given is not None and normalize(given) == normalize(answer)
print(json.dumps({"reward": float(success), "success": success, "answer": given}))
