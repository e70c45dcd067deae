"""An OpenAI Agents SDK agent on its chat completions model (OpenAIChatCompletionsModel), as its docs
write one for other providers. Its last line is its reward, as train.py --agent reads it."""

import json
import os

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


@function_tool
def calculator(expression: str) -> str:
    """Add two whole numbers written as "a + b"."""
    return str(sum(int(term) for term in expression.split("+")))


set_tracing_disabled(True)  # traces would go to OpenAI's servers
client = AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="none", max_retries=0)
agent = Agent(name="calculator agent", instructions="Use the calculator.", tools=[calculator],
              model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
answer = Runner.run_sync(agent, "What is 3 + 4?").final_output
print(json.dumps({"reward": float("7" in answer), "success": "7" in answer}))
