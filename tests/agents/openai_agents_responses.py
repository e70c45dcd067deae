"""An OpenAI Agents SDK agent as its docs write one: an Agent with a model name, on the SDK's
default model (the Responses API) and a default client. Its last line is its reward, as
train.py --agent reads it. --streamed runs it as chat UIs do (Runner.run_streamed); --chained
continues each request by previous_response_id instead of sending the whole history again."""

import asyncio
import json
import os
import sys

from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI


@function_tool
def calculator(expression: str) -> str:
    """Add two whole numbers written as "a + b"."""
    return str(sum(int(term) for term in expression.split("+")))


async def main():
    if "--streamed" in sys.argv:
        result = Runner.run_streamed(agent, "What is 3 + 4?")
        async for _ in result.stream_events():
            pass
        return result.final_output
    chained = "--chained" in sys.argv
    result = await Runner.run(agent, "What is 3 + 4?", auto_previous_response_id=chained)
    return result.final_output


set_tracing_disabled(True)  # traces would go to OpenAI's servers
set_default_openai_client(AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="none",
                                      max_retries=0))
agent = Agent(name="calculator agent", instructions="Use the calculator.", tools=[calculator],
              model="policy")
answer = asyncio.run(main())
print(json.dumps({"reward": float("7" in answer), "success": "7" in answer}))
