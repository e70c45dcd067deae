"""A smolagents ToolCallingAgent on OpenAIServerModel, as its docs write one: it asks for a tool call
at every step (tool_choice "required") and answers through its final_answer tool. Its last line is
its reward, as train.py --agent reads it."""

import json
import os

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def calculator(expression: str) -> str:
    """Add two whole numbers.

    Args:
        expression: the sum, written as "a + b".
    """
    return str(sum(int(term) for term in expression.split("+")))


model = OpenAIServerModel(model_id="policy", api_base=os.environ["OPENAI_BASE_URL"], api_key="none")
agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=3, verbosity_level=0)
answer = str(agent.run("What is 3 + 4?"))
print(json.dumps({"reward": float("7" in answer), "success": "7" in answer}))
