"""
64 agent episodes through the OpenAI-compatible endpoint (serve.py) against rollout() on the same task:
the synthetic multi-hop QA with the warmed-up tiny model that `python train.py` starts RL from, 8 seeds x 8
episodes, at most 4 turns of 32 tokens, temperature 1.

    python bench/bench_serve.py --rounds 2

Five ways to play the same 64 episodes, one after the other in each round:
  rollout         rollout() in lockstep, no HTTP (what train.py does without --agent)
  endpoint        64 threads, each running examples/multihop_agent.py's episode with its own openai client
  streamed        the same with every reply streamed (stream=True) and put back together
  endpoint, one   one such episode alone (so: is 64 at once 64 times slower than one?)
  programs        server.play: 64 processes of examples/multihop_agent.py (what train.py --agent does)
Each line: seconds, sampler calls, mean rows per call.
"""

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
from openai.types.chat import ChatCompletionMessage

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import envs  # noqa: E402
import multihop_agent  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from nanoagent.models import load_model  # noqa: E402
from nanoagent.sampler import TorchSampler  # noqa: E402
from serve import Server  # noqa: E402


class Counting:
    """A sampler that counts its calls and rows."""

    def __init__(self, sampler):
        self.sampler, self.rows = sampler, []

    def generate(self, prompts, *args, **kwargs):
        self.rows.append(len(prompts))
        return self.sampler.generate(prompts, *args, **kwargs)


class Streamed:
    """An openai client whose chat completions are streamed (stream=True) and put back together, as an
    agent that streams reads them: what streaming costs the endpoint and the wire."""

    def __init__(self, client):
        self.client, self.chat, self.completions = client, self, self

    def create(self, **request):
        content, calls = "", []
        for chunk in self.client.chat.completions.create(**request, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += [call.model_dump() for call in delta.tool_calls or []]  # each whole in one delta
        message = ChatCompletionMessage.model_validate(
            {"role": "assistant", "content": content or None, "tool_calls": calls or None})
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def timed(name, sampler, play):
    sampler.rows.clear()
    start = time.perf_counter()
    play()
    seconds = time.perf_counter() - start
    print(f"{name:16s} {seconds:7.2f} s  {len(sampler.rows):4d} sampler calls  "
          f"{statistics.fmean(sampler.rows or [0]):5.1f} rows per call")
    return seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group_size", type=int, default=8)
    options = parser.parse_args()
    args = train.get_args([])
    model, tokenizer = load_model(train.starting_weights(args))  # the cached warm-up of `python train.py`
    sampler = Counting(TorchSampler(model))
    server = Server(sampler, tokenizer, args.max_new_tokens, args.max_total_tokens, args.temperature)
    seeds = list(range(options.prompts))
    episodes = [seed for seed in seeds for _ in range(options.group_size)]

    def agents(seeds_played, streamed=False):
        def one(seed):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            return multihop_agent.play(Streamed(client) if streamed else client, seed)
        with ThreadPoolExecutor(len(seeds_played)) as pool:
            list(pool.map(one, seeds_played))
        server.conversations.clear()

    results = {}
    for _ in range(options.rounds):
        for name, play in [
            ("rollout", lambda: rollout.rollout(sampler, tokenizer, lambda: envs.SyntheticQAEnv(max_turns=4), seeds,
                                                options.group_size, 4, args.max_new_tokens, args.max_total_tokens)),
            ("endpoint", lambda: agents(episodes)),
            ("streamed", lambda: agents(episodes, streamed=True)),
            ("endpoint, one", lambda: agents(episodes[:1])),
            ("programs", lambda: server.play(f"{sys.executable} {ROOT / 'examples' / 'multihop_agent.py'}", seeds,
                                             options.group_size, timeout_s=600))]:
            results.setdefault(name, []).append(timed(name, sampler, play))
    print("median seconds: " + ", ".join(f"{name} {statistics.median(times):.2f}" for name, times in results.items()))
    server.close()


if __name__ == "__main__":
    main()
