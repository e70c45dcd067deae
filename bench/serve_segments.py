"""
How many segments (serve.py's docstring: a history the agent wrote back other than as the endpoint
sent it starts a new trajectory) an episode makes, per agent framework: the programs of
tests/agents/ and examples/multihop_agent.py, each played through Server.play as train.py --agent
plays them, with a scripted policy of three turns: text and a tool call, a tool call, the answer.

    python bench/serve_segments.py --agents_python PYTHON_WITH_THE_FRAMEWORKS --episodes 8

Each line: the program, episodes, turns, segments, segments an episode, and whether every segment
carries its episode's reward on its last agent token (what GRPO, PPO and REINFORCE++ credit from).
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from nanoagent.models import tiny_tokenizer  # noqa: E402
from nanoagent.sampler import Generation  # noqa: E402
from serve import Server  # noqa: E402

AGENTS = ["langchain_agent", "pydantic_ai_agent", "openai_agents_chat", "openai_agents_responses",
          "openai_agents_responses --chained", "smolagents_agent"]
OPENING = "<tool_call>\n"  # what tool_choice "required" forces (smolagents asks for it)


def call(name, arguments):
    return f'{OPENING}{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class Scripted:
    """The policy: by the assistant turns a prompt holds, text and a call, a call, then the answer;
    the call and the answer are those the prompt's tools ask for."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def reply(self, prompt):
        turn = prompt.count("<|im_start|>assistant") - 1
        search = call("search", '{"query": "Amber"}')
        tool_call = search if '"search"' in prompt else call("calculator", '{"expression": "3 + 4"}')
        if turn < 2:
            return "I will look it up.\n" * (turn == 0) + tool_call
        if '"final_answer"' in prompt:  # smolagents answers through a tool
            return call("final_answer", '{"answer": "7"}')
        return "<answer>Amber</answer>" if '"search"' in prompt else "The answer is 7."

    def generate(self, prompts, max_new_tokens, **options):
        generations = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            reply = self.reply(text)
            if text.endswith(OPENING):  # the forced opening is the prompt's: continue it
                reply = reply[reply.index(OPENING) + len(OPENING):]
            token_ids = self.tokenizer.encode(reply, add_special_tokens=False)
            token_ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
            generations.append(Generation(token_ids, [-0.5] * len(token_ids), "stop"))
        return generations


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents_python", required=True, help="a Python with the frameworks")
    parser.add_argument("--episodes", type=int, default=8)
    options = parser.parse_args()
    tokenizer = tiny_tokenizer()
    server = Server(Scripted(tokenizer), tokenizer, max_new_tokens=100, max_total_tokens=100_000)
    programs = [f"{options.agents_python} {ROOT / 'tests' / 'agents' / name}.py {' '.join(flags)}"
                for name, *flags in map(str.split, AGENTS)]
    programs.append(f"{sys.executable} {ROOT / 'examples' / 'multihop_agent.py'}")
    for program in programs:
        trajectories = server.play(program, list(range(options.episodes)), 1, timeout_s=600)
        turns = sum(t.num_turns for t in trajectories)
        assert {t.seed for t in trajectories} == set(range(options.episodes)), "an episode failed"
        credited = all(t.turn_rewards[-1] == t.score and t.action_mask[t.turn_end_positions[-1]]
                       for t in trajectories)
        name = program.split("/")[-1].replace(".py", "")
        print(f"{name:40s} {options.episodes} episodes  {turns:3d} turns  {len(trajectories):3d} segments  "
              f"{len(trajectories) / options.episodes:.2f} an episode  reward on every segment: {credited}")
    server.close()


if __name__ == "__main__":
    main()
