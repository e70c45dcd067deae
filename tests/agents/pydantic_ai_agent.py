"""A pydantic-ai agent on an OpenAI chat model pointed at another base URL, as its docs write one.
Its last line is its reward, as train.py --agent reads it."""

import json
import os

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

provider = OpenAIProvider(base_url=os.environ["OPENAI_BASE_URL"], api_key="none")
agent = Agent(OpenAIChatModel("policy", provider=provider), system_prompt="Use the calculator.")


@agent.tool_plain
def calculator(expression: str) -> str:
    """Add two whole numbers written as "a + b"."""
    return str(sum(int(term) for term in expression.split("+")))


answer = agent.run_sync("What is 3 + 4?").output
print(json.dumps({"reward": float("7" in answer), "success": "7" in answer}))
