"""A LangChain agent as its docs write one: ChatOpenAI with a tool bound, streaming, called in a loop
until it answers. Its last line is its reward, as train.py --agent reads it."""

import json
import os

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def calculator(expression: str) -> str:
    """Add two whole numbers written as "a + b"."""
    return str(sum(int(term) for term in expression.split("+")))


model = ChatOpenAI(model="policy", base_url=os.environ["OPENAI_BASE_URL"], api_key="none",
                   max_retries=0, streaming=True, stream_usage=True).bind_tools([calculator])
messages = [SystemMessage("Use the calculator."), HumanMessage("What is 3 + 4?")]
while (reply := model.invoke(messages)).tool_calls:
    messages.append(reply)
    messages += [ToolMessage(calculator.invoke(call["args"]), tool_call_id=call["id"])
                 for call in reply.tool_calls]
print(json.dumps({"reward": float("7" in reply.content), "success": "7" in reply.content}))
