"""
An agent written the way agents are written: a loop over the official `openai`
client's chat completions with one tool, knowing nothing of nanoagent. Point it at any
OpenAI-compatible server, or let train.py train it through nanoagent's endpoint
(serve.py), running it once per episode:

    python train.py --agent "python examples/multihop_agent.py"   # learns on CPU (docs/results.md)
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none \
        python examples/multihop_agent.py

The task is nanoagent's synthetic multi-hop QA, rebuilt from its rules (with two hops
envs.SyntheticQAEnv draws the same question and facts from a seed: the two compare,
and train.py's warm-up applies): made-up films, people, cities and countries, and a
question needing a search per hop ("Where was the director of Amber born?": search
Amber, then its director). The environment gives the seed ($NANOAGENT_TASK_SEED); the
last line printed is the reward, {"reward": 1.0, "success": true} when right, with each
turn's reward (the env's -0.1 for a reply with neither a call nor an answer, the outcome
on the last) and state: what the agent knew, the question and its searches' results
(serve.py).
"""

import json
import os
import random
import re
import string

import openai

NAMES = (
    "Amber Aspen Birch Cedar Coral Daisy Delta Ember Fable Fern Flint Frost Gale Grove "
    "Hazel Heron Iris Ivory Jade Juniper Kestrel Lark Laurel Lotus Maple Marsh Meadow Mint "
    "Moss Nova Oak Olive Onyx Opal Orchid Pearl Pebble Pine Plum Quartz Raven Reed Ridge "
    "Robin Rose Ruby Rust Sage Slate Sparrow Spruce Thorn Tide Topaz Vale Willow Wren "
    "Zephyr Aurora Basil Clover Dune Echo Finch Garnet Harbor Indigo Jasper Lilac Linden "
    "Lumen Misty Nectar Orion Poppy Quill Rowan Saffron Sierra Tansy Umber Velvet Wisp "
    "Yarrow Zinnia Acorn Bramble Cinder Dawn Comet Fjord Glade Moor Tundra"
).split()
KINDS = ["film", "person", "city", "country"]  # each kind points to the next by one relation
RELATIONS = ["directed by", "born in", "located in"]
# two hops from a film, from a person
QUESTIONS = ["Where was the director of {} born?", "In which country was {} born?"]
SYSTEM = (
    "Answer the question. Call search with a name to get its facts, "
    "then answer as <answer>name</answer>."
)
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Look up a name; returns the facts about it.",
    "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "description": "A name."}},
        "required": ["query"],
    },
}}
HINT = (
    'Invalid reply: call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
    'or give the final answer as <answer>...</answer>.'
)
MAX_TURNS, MAX_TOKENS_PER_REPLY, FORMAT_PENALTY = 4, 32, -0.1


def new_task(seed, per_kind=3):
    """(question, answer, facts as (subject, relation, object)): a fresh KB per seed."""
    rng = random.Random(seed)
    chosen = rng.sample(NAMES, len(KINDS) * per_kind)
    entities = {kind: chosen[i::len(KINDS)] for i, kind in enumerate(KINDS)}
    facts, next_entity = [], {}
    for i, relation in enumerate(RELATIONS):  # every film, person and city gets one fact
        for subject in entities[KINDS[i]]:
            next_entity[subject] = rng.choice(entities[KINDS[i + 1]])
            facts.append((subject, relation, next_entity[subject]))
    rng.shuffle(facts)
    start = rng.randrange(2)  # a film or a person
    entity = rng.choice(entities[KINDS[start]])
    return QUESTIONS[start].format(entity), next_entity[next_entity[entity]], facts


def search(query, facts):
    """The tool: every fact about the name asked for (case and punctuation aside)."""
    key = str(query).strip().strip(string.punctuation + " ").lower()
    found = [
        f"{subject}: {relation} {obj}." for subject, relation, obj in facts
        if subject.lower() == key
    ]
    return " ".join(found) if found else f"No facts about {str(query).strip()}."


def normalize(text):
    """Lowercase, no punctuation, no articles: "The Maple." is "maple"."""
    text = "".join(char for char in text.lower() if char not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def play(client, seed):
    """One episode: the agent's final answer (None if it gave none), the right one, and
    each turn's reward (the outcome aside) and state."""
    question, answer, facts = new_task(seed)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    turn_rewards, states, found = [], [], set()  # found: what its searches returned
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(
                model=os.environ.get("OPENAI_MODEL", "policy"), messages=messages,
                tools=[SEARCH], max_tokens=MAX_TOKENS_PER_REPLY,
            ).choices[0].message
        except openai.BadRequestError:  # the conversation outgrew the model's context: no answer
            break
        turn_rewards.append(0.0)
        states.append([question, sorted(found)])
        messages.append(reply)  # as it came: the server recognises its own turn next request
        given = re.search(r"<answer>(.*?)</answer>", reply.content or "", re.DOTALL)
        if given:
            return given[1].strip(), answer, turn_rewards, states
        for call in reply.tool_calls or []:
            try:
                query = json.loads(call.function.arguments).get("query", "")
            except (ValueError, AttributeError):
                query = ""
            observation = search(query, facts)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
            found.add(observation)
        if not reply.tool_calls:
            messages.append({"role": "user", "content": HINT})
            turn_rewards[-1] = FORMAT_PENALTY
    return None, answer, turn_rewards, states


if __name__ == "__main__":
    seed = int(os.environ.get("NANOAGENT_TASK_SEED", "10000000"))
    given, answer, turn_rewards, states = play(openai.OpenAI(), seed)
    success = given is not None and normalize(given) == normalize(answer)
    if turn_rewards:
        turn_rewards[-1] += float(success)
    print(json.dumps({"reward": float(success), "success": success, "answer": given,
                      "turn_rewards": turn_rewards, "states": states}))
