"""
Environments: what an agent's turn *means*.

Agent-R1 splits an agent task in two: a Tool (tools.py) executes one action; a
**ToolEnv** (here) takes the model's whole turn, runs the tools it called, decides what
that means for the task (the state transition), computes the reward and writes the next
observation. RAGEN adds text games, where the action is a move. An environment is a
plain class, one instance per episode, driven by rollout.py:

    env = SyntheticQAEnv(max_turns=4)
    messages, tool_schemas = env.reset(seed)  # system + user messages, tool schemas
    while True:
        text = policy(messages, tool_schemas)  # the assistant turn: agent tokens, mask 1
        result = env.step(text)  # observations (env tokens, mask 0), reward, done, info
        messages += [{"role": "assistant", "content": text}, *result.observations]
        if result.done:
            break

Rewards. An episode's score is the sum of its step rewards, each term a constructor
argument:
  - outcome: on the final step, `outcome_reward` times exact match (QA), or the game's;
  - format penalty (RAGEN): `format_penalty` = -0.1 for a turn with neither a valid
    action nor a valid answer; its observation says what was expected, or with
    `end_on_format_error=True` the episode ends (Search-R1, TRL's tool loop);
  - format reward (Agent-R1's partial credit): `format_reward` per well-formed turn;
  - process reward (Agent-R1's intermediate rewards): `process_reward` per successful
    call that made progress, e.g. retrieved a passage the answer needs, unseen yet;
  - reasoning-aware format (RAGEN): `require_think=True` wants <think>...</think> first.

Demonstrations. An env that sft.py warms up on has `demonstration(mistake_rate, rng)`: the
assistant turns of this episode (after reset), read in order, each after the env stepped on
the one before. A tool env's are fixed at reset (a list); a game's next moves depend on
where the last ones landed, so it plans as it is read (a generator, endless: the game ends
the episode).

Seeds. Everything is deterministic given the seed. Procedural envs train on seeds below
EVAL_SEED_START and evaluate on `eval_seeds(n)`; the dataset envs split their rows instead.
"""
import contextlib
import hashlib
import io
import json
import random
import re
import string
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partialmethod
from pathlib import Path

import tools
from nanoagent import retrieval
from nanoagent.common import UserError
from nanoagent.models import TINY_NAMES

EVAL_SEED_START = 10_000_000


def eval_seeds(n: int, env: str = "") -> range:
    """The held-out seeds that training and eval.py play: from EVAL_SEED_START, or, for
    an env of DATA_ENVS, rows 0 to n - 1 of its held-out split."""
    start = 0 if ENVS.get(env) in DATA_ENVS else EVAL_SEED_START
    return range(start, start + n)


@dataclass
class StepResult:
    observations: list[dict]  # messages after the assistant turn: role "tool" or "user"
    reward: float
    done: bool
    info: dict  # success, tool_calls, invalid_calls, format_error; QA: answer, em, f1, calls

# -----------------------------------------------------------------------------
# Scoring answers: SQuAD-style exact match and token F1


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD's rule)."""
    text = "".join(char for char in text.lower() if char not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: list[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer."""
    prediction = normalize_answer(prediction)
    return float(any(prediction == normalize_answer(answer) for answer in answers))


def f1_score(prediction: str, answers: list[str]) -> float:
    """Best bag-of-words F1 between the prediction and any gold answer."""
    best, predicted = 0.0, normalize_answer(prediction).split()
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best

# -----------------------------------------------------------------------------
# The format of a turn: optional <think>...</think>, then tool calls or <answer>...</answer>

THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_INSTRUCTION = " Begin every reply with your reasoning in <think>...</think>."
FORMAT_HINT = (
    'Invalid reply: call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
    'or give the final answer as <answer>...</answer>.'
)


def split_thinking(text: str) -> tuple[bool, str]:
    """(does the turn open with a closed <think> block, the turn without think blocks):
    an <answer> or a tool call *mentioned* in thought is no action."""
    thought_first = re.match(r"\s*<think>.*?</think>", text, re.DOTALL) is not None
    return thought_first, THINK_BLOCK.sub("", text)


def extract_answer(text: str) -> str | None:
    """The stripped content of the first <answer>...</answer>, or None."""
    match = ANSWER_BLOCK.search(text)
    return match.group(1).strip() if match else None


def format_tool_call(name: str, arguments: dict) -> str:
    """A tool call as the model writes it (Hermes/Qwen2.5 format); used for demonstrations."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

# -----------------------------------------------------------------------------
# ToolEnv: Agent-R1's orchestrator, shared by every tool-using task


class ToolEnv:
    """The tool-turn loop. A subclass sets `system_prompt` and implements `new_task(rng)`;
    it may override `score(answer)` and `is_useful(call, output)`. A step is a turn:
      - an <answer> ends the episode with the outcome reward (its turn's calls ignored);
      - else its tool calls run, each result a {"role": "tool"} message; a turn whose
        calls all failed is a format error (the errors say why);
      - a turn with neither gets `format_penalty` and a {"role": "user"} format hint.
    The episode also ends after `max_turns` turns, with no outcome reward."""
    system_prompt = "Answer the question. Give the final answer as <answer>...</answer>."
    warmup_options = {}  # an easier version, for the warm-up's first phase (sft.py)
    train_defaults = {}  # train.py flags this task needs beyond DEFAULTS (users' win)

    def __init__(
        self, max_turns=4, outcome_reward=1.0, format_penalty=-0.1, format_reward=0.0,
        process_reward=0.0, require_think=False, max_calls_per_turn=2, end_on_format_error=False,
    ):
        assert max_turns >= 1, f"max_turns must be at least 1, got {max_turns}"
        self.end_on_format_error = end_on_format_error
        self.max_turns, self.outcome_reward = max_turns, outcome_reward
        self.format_penalty, self.format_reward = format_penalty, format_reward
        self.process_reward = process_reward
        self.require_think, self.max_calls_per_turn = require_think, max_calls_per_turn

    def new_task(self, rng: random.Random) -> tuple[str, list[str], list[tools.Tool]]:
        """One task drawn from `rng`: (question, gold answers, tools the model may call)."""
        raise NotImplementedError

    def score(self, answer: str) -> dict:
        """Scores a final answer against self.answers; "em" decides success and reward."""
        return {
            "em": exact_match(answer, self.answers), "f1": f1_score(answer, self.answers)
        }

    def is_useful(self, call: tools.ToolCall, output: str) -> bool:
        """Does this successful, new call earn the process reward? By default, yes."""
        return True

    def reset(self, seed: int, member: int = 0) -> tuple[list[dict], list[dict]]:
        """(opening messages, tool schemas) for `seed`; tools have no luck: `member` (the
        episode's place in its group) unused."""
        self.seed = seed
        self.question, self.answers, tool_list = self.new_task(random.Random(seed))
        self.tools = {tool.name: tool for tool in tool_list}
        self.turn, self.done, self.calls_made = 0, False, set()
        system = self.system_prompt + (THINK_INSTRUCTION if self.require_think else "")
        messages = [
            {"role": "system", "content": system}, {"role": "user", "content": self.question}
        ]
        return messages, [tool.schema() for tool in tool_list]

    def step(self, assistant_text: str) -> StepResult:
        """Runs one assistant turn: transition, reward, observations."""
        return step_envs([self], [assistant_text])[0]

    def read_turn(self, assistant_text: str) -> list[tools.ToolCall]:
        """A step's first half: reads the turn, returns the tool calls to run (maybe none)."""
        assert not self.done, "the episode is over; call reset() for a new one"
        self.turn += 1
        thought_first, action_text = split_thinking(assistant_text)
        self.well_formed = thought_first or not self.require_think
        self.answer = extract_answer(action_text) if self.well_formed else None
        self.calls = (  # counted, not run, in a turn that answers
            tools.parse_tool_calls(action_text, self.tools, self.max_calls_per_turn)
            if self.well_formed else []
        )
        return self.calls if self.answer is None else []

    def finish_turn(self, results: list[tuple[str, bool]]) -> StepResult:
        """The second half: (output, ok) of each call read_turn returned -> StepResult."""
        info = {
            "success": False, "tool_calls": len(self.calls), "invalid_calls": 0,
            "format_error": False, "answer": self.answer, "em": 0.0, "f1": 0.0,
            "calls": [asdict(call) for call in self.calls],  # as parsed, errors too (report)
        }
        observations = []
        if self.answer is not None:
            info.update(self.score(self.answer))
            info["success"] = info["em"] == 1.0
            reward, self.done = self.outcome_reward * info["em"] + self.format_reward, True
        elif self.calls:
            useful_calls = 0
            for call, (output, ok) in zip(self.calls, results):
                observations.append({"role": "tool", "content": output})
                key = json.dumps([call.name, call.arguments], sort_keys=True)
                useful_calls += ok and key not in self.calls_made and self.is_useful(call, output)
                info["invalid_calls"] += not ok
                if ok:
                    self.calls_made.add(key)
            info["format_error"] = info["invalid_calls"] == len(self.calls)
            reward = self.format_penalty if info["format_error"] else self.format_reward
            reward += self.process_reward * useful_calls
        else:
            info["format_error"], reward = True, self.format_penalty
            hint = FORMAT_HINT + (THINK_INSTRUCTION if not self.well_formed else "")
            observations.append({"role": "user", "content": hint})
        ends_on_error = self.end_on_format_error and info["format_error"]
        self.done = self.done or self.turn >= self.max_turns or ends_on_error
        return StepResult(observations, reward, self.done, info)


def step_envs(envs: list, texts: list[str]) -> list[StepResult]:
    """One turn of many episodes, env i reading texts[i]: env.step of each, the tool calls
    of every ToolEnv run in one tools.run_tool_calls."""
    calls = [
        env.read_turn(text) if isinstance(env, ToolEnv) else [] for env, text in zip(envs, texts)
    ]
    outcomes = iter(tools.run_tool_calls(
        [call for env_calls in calls for call in env_calls],
        [env.tools for env, env_calls in zip(envs, calls) for _ in env_calls],
    ))
    return [
        env.finish_turn([next(outcomes) for _ in env_calls])
        if isinstance(env, ToolEnv) else env.step(text)
        for env, text, env_calls in zip(envs, texts, calls)
    ]

# -----------------------------------------------------------------------------
# Search QA (Agent-R1's task): HotpotQA, 2WikiMultihopQA, MuSiQue


HUB_DATASETS = {  # (Hub name, config, held-out split): GSM8K has train and test only
    "hotpotqa": ("hotpotqa/hotpot_qa", "distractor", "validation"),
    "2wikimultihopqa": ("framolfese/2WikiMultihopQA", None, "validation"),
    "musique": ("dgslibisey/MuSiQue", None, "validation"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
}


def normalize_qa_row(row: dict) -> dict:
    """A HotpotQA / 2WikiMultihopQA / MuSiQue row -> {"id", "question", "answers",
    "paragraphs": [{"title", "text"}], "supporting_titles"}. MuSiQue has "paragraphs";
    the others "context", HF's {"title": [...], "sentences"/"content": [[...]]} or
    JSON's [[title, [sentences]]]."""
    if "paragraphs" in row:
        paragraphs = [{"title": p["title"], "text": p["paragraph_text"]} for p in row["paragraphs"]]
        supporting = [p["title"] for p in row["paragraphs"] if p.get("is_supporting")]
        answers = [row["answer"], *(row.get("answer_aliases") or [])]
    else:
        context, facts = row["context"], row.get("supporting_facts") or []
        if isinstance(context, dict):
            context = zip(context["title"], context.get("sentences", context.get("content")))
        paragraphs = [
            {"title": title, "text": " ".join(s.strip() for s in sentences)}
            for title, sentences in context
        ]
        supporting = facts["title"] if isinstance(facts, dict) else [title for title, _ in facts]
        answers = [row["answer"]]
    return {
        "id": str(row.get("id", row.get("_id", ""))), "question": row["question"],
        "answers": answers, "paragraphs": paragraphs,
        "supporting_titles": list(dict.fromkeys(supporting)),
    }


HELD_OUT_SHARE = 0.1


def held_out(row_id: str) -> float:
    """A number in [0, 1) fixed by the row's id: the split ignores the file's order."""
    digest = hashlib.blake2b(row_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2 ** 64


def local_split(rows: list[dict], split: str) -> list[dict]:
    """The `split` of a local file's rows: "held-out" is the HELD_OUT_SHARE of them (at
    least one) with the lowest held_out(id), "train" the rest, "all" every row (eval.py)."""
    if split not in ("train", "held-out", "all"):
        raise UserError(
            "a local data file has the splits train, held-out (a share of its rows) and "
            f"all, not {split!r}"
        )
    if split == "all":
        return rows
    if len(rows) < 2:
        raise UserError(
            "a local data file needs at least 2 rows to hold one out for evaluation, "
            f"it has {len(rows)}"
        )
    ids = [row["id"] or row["question"] for row in rows]
    if len(set(ids)) < len(ids):  # repeated ids: the position decides
        ids = [f"{index}/{row_id}" for index, row_id in enumerate(ids)]
    order = sorted(range(len(rows)), key=lambda index: held_out(ids[index]))
    held = set(order[:max(1, round(HELD_OUT_SHARE * len(rows)))])
    return [row for index, row in enumerate(rows) if (index in held) == (split == "held-out")]


def read_rows(source: str, split: str) -> tuple[object, bool]:
    """(raw rows, whether local): all of a local .json/.jsonl/.parquet file's rows (the
    caller applies local_split), or `split` of a Hub dataset (HUB_DATASETS: short names) or
    a local dataset directory. Their "held-out" (no real split can bear the name) is their
    own: HUB_DATASETS's, else validation, or test where there is none."""
    import datasets  # here: slow to import, and only dataset envs need it
    suffix = Path(source).suffix
    if suffix not in (".json", ".jsonl", ".parquet"):
        name, config, held = HUB_DATASETS.get(source.lower(), (source, None, None))
        if split == "held-out" and held is None:
            splits = datasets.get_dataset_split_names(name, config)
            held = "validation" if "validation" in splits else "test"
        split = held if split == "held-out" else split
        return datasets.load_dataset(name, config, split=split), False
    if not Path(source).exists():
        raise UserError(f"data file {source} does not exist")
    builder = "parquet" if suffix == ".parquet" else "json"
    return datasets.load_dataset(builder, data_files=str(source), split="train"), True


def load_qa_dataset(source: str, split: str = "train", limit: int | None = None) -> list[dict]:
    """Normalised rows of `split`, from a local file (local_split) or the Hub."""
    rows, local = read_rows(source, split)
    normalized = []
    for index, row in enumerate(rows):
        where = f"{source}: row {index} (id {row.get('id', row.get('_id'))!r})"
        # A file's rows share one schema: a field a row lacks reads None, so check values.
        missing = [field for field in ("question", "answer") if not row.get(field)]
        if missing or not (row.get("context") or row.get("paragraphs")):
            field = (missing or ["context (or paragraphs)"])[0]
            raise UserError(
                f"{where} has no {field!r} field; rows need HotpotQA, 2WikiMultihopQA or "
                "MuSiQue fields"
            )
        try:
            normalized.append(normalize_qa_row(row))
        except (KeyError, TypeError, ValueError) as error:
            raise UserError(
                f"{where} does not parse as a QA example: {type(error).__name__} {error}"
            ) from error
    rows = local_split(normalized, split) if local else normalized
    return rows[:limit] if limit is not None else rows


@lru_cache(maxsize=16)
def cached_dataset(load, source, split: str) -> list[dict]:
    """load(source, split), once per process (envs are built once per episode)."""
    return load(str(source), split)


@lru_cache(maxsize=4)
def cached_search_tool(retriever: str, top_k: int) -> tools.Tool:
    """One search tool per retriever spec and process: episodes share it (and batches)."""
    return tools.search_tool(retrieval.open_retriever(retriever), top_k=top_k)


class SearchQAEnv(ToolEnv):
    """Multi-hop QA with a `search` tool over `data`, normalised rows or a source for
    load_qa_dataset. A question searches its own paragraphs (HotpotQA's distractor
    setting: 2 gold among 8 distractors), or a corpus: `retriever` (an index directory
    from nanoagent/retrieval.py, or http://host:port/retrieve) or `search` (a
    tools.search_tool). The process reward goes to finding a new supporting paragraph."""
    system_prompt = (
        "Answer the question. Use the search tool as often as you need, then give a short "
        "final answer as <answer>...</answer>."
    )

    def __init__(
        self, data, split="train", search: tools.Tool | None = None,
        retriever: str | None = None, top_k=3, **options,
    ):
        assert search is None or retriever is None, "pass search or retriever, not both"
        if isinstance(data, (str, Path)):
            data = cached_dataset(load_qa_dataset, data, split)
        self.rows = data
        assert len(self.rows) > 0, "SearchQAEnv needs at least one row"
        self.search = cached_search_tool(retriever, top_k) if retriever is not None else search
        self.top_k = top_k
        super().__init__(**options)

    def new_task(self, rng):
        self.row = self.rows[self.seed % len(self.rows)]  # seed i is row i: evals visit all
        self.found_titles = set()
        search = self.search or tools.search_tool(self.row["paragraphs"], top_k=self.top_k)
        return self.row["question"], self.row["answers"], [search]

    def is_useful(self, call, output):
        # tools.search_tool writes each hit as "[rank] title\ntext"
        titles = {t for t in self.row["supporting_titles"] if f"] {t}\n" in output}
        new_titles = titles - self.found_titles
        self.found_titles |= new_titles
        return bool(new_titles)

# -----------------------------------------------------------------------------
# Synthetic multi-hop QA: the offline task a tiny model learns on a CPU

# Entity names, one token each for the tiny model (its last six are the bandit's arms):
# copying a name is one step.
NAMES = TINY_NAMES[:-6]
# Each type points to the next by one relation: film -> person -> city -> country.
ENTITY_TYPES = ["film", "person", "city", "country"]
RELATIONS = ["directed by", "born in", "located in"]
QUESTIONS = {  # (type of the start entity, hops) -> question
    (0, 1): "Who directed {}?",
    (0, 2): "Where was the director of {} born?",
    (0, 3): "In which country was the director of {} born?",
    (1, 1): "Where was {} born?",
    (1, 2): "In which country was {} born?",
    (2, 1): "In which country is {}?",
}
DISTRACTORS = {
    "film": ("set in", "city"), "person": ("friend of", "person"), "city": ("twinned with", "city"),
}


class SyntheticQAEnv(ToolEnv):
    """k-hop questions over a knowledge base of made-up entities drawn fresh per seed, so
    only searching finds the answer. A KB with 2 entities per type looks like:

        Amber: directed by Heron.   Heron: born in Maple.   Maple: located in Onyx.   (...)

    "Where was the director of Amber born?" needs search("Amber") -> Heron, then
    search("Heron") -> Maple. Single-word names and fixed phrasings let a tiny model
    learn it. Knobs: `hops` (1-3), `entities_per_type`, `distractor_facts` (facts with
    other relations, "Amber: set in Maple.", a lookup returns beside the needed one).
    The process reward goes to a search that reveals the next hop's fact."""
    system_prompt = (
        "Answer the question. Call search with a name to get its facts, "
        "then answer as <answer>name</answer>."
    )
    warmup_options = {"hops": 1}  # copying is learned far sooner than with two hops
    # Demonstrations wrong at 0.4: train.py's 0.6 left too little success to start from,
    # and too many seeds never took off (docs/results.md, "The main job over seeds"); a
    # 2-hop demonstration is then right with chance 0.6^3 = 22%.
    train_defaults = {"warmup_mistake_rate": 0.4}

    def __init__(self, hops=2, entities_per_type=3, distractor_facts=0, **options):
        assert 1 <= hops <= 3, f"hops must be 1, 2 or 3, got {hops}"
        assert entities_per_type >= 2, (
            "need at least 2 entities per type, or the question gives its answer away"
        )
        self.hops, self.entities_per_type = hops, entities_per_type
        self.distractor_facts = distractor_facts
        super().__init__(**options)

    def new_task(self, rng):
        chosen = rng.sample(NAMES, len(ENTITY_TYPES) * self.entities_per_type)
        entities = {kind: chosen[i::len(ENTITY_TYPES)] for i, kind in enumerate(ENTITY_TYPES)}
        self.kind_of = {entity: group for group in entities.values() for entity in group}
        self.facts, self.next_entity = [], {}
        for i, relation in enumerate(RELATIONS):  # every film, person and city: one chain fact
            for subject in entities[ENTITY_TYPES[i]]:
                self.next_entity[subject] = rng.choice(entities[ENTITY_TYPES[i + 1]])
                self.facts.append((subject, relation, self.next_entity[subject]))
        for _ in range(self.distractor_facts):
            kind = rng.choice(list(DISTRACTORS))
            relation, object_kind = DISTRACTORS[kind]
            subject = rng.choice(entities[kind])
            objects = [e for e in entities[object_kind] if e != subject]
            self.facts.append((subject, relation, rng.choice(objects)))
        rng.shuffle(self.facts)  # a lookup's order must not give the chain away
        start_type = rng.randrange(len(RELATIONS) - self.hops + 1)
        self.hop_entities = [rng.choice(entities[ENTITY_TYPES[start_type]])]  # searched per hop
        for _ in range(self.hops - 1):
            self.hop_entities.append(self.next_entity[self.hop_entities[-1]])
        answer = self.next_entity[self.hop_entities[-1]]
        self.chain_facts = [
            fact_text(entity, RELATIONS[start_type + hop], self.next_entity[entity])
            for hop, entity in enumerate(self.hop_entities)
        ]
        self.found_facts = set()
        question = QUESTIONS[start_type, self.hops].format(self.hop_entities[0])
        return question, [answer], [lookup_tool(self.facts)]

    def is_useful(self, call, output):
        new_facts = {fact for fact in self.chain_facts if fact in output} - self.found_facts
        self.found_facts |= new_facts
        return bool(new_facts)

    def demonstration(self, mistake_rate=0.0, rng=None) -> Iterable[str]:
        """A search per hop, each for the entity the last result named, then the answer;
        each decision wrong with probability `mistake_rate`, as a weak agent's."""
        rng = rng or random.Random(0)

        def think(thought):
            return f"<think>{thought}</think>\n" if self.require_think else ""

        def search(entity):
            call = format_tool_call("search", {"query": entity})
            return think(f"I need the facts about {entity}.") + call

        def answer(entity):
            return think(f"The answer is {entity}.") + f"<answer>{entity}</answer>"

        turns, entity = [], self.hop_entities[0]
        for hop in range(self.hops):
            if hop > 0 and rng.random() < mistake_rate:
                return turns + [answer(entity)]  # one hop short: the intermediate entity
            if rng.random() < mistake_rate:
                if turns and rng.random() < 0.5:
                    turns.append(turns[-1])  # repeats the last query, wasting a turn
                else:  # searches another entity of its kind and follows the wrong chain
                    others = [other for other in self.kind_of[entity] if other != entity]
                    entity = rng.choice(others)
            turns.append(search(entity))
            entity = self.next_entity[entity]
        return turns + [answer(entity)]


def fact_text(subject: str, relation: str, obj: str) -> str:
    """A fact as the search returns it: "Amber: directed by Heron." """
    return f"{subject}: {relation} {obj}."


def lookup_tool(facts: list[tuple[str, str, str]]) -> tools.Tool:
    """A "search" tool over (subject, relation, object) facts: those whose subject is the
    query (case and punctuation ignored). Not BM25: that would also return facts naming
    it as object ("Cedar: directed by Heron." for "Heron"): two hops in one query."""
    def search(query: str) -> str:
        key = query.strip().strip(string.punctuation + " ").lower()
        found = [fact_text(*fact) for fact in facts if fact[0].lower() == key]
        return " ".join(found) if found else f"No facts about {query.strip()}."
    return tools.Tool(
        name="search", description="Look up a name; returns the facts about it.",
        parameters=tools.string_parameters("query", "A name."), function=search,
    )

# -----------------------------------------------------------------------------
# Calculator tasks: word problems whose numbers are too large to do in one's head


class CalculatorEnv(ToolEnv):
    """Two-step word problems with 3-4 digit numbers and the `calculator` tool; the
    integer answer scored by exact match (normalising drops a thousands comma)."""
    system_prompt = (
        "Solve the problem. Use the calculator tool for the arithmetic, then give the "
        "number as <answer>...</answer>."
    )

    def new_task(self, rng):
        kind = rng.randrange(3)
        if kind == 0:
            boxes, per_box = rng.randint(100, 999), rng.randint(100, 999)
            given = rng.randint(100, boxes * per_box - 1)
            question = (
                f"A shop has {boxes} boxes of {per_box} nails each and sells {given} nails. "
                "How many nails are left?"
            )
            answer, self.expression = boxes * per_box - given, f"{boxes} * {per_box} - {given}"
        elif kind == 1:
            per_hour, hours, days = rng.randint(100, 999), rng.randint(10, 24), rng.randint(10, 99)
            question = (
                f"A factory makes {per_hour} bolts an hour, {hours} hours a day, for {days} "
                "days. How many bolts does it make?"
            )
            answer, self.expression = per_hour * hours * days, f"{per_hour} * {hours} * {days}"
        else:
            shelves, per_shelf = rng.randint(12, 99), rng.randint(100, 999)
            bought = rng.randint(100, shelves * per_shelf - 100)
            question = (
                f"A library has {shelves * per_shelf - bought} books and buys {bought} more. "
                f"It puts them equally on {shelves} shelves. How many books are on each shelf?"
            )
            answer = per_shelf
            self.expression = f"({shelves * per_shelf - bought} + {bought}) / {shelves}"
        return question, [str(answer)], [tools.calculator_tool()]

    def demonstration(self, mistake_rate=0.0, rng=None) -> Iterable[str]:
        """The calculator on the question's numbers, then the value it returns; with
        probability `mistake_rate` a number is miscopied into the expression, and its wrong
        value answered."""
        rng = rng or random.Random(0)
        expression = self.expression
        if rng.random() < mistake_rate:
            number = rng.choice(re.findall(r"\d+", expression))
            expression = expression.replace(number, str(miscopied(int(number), rng)), 1)
        call = format_tool_call("calculator", {"expression": expression})
        return [call, f"<answer>{tools.calculate(expression)}</answer>"]

# -----------------------------------------------------------------------------
# Computation: answers that need exact arithmetic, with the sandboxed `python` tool

PYTHON_TOOL = tools.python_tool()  # one for all episodes: a turn's programs run as a batch


def run_own_program(code: str) -> str:
    """What a ComputeEnv demonstration program prints, run here: our code, not a model's,
    needs no sandbox, and the warm-up runs thousands."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    return printed.getvalue()


DEMONSTRATION_PYTHON_TOOL = replace(PYTHON_TOOL, function=run_own_program, batch_function=None)


class ComputeEnv(ToolEnv):
    """Questions a small model cannot answer in its head: a product of large numbers, the
    digit sum of a power, a count over a range. The agent writes a program for the
    `python` tool, reads what it printed and answers the number (exact match). Each kind
    has one program shape, so a tiny model can learn it."""
    system_prompt = (
        "Answer the question. Run a short Python program with the python tool that prints "
        "the result, then give the number as <answer>...</answer>."
    )
    # A call carries its program (96 tokens). Copying long numbers takes 4 layers, not 2,
    # which learn steadily; 0.85 leaves a weak agent (docs/results.md).
    train_defaults = {
        "max_new_tokens": 96, "model": "tiny-deep", "lr": 5e-4, "warmup_mistake_rate": 0.85,
    }
    KINDS = {  # kind -> (question, program, answer), filled in with the numbers a, b, c
        "product": ("What is {a} times {b}?", "print({a} * {b})", lambda a, b: a * b),
        "digit_sum": (
            "What is the sum of the digits of {a} to the power {b}?",
            "print(sum(int(digit) for digit in str({a} ** {b})))",
            lambda a, b: sum(int(digit) for digit in str(a ** b)),
        ),
        "count": (
            "How many numbers from {a} to {b} are divisible by {c}?",
            "print(sum(1 for n in range({a}, {b} + 1) if n % {c} == 0))",
            lambda a, b, c: b // c - (a - 1) // c,
        ),
    }

    def __init__(self, kinds=tuple(KINDS), **options):
        assert kinds and set(kinds) <= set(self.KINDS), (
            f"kinds must be some of {sorted(self.KINDS)}, got {kinds}"
        )
        self.kinds = list(kinds)
        super().__init__(**options)

    def new_task(self, rng):
        self.kind = rng.choice(self.kinds)
        if self.kind == "product":
            self.numbers = {"a": rng.randint(100, 999), "b": rng.randint(100, 999)}
        elif self.kind == "digit_sum":
            self.numbers = {"a": rng.randint(2, 99), "b": rng.randint(20, 99)}
        else:
            start = rng.randint(1, 99)
            self.numbers = {
                "a": start, "b": start + rng.randint(100, 9999), "c": rng.randint(3, 97)
            }
        question, _, solve = self.KINDS[self.kind]
        return question.format(**self.numbers), [str(solve(**self.numbers))], [PYTHON_TOOL]

    def demonstration(self, mistake_rate=0.0, rng=None) -> Iterable[str]:
        """The kind's program, then the number it prints, each copy wrong with probability
        mistake_rate (a digit miscopied). The agent always calls the tool (guesses, as in
        QA's flawed demonstrations, taught it to stop); RL sharpens the copying."""
        rng = rng or random.Random(0)
        self.tools = {"python": DEMONSTRATION_PYTHON_TOOL}
        numbers = dict(self.numbers)
        if rng.random() < mistake_rate:
            key = rng.choice(sorted(numbers))
            numbers[key] = miscopied(numbers[key], rng)
        _, program, solve = self.KINDS[self.kind]
        answer = solve(**numbers)
        if rng.random() < mistake_rate:
            answer = miscopied(answer, rng)
        call = format_tool_call("python", {"code": program.format(**numbers)})
        return [call, f"<answer>{answer}</answer>"]


def miscopied(number: int, rng) -> int:
    """`number` with a digit replaced by a random nonzero one (maybe the same): a slip."""
    digits = list(str(number))
    digits[rng.randrange(len(digits))] = str(rng.randrange(1, 10))
    return int("".join(digits))


def final_number(text: str) -> str | None:
    """The last number in `text` (GSM8K's after "####"), without separators or a ".0"."""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text.split("####")[-1])
    if not numbers:
        return None
    number = numbers[-1].replace(",", "")
    return number[:-2] if number.endswith(".0") else number


def load_math_dataset(source: str, split: str = "train") -> list[dict]:
    """GSM8K-style rows {"question", "answer": "... #### 72"} -> {"id", "question",
    "answers": ["72"]}, from a local file (local_split) or the Hub ("gsm8k" or alike)."""
    raw, local = read_rows(source, split)
    rows = []
    for index, row in enumerate(raw):
        answer = final_number(str(row.get("answer") or ""))
        if not row.get("question") or answer is None:
            raise UserError(
                f"{source}: row {index} needs a question and an answer ending in '#### number'"
            )
        rows.append(
            {"id": str(row.get("id", index)), "question": row["question"], "answers": [answer]}
        )
    return local_split(rows, split) if local else rows


class MathEnv(ToolEnv):
    """Grade-school math (GSM8K) with the `python` tool, for instruct models on GPUs (the
    tiny model learns ComputeEnv). Scored by the final number: 72 and 72.0 agree."""
    system_prompt = (
        "Solve the problem. You may run Python programs with the python tool. Give the "
        "final number as <answer>...</answer>."
    )

    def __init__(self, data, split="train", **options):
        if isinstance(data, (str, Path)):
            data = cached_dataset(load_math_dataset, data, split)
        self.rows = data
        assert len(self.rows) > 0, "MathEnv needs at least one row"
        super().__init__(**options)

    def new_task(self, rng):
        row = self.rows[self.seed % len(self.rows)]  # seed i is row i, as in SearchQAEnv
        return row["question"], row["answers"], [PYTHON_TOOL]

    def score(self, answer):
        number = final_number(answer)
        em = float(number is not None and float(number) == float(self.answers[0]))
        return {"em": em, "f1": em}

# -----------------------------------------------------------------------------
# RAGEN's games: the action is a word in <answer>...</answer>, several joined by "||"


class GameEnv:
    """The text games' turn logic. A subclass sets `rules` and `actions` and implements
    `new_game(rng)`, `move(action) -> (reward, done)` (setting self.success) and
    `render()`. Up to `max_actions_per_turn` actions a turn ("Up || Up || Left"), RAGEN's
    granularity; more are dropped, as are those after the game ends. A malformed turn
    (no <answer>, text after it, an unknown action, no <think> first with
    `require_think`) does nothing."""
    rules, actions = "", []
    warmup_options = {}  # as ToolEnv.warmup_options
    train_defaults = {}  # as ToolEnv.train_defaults

    def __init__(
        self, max_turns=5, max_actions_per_turn=3, format_penalty=-0.1, require_think=False
    ):
        assert max_turns >= 1 and max_actions_per_turn >= 1, (
            "max_turns and max_actions_per_turn must be >= 1"
        )
        self.max_turns, self.max_actions_per_turn = max_turns, max_actions_per_turn
        self.format_penalty, self.require_think = format_penalty, require_think

    def reset(self, seed: int, member: int = 0) -> tuple[list[dict], list[dict]]:
        """(opening messages, no tools) for `seed`. The luck (slips, payouts) comes from
        (seed, member), member the episode's place in its group: a GRPO group plays one game
        with independent luck, as in RAGEN."""
        self.turn, self.done, self.success = 0, False, False
        self.new_game(random.Random(seed))
        self.rng = random.Random(f"{seed}/{member}")  # the transitions' own random stream
        several = (
            f", up to {self.max_actions_per_turn} actions separated by ||"
            if self.max_actions_per_turn > 1 else ""
        )
        system = (
            f"{self.rules} Valid actions: {', '.join(self.actions)}. "
            f"Reply with <answer>action</answer>{several}."
            + (THINK_INSTRUCTION if self.require_think else "")
        )
        return [
            {"role": "system", "content": system}, {"role": "user", "content": self.render()}
        ], []

    def parse_actions(self, text: str) -> tuple[list[str], str | None]:
        """(a turn's valid actions, capped, canonically spelled; or [] and an error)."""
        thought_first, action_text = split_thinking(text)
        answer = extract_answer(action_text)
        if self.require_think and not thought_first:
            return [], "Invalid reply: begin with your reasoning in <think>...</think>."
        if answer is None or action_text.split("</answer>", 1)[1].strip():
            return [], (
                "Invalid reply: give your action as <answer>...</answer>, "
                f"one of {', '.join(self.actions)}."
            )
        canonical = {action.lower(): action for action in self.actions}
        words = [word.strip() for word in answer.split("||")][:self.max_actions_per_turn]
        unknown = [word for word in words if word.lower() not in canonical]
        if unknown:
            return [], (
                f"Invalid action {unknown[0]!r}: valid actions are {', '.join(self.actions)}."
            )
        return [canonical[word.lower()] for word in words], None

    def step(self, assistant_text: str) -> StepResult:
        """Runs the turn's actions in order; the reward is their sum (or the penalty)."""
        assert not self.done, "the episode is over; call reset() for a new one"
        self.turn += 1
        actions, error = self.parse_actions(assistant_text)
        reward, executed = (self.format_penalty if error else 0.0), 0
        for action in actions:
            move_reward, self.done = self.move(action)
            reward, executed = reward + move_reward, executed + 1
            if self.done:
                break
        observation = f"{error}\n{self.render()}" if error else self.render()
        self.done = self.done or self.turn >= self.max_turns
        info = {
            "success": self.success, "tool_calls": 0, "invalid_calls": 0,
            "format_error": error is not None, "actions": executed,
        }
        return StepResult([{"role": "user", "content": observation}], reward, self.done, info)

    def demonstration(self, mistake_rate=0.0, rng=None) -> Iterable[str]:
        """A reply a turn: the optimal next actions (`plan()`), each swapped for another
        with probability `mistake_rate`."""
        rng = rng or random.Random(0)
        while True:
            actions = (self.plan() or [rng.choice(self.actions)])[:self.max_actions_per_turn]
            actions = [
                rng.choice([a for a in self.actions if a != action])
                if rng.random() < mistake_rate else action
                for action in actions
            ]
            yield f"<answer>{' || '.join(actions)}</answer>"


def bfs_path(start, successors, is_goal) -> list | None:
    """The fewest actions from `start` to a state with is_goal(state), by breadth-first
    search (None: no way); successors(state) yields (action, next state)."""
    parents, queue = {start: None}, deque([start])
    while queue:
        state = queue.popleft()
        if is_goal(state):
            path = []
            while parents[state] is not None:
                state, action = parents[state]
                path.append(action)
            return path[::-1]
        for action, following in successors(state):
            if following not in parents:
                parents[following] = (state, action)
                queue.append(following)
    return None


SAFE_ARMS = ["Turtle", "Oak", "Anchor", "Pillow"]  # names hint at the risk, as in RAGEN's bandit
RISKY_ARMS = ["Dragon", "Comet", "Volcano", "Tiger"]


class BanditEnv(GameEnv):
    """Two-armed bandit, one turn. The safe arm pays `safe_reward` (0.1); the risky arm
    `risky_reward` (1.0) with probability `risky_probability` (0.25): 0.25 expected, the
    better arm, whose pick is success. Names and order come from the seed."""
    rules = (
        "Two slot machines: one pays a little every time, the other pays a lot but rarely. "
        "Pull one arm."
    )

    def __init__(
        self, safe_reward=0.1, risky_reward=1.0, risky_probability=0.25, max_turns=1,
        max_actions_per_turn=1, **options,
    ):
        self.safe_reward, self.risky_reward = safe_reward, risky_reward
        self.risky_probability = risky_probability
        super().__init__(max_turns=max_turns, max_actions_per_turn=max_actions_per_turn, **options)

    def new_game(self, rng):
        self.safe_arm, self.risky_arm = rng.choice(SAFE_ARMS), rng.choice(RISKY_ARMS)
        self.actions = rng.sample([self.safe_arm, self.risky_arm], 2)

    def demonstration(self, mistake_rate=0.5, rng=None) -> Iterable[str]:
        """One pull for the warm-up: the safe arm with probability `mistake_rate`, else the
        risky one. It teaches the format and leaves the choice to RL."""
        rng = rng or random.Random(0)
        arm = self.safe_arm if rng.random() < mistake_rate else self.risky_arm
        return [f"<answer>{arm}</answer>"]

    def move(self, action):
        self.success = action == self.risky_arm
        if self.success:
            return (self.risky_reward if self.rng.random() < self.risky_probability else 0.0), True
        return self.safe_reward, True

    def render(self):
        return f"Arms: {self.actions[0]}, {self.actions[1]}. Which arm do you pull?"


MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}  # (row, column) deltas
PERPENDICULAR = {
    "Up": ("Left", "Right"), "Down": ("Left", "Right"),
    "Left": ("Up", "Down"), "Right": ("Up", "Down"),
}


def shifted(cell, action):
    return cell[0] + MOVES[action][0], cell[1] + MOVES[action][1]


def grid_text(size, symbol):
    """A size x size grid, a row a line: symbol((row, column)) for each cell."""
    return "\n".join("".join(symbol((r, c)) for c in range(size)) for r in range(size))


class FrozenLakeEnv(GameEnv):
    """Walk from the start to the goal without falling into a hole. Maps are random per
    seed (each cell but start and goal a hole with `hole_probability`), redrawn until a
    path exists; the edge stops you. With `slippery=True` the intended move happens with
    p = 1/3, else a perpendicular one (1/3 each), as in Gym's FrozenLake. Reward 1 at the
    goal, 0 in a hole (the end). One move a turn: the tiny model learns a path's next
    step, and sees each slip."""
    rules = (
        "FrozenLake: you are P; walk to the goal G over the ice _ without stepping into a hole O."
    )
    actions = ["Left", "Down", "Right", "Up"]
    train_defaults = {
        "max_turns": 8, "warmup_mistake_rate": 0.3, "lr": 2e-4, "warmup_world_model": 1.0,
        "warmup_clean_steps": 2400, "algo": "gigpo",
    }

    def __init__(
        self, size=4, hole_probability=0.2, slippery=False, max_turns=8, max_actions_per_turn=1,
        **options,
    ):
        self.size, self.hole_probability, self.slippery = size, hole_probability, slippery
        self.cells = [(row, column) for row in range(size) for column in range(size)]
        super().__init__(max_turns=max_turns, max_actions_per_turn=max_actions_per_turn, **options)

    def successors(self, cell):
        for action in self.actions:
            following = self.clamp(shifted(cell, action))
            if following not in self.holes:
                yield action, following

    def clamp(self, cell):
        return min(max(cell[0], 0), self.size - 1), min(max(cell[1], 0), self.size - 1)

    def new_game(self, rng):
        while True:
            self.start, self.goal = rng.sample(self.cells, 2)
            self.holes = {
                c for c in self.cells
                if c not in (self.start, self.goal) and rng.random() < self.hole_probability
            }
            if self.shortest_path(self.start) is not None:
                break
        self.player = self.start

    def shortest_path(self, cell):
        return bfs_path(cell, self.successors, lambda cell: cell == self.goal)

    def reach_probabilities(self, moves):
        """({cell: best chance to reach the goal in `moves` moves}, {cell: best action}),
        by value iteration."""
        chance, best = {cell: float(cell == self.goal) for cell in self.cells}, {}
        for _ in range(moves):
            def action_value(cell, action):
                ways = (action, *PERPENDICULAR[action]) if self.slippery else (action,)
                return sum(chance[self.clamp(shifted(cell, way))] for way in ways) / len(ways)
            best = {
                cell: max(self.actions, key=lambda action: action_value(cell, action))
                for cell in self.cells
            }
            chance = {
                cell: float(cell == self.goal) if cell == self.goal or cell in self.holes
                else action_value(cell, best[cell])
                for cell in self.cells
            }
        return chance, best

    def plan(self):
        """The optimal next actions: the shortest path; with slip, the best action now."""
        if not self.slippery:
            return self.shortest_path(self.player)
        return [self.reach_probabilities(self.max_turns - self.turn)[1][self.player]]

    def move(self, action):
        if self.slippery:
            action = self.rng.choice([action, *PERPENDICULAR[action]])
        self.player = self.clamp(shifted(self.player, action))
        self.success = self.player == self.goal
        return float(self.success), self.success or self.player in self.holes

    def render(self):
        def symbol(cell):
            if cell == self.player:
                return "P"
            return "G" if cell == self.goal else "O" if cell in self.holes else "_"
        return grid_text(self.size, symbol)


class SlipperyFrozenLakeEnv(FrozenLakeEnv):
    """FrozenLake on slippery ice, as RAGEN plays it, with its recipe (docs/games.md)."""
    __init__ = partialmethod(FrozenLakeEnv.__init__, slippery=True)
    train_defaults = {**FrozenLakeEnv.train_defaults, "warmup_mistake_rate": 0.1, "group_size": 16}


class SokobanEnv(GameEnv):
    """Push the box onto the target in a walled size x size room with `interior_walls`
    more walls; levels are random per seed, redrawn until a breadth-first search over
    (player, box) states solves them. Rewards: `solved_reward` +11 when the box reaches
    the target, which ends the game (gym-sokoban's +1 for a box on a target and +10 for
    a solved room: one event with one box); `step_reward` 0 a move (gym-sokoban's -0.1:
    docs/games.md)."""
    rules = (
        "Sokoban: you are P; push the box X onto the target O. # is a wall, _ is floor. "
        "You can push the box but not pull it. * is the box on the target, + is you on the "
        "target."
    )
    actions = ["Up", "Down", "Left", "Right"]
    # Five turns of three moves reach 97% of the levels, in 640 tokens.
    train_defaults = {
        "max_turns": 5, "max_total_tokens": 640, "warmup_mistake_rate": 0.2, "lr": 2e-4,
        "group_size": 16, "warmup_world_model": 1.0, "algo": "gigpo", "warmup_clean_steps": 4800,
    }

    def __init__(
        self, size=6, interior_walls=2, step_reward=0.0, solved_reward=11.0, max_turns=10,
        **options,
    ):
        self.size, self.interior_walls = size, interior_walls
        self.step_reward, self.solved_reward = step_reward, solved_reward
        super().__init__(max_turns=max_turns, **options)

    def transition(self, player, box, action):
        """(player, box) after a move: a wall stops you, a box moves unless a wall is behind."""
        ahead = shifted(player, action)
        if ahead in self.walls:
            return player, box
        if ahead == box:
            beyond = shifted(box, action)
            return (player, box) if beyond in self.walls else (ahead, beyond)
        return ahead, box

    def new_game(self, rng):
        interior = [(r, c) for r in range(1, self.size - 1) for c in range(1, self.size - 1)]
        border = {(r, c) for r in range(self.size) for c in range(self.size)} - set(interior)
        while True:
            cells = rng.sample(interior, self.interior_walls + 3)
            self.walls = border | set(cells[3:])
            self.player, self.box, self.target = cells[:3]
            if self.plan() is not None:
                break

    def plan(self):
        """The fewest moves that push the box onto the target (None: it is stuck)."""
        return bfs_path(
            (self.player, self.box), self.successors, lambda state: state[1] == self.target
        )

    def successors(self, state):
        return ((action, self.transition(*state, action)) for action in self.actions)

    def move(self, action):
        self.player, self.box = self.transition(self.player, self.box, action)
        self.success = self.box == self.target
        return self.step_reward + self.success * self.solved_reward, self.success

    def render(self):
        def symbol(cell):
            if cell in self.walls:
                return "#"
            if cell == self.box:
                return "*" if cell == self.target else "X"
            if cell == self.player:
                return "+" if cell == self.target else "P"
            return "O" if cell == self.target else "_"
        return grid_text(self.size, symbol)


ENVS = {
    "search_qa": SearchQAEnv, "synthetic_qa": SyntheticQAEnv, "calculator": CalculatorEnv,
    "compute": ComputeEnv, "math": MathEnv, "bandit": BanditEnv, "frozen_lake": FrozenLakeEnv,
    "frozen_lake_slippery": SlipperyFrozenLakeEnv, "sokoban": SokobanEnv,
}
DATA_ENVS = (SearchQAEnv, MathEnv)  # their tasks come from --data
# The defaults of the flags that an env's `train_defaults` (or StarPO-S) may change, for
# train.py and eval.py alike: run_defaults(env) is what a run of that env plays.
DEFAULTS = {"algo": "grpo", "filter_ratio": 1.0, "clip_low": 0.2, "clip_high": 0.2, "kl": "none",
            "model": "tiny", "max_new_tokens": 32, "max_turns": 4, "max_total_tokens": 512,
            "group_size": 8, "warmup_world_model": 0.0, "warmup_clean_steps": 800,
            "lr": 1e-3, "warmup_mistake_rate": 0.6, "truncated_reward": "keep"}


def run_defaults(name):
    """DEFAULTS with env `name`'s train_defaults over them."""
    return {**DEFAULTS, **ENVS[name].train_defaults}


def env_factory(name, options=None, data=None, split="train"):
    """A zero-argument callable building a fresh `name` env per episode (for rollout()).
    `options`: the env's constructor keywords; `data` and `split`: DATA_ENVS only."""
    assert name in ENVS, f"unknown env {name!r}; choose from {sorted(ENVS)}"
    env_class, options = ENVS[name], dict(options or {})
    if env_class in DATA_ENVS:
        assert data is not None, (
            f"{name} needs data: a Hub name (hotpotqa, musique, gsm8k, ...) or a local file"
        )
        options = {"data": data, "split": split, **options}
    return lambda: env_class(**options)
