"""
Environments: what an agent's turn *means*.

Agent-R1 splits an agent task in two: a Tool (tools.py) executes one action, and a **ToolEnv** (here) is
the orchestrator around it: it takes the model's whole turn, runs the tools it called, decides what that
means for the task (the state transition), computes the reward and packages the observation for the next
turn. RAGEN adds text games where the action is a move, not a tool call.
Every environment is a plain class, one instance per episode, driven by rollout.py like this:

    env = SyntheticQAEnv(max_turns=4)
    messages, tool_schemas = env.reset(seed)       # system + user messages, tools for the chat template
    while True:
        text = policy(messages, tool_schemas)      # the assistant turn (agent tokens, loss mask 1)
        result = env.step(text)                    # StepResult(observations, reward, done, info)
        messages += [{"role": "assistant", "content": text}, *result.observations]  # env tokens, mask 0
        if result.done:
            break

Rewards. The episode's score is the sum of its step rewards, and every term is a constructor argument:
  - outcome: on the final step, `outcome_reward` times exact match (QA) or the game's own reward;
  - format penalty (RAGEN): `format_penalty` = -0.1 for a turn with neither a valid action nor a valid
    answer; its observation says what was expected, so the model can recover on the next turn, or with
    `end_on_format_error=True` the episode ends there (Search-R1, TRL's tool loop), a sharper signal;
  - format reward (Agent-R1's partial credit): `format_reward` for every well-formed turn (default 0);
  - process reward (Agent-R1's intermediate rewards): `process_reward` for each successful tool call
    that made progress, e.g. retrieved a passage the answer needs and was not seen yet (default 0);
  - reasoning-aware format (RAGEN): with `require_think=True` a turn must open with <think>...</think>.

Seeds. Everything is deterministic given the seed. Procedural envs train on seeds below
EVAL_SEED_START and evaluate on `eval_seeds(n)`, so no evaluation episode is seen in training.
SearchQAEnv is separated by dataset split instead.
"""
import contextlib
import hashlib
import io
import json
import random
import re
import string
from collections import Counter, deque
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import tools
from nanoagent import retrieval
from nanoagent.common import UserError

EVAL_SEED_START = 10_000_000


def eval_seeds(n: int) -> range:
    """The first n evaluation seeds."""
    return range(EVAL_SEED_START, EVAL_SEED_START + n)


@dataclass
class StepResult:
    observations: list[dict]  # messages to append after the assistant turn: role "tool" or "user"
    reward: float
    done: bool
    info: dict  # this step's success, tool_calls, invalid_calls, format_error; QA envs: answer, em, f1, calls

# -----------------------------------------------------------------------------
# Scoring answers: SQuAD-style exact match, token F1 and substring match


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD's rule)."""
    text = "".join(char for char in text.lower() if char not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: list[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer."""
    return float(any(normalize_answer(prediction) == normalize_answer(answer) for answer in answers))


def substring_match(prediction: str, answers: list[str]) -> float:
    """1.0 if a normalised gold answer occurs inside the normalised prediction (lenient "cover EM")."""
    prediction = f" {normalize_answer(prediction)} "  # pad so "1" does not match inside "10"
    return float(any(f" {normalize_answer(answer)} " in prediction for answer in answers))


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
FORMAT_HINT = ('Invalid reply: call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
               'or give the final answer as <answer>...</answer>.')


def split_thinking(text: str) -> tuple[bool, str]:
    """(does the turn open with a closed <think> block, the turn with its think blocks removed).
    Removing them first means an <answer> or a tool call merely *mentioned* while thinking is no action."""
    return re.match(r"\s*<think>.*?</think>", text, re.DOTALL) is not None, THINK_BLOCK.sub("", text)


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
    """The tool-turn loop. A subclass sets `system_prompt` and implements `new_task(rng)`; it may
    override `score(answer)` and `is_useful(call, output)`. One step is one assistant turn:
      - an <answer> ends the episode with the outcome reward (tool calls in that turn are ignored);
      - otherwise its tool calls run and each result comes back as a {"role": "tool"} message;
        a turn whose calls all failed counts as a format error (the errors explain why);
      - a turn with neither gets `format_penalty` and a {"role": "user"} message saying what to write.
    The episode also ends after `max_turns` turns, then with no outcome reward."""
    system_prompt = "Answer the question. Give the final answer as <answer>...</answer>."
    warmup_options = {}  # options of an easier version, for the warm-up's first phase (sft.py)
    train_defaults = {}  # train.py flags this task needs other than train.DEFAULTS (the user's flags still win)

    def __init__(self, max_turns=4, outcome_reward=1.0, format_penalty=-0.1, format_reward=0.0,
                 process_reward=0.0, require_think=False, max_calls_per_turn=2, end_on_format_error=False):
        assert max_turns >= 1, f"max_turns must be at least 1, got {max_turns}"
        self.end_on_format_error = end_on_format_error
        self.max_turns, self.outcome_reward = max_turns, outcome_reward
        self.format_penalty, self.format_reward, self.process_reward = format_penalty, format_reward, process_reward
        self.require_think, self.max_calls_per_turn = require_think, max_calls_per_turn

    def new_task(self, rng: random.Random) -> tuple[str, list[str], list[tools.Tool]]:
        """Draws one task from `rng`: (question, gold answers, tools the model may call)."""
        raise NotImplementedError

    def score(self, answer: str) -> dict:
        """Scores a final answer against self.answers; "em" decides success and the outcome reward."""
        return {"em": exact_match(answer, self.answers), "f1": f1_score(answer, self.answers),
                "substring_em": substring_match(answer, self.answers)}

    def is_useful(self, call: tools.ToolCall, output: str) -> bool:
        """Does this successful, not repeated call earn the process reward? By default, yes."""
        return True

    def reset(self, seed: int, episode: int = 0) -> tuple[list[dict], list[dict]]:
        """(opening messages, tool schemas) for `seed`; tools are deterministic, so `episode` is unused."""
        self.seed = seed
        self.question, self.answers, tool_list = self.new_task(random.Random(seed))
        self.tools = {tool.name: tool for tool in tool_list}
        self.turn, self.done, self.calls_made = 0, False, set()
        system = self.system_prompt + (THINK_INSTRUCTION if self.require_think else "")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": self.question}]
        return messages, [tool.schema() for tool in tool_list]

    def step(self, assistant_text: str) -> StepResult:
        """Runs one assistant turn: transition, reward, observations."""
        return step_envs([self], [assistant_text])[0]

    def read_turn(self, assistant_text: str) -> list[tools.ToolCall]:
        """The first half of a step: reads the turn and returns the tool calls to run (maybe none)."""
        assert not self.done, "the episode is over; call reset() for a new one"
        self.turn += 1
        thought_first, action_text = split_thinking(assistant_text)
        self.well_formed = thought_first or not self.require_think
        self.answer = extract_answer(action_text) if self.well_formed else None
        calls = tools.parse_tool_calls(action_text, self.tools, self.max_calls_per_turn) if self.well_formed else []
        self.calls = calls  # counted, but not run, in a turn that answers
        return calls if self.answer is None else []

    def finish_turn(self, results: list[tuple[str, bool]]) -> StepResult:
        """The second half: (output, ok) of each call read_turn returned -> the StepResult."""
        info = {"success": False, "tool_calls": len(self.calls), "invalid_calls": 0, "format_error": False,
                "answer": self.answer, "em": 0.0, "f1": 0.0, "substring_em": 0.0,
                "calls": [asdict(call) for call in self.calls]}  # as parsed, errors included (for the report)
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
        self.done = self.done or self.turn >= self.max_turns or (self.end_on_format_error and info["format_error"])
        return StepResult(observations, reward, self.done, info)


def step_envs(envs: list, texts: list[str]) -> list[StepResult]:
    """One turn of many episodes, env i reading texts[i]: what env.step gives on each, with the tool
    calls of every ToolEnv run in one tools.run_tool_calls."""
    calls = [env.read_turn(text) if isinstance(env, ToolEnv) else [] for env, text in zip(envs, texts)]
    outcomes = iter(tools.run_tool_calls([call for env_calls in calls for call in env_calls],
                                         [env.tools for env, env_calls in zip(envs, calls) for _ in env_calls]))
    return [env.finish_turn([next(outcomes) for _ in env_calls]) if isinstance(env, ToolEnv) else env.step(text)
            for env, text, env_calls in zip(envs, texts, calls)]

# -----------------------------------------------------------------------------
# Search QA (Agent-R1's task): HotpotQA, 2WikiMultihopQA, MuSiQue


HUB_DATASETS = {"hotpotqa": ("hotpotqa/hotpot_qa", "distractor"),  # (Hub name, config)
                "2wikimultihopqa": ("framolfese/2WikiMultihopQA", None),
                "musique": ("dgslibisey/MuSiQue", None), "gsm8k": ("openai/gsm8k", "main")}


def normalize_qa_row(row: dict) -> dict:
    """One HotpotQA / 2WikiMultihopQA / MuSiQue example -> {"id", "question", "answers", "paragraphs":
    [{"title", "text"}], "supporting_titles"}. MuSiQue has "paragraphs"; the other two have "context", as
    HF's {"title": [...], "sentences" (or "content"): [[...]]} or the original JSON's [[title, [sentences]]]."""
    if "paragraphs" in row:
        paragraphs = [{"title": p["title"], "text": p["paragraph_text"]} for p in row["paragraphs"]]
        supporting = [p["title"] for p in row["paragraphs"] if p.get("is_supporting")]
        answers = [row["answer"], *(row.get("answer_aliases") or [])]
    else:
        context, facts = row["context"], row.get("supporting_facts") or []
        if isinstance(context, dict):
            context = zip(context["title"], context.get("sentences", context.get("content")))
        paragraphs = [{"title": title, "text": " ".join(s.strip() for s in sentences)} for title, sentences in context]
        supporting = facts["title"] if isinstance(facts, dict) else [title for title, _ in facts]
        answers = [row["answer"]]
    return {"id": str(row.get("id", row.get("_id", ""))), "question": row["question"], "answers": answers,
            "paragraphs": paragraphs, "supporting_titles": list(dict.fromkeys(supporting))}


HELD_OUT_SHARE = 0.1  # the share of a local file's rows held out as its "validation" split


def held_out(row_id: str) -> float:
    """A number in [0, 1) fixed by the row's id: rows are split by it, whatever the file's order."""
    return int.from_bytes(hashlib.blake2b(row_id.encode(), digest_size=8).digest(), "little") / 2 ** 64


def local_split(rows: list[dict], split: str) -> list[dict]:
    """The `split` of a local file's rows: "validation" is the HELD_OUT_SHARE of them (at least one) with the
    lowest held_out(id), "train" the others, "all" every row (a file of held-out questions, for eval.py)."""
    if split not in ("train", "validation", "all"):
        raise UserError(f"a local data file has the splits train, validation (held out from it) and all, not {split!r}")
    if split == "all":
        return rows
    if len(rows) < 2:
        raise UserError(f"a local data file needs at least 2 rows to hold one out for evaluation, it has {len(rows)}")
    ids = [row["id"] or row["question"] for row in rows]
    if len(set(ids)) < len(ids):
        ids = [f"{index}/{row_id}" for index, row_id in enumerate(ids)]  # repeated ids: the position decides
    order = sorted(range(len(rows)), key=lambda index: held_out(ids[index]))
    held = set(order[:max(1, round(HELD_OUT_SHARE * len(rows)))])
    return [row for index, row in enumerate(rows) if (index in held) == (split == "validation")]


def read_rows(source: str, split: str) -> tuple[object, bool]:
    """(the raw rows, whether they are local): a local .json/.jsonl/.parquet file's rows (every one: the caller
    splits them with local_split), or the Hub dataset's `split` (HUB_DATASETS names a few by a short name)."""
    import datasets  # imported here: slow to import, and only the dataset envs need it
    suffix = Path(source).suffix
    if suffix not in (".json", ".jsonl", ".parquet"):
        name, config = HUB_DATASETS.get(source.lower(), (source, None))
        return datasets.load_dataset(name, config, split=split), False
    if not Path(source).exists():
        raise UserError(f"data file {source} does not exist")
    builder = "parquet" if suffix == ".parquet" else "json"
    return datasets.load_dataset(builder, data_files=str(source), split="train"), True


def load_qa_dataset(source: str, split: str = "train", limit: int | None = None) -> list[dict]:
    """Normalised rows of `split` from a local file (no network; split by local_split) or from the Hub:
    "hotpotqa", "2wikimultihopqa", "musique" or any Hub name with the same schema."""
    rows, local = read_rows(source, split)
    normalized = []
    for index, row in enumerate(rows):
        where = f"{source}: row {index} (id {row.get('id', row.get('_id'))!r})"
        # A file's rows share one schema, so a field one row lacks reads as None there: check the values too.
        missing = [field for field in ("question", "answer") if not row.get(field)]
        if missing or not (row.get("context") or row.get("paragraphs")):
            field = (missing or ["context (or paragraphs)"])[0]
            raise UserError(f"{where} has no {field!r} field; rows need HotpotQA, 2WikiMultihopQA or MuSiQue fields")
        try:
            normalized.append(normalize_qa_row(row))
        except (KeyError, TypeError, ValueError) as error:
            raise UserError(f"{where} does not parse as a QA example: {type(error).__name__} {error}") from error
    rows = local_split(normalized, split) if local else normalized
    return rows[:limit] if limit is not None else rows


def corpus_from_rows(rows: list[dict]) -> list[dict]:
    """The union of the rows' paragraphs, deduplicated: a search corpus without a Wikipedia dump."""
    unique = {(p["title"], p["text"]): p for row in rows for p in row["paragraphs"]}
    return list(unique.values())


@lru_cache(maxsize=16)
def cached_dataset(load, source, split: str) -> list[dict]:
    """load(source, split), once per process: envs are built once per episode, datasets are not."""
    return load(str(source), split)


@lru_cache(maxsize=4)
def cached_search_tool(retriever: str, top_k: int) -> tools.Tool:
    """One search tool per retriever spec and process: every episode shares it (and so its batches)."""
    return tools.search_tool(retrieval.open_retriever(retriever), top_k=top_k)


class SearchQAEnv(ToolEnv):
    """Multi-hop QA with a `search` tool. `data` is normalised rows or a source for load_qa_dataset.
    By default each question searches its own paragraphs (in HotpotQA's distractor setting, the 2 gold
    paragraphs among 8 distractors). For a shared corpus pass `retriever` (an index directory built by
    nanoagent/retrieval.py, or a server's URL http://host:port/retrieve) or `search` (a tools.search_tool).
    The process reward goes to a search that retrieves a supporting paragraph not retrieved before."""
    system_prompt = ("Answer the question. Use the search tool as often as you need, then give a short "
                     "final answer as <answer>...</answer>.")

    def __init__(self, data, split="train", search: tools.Tool | None = None, retriever: str | None = None,
                 top_k=3, **options):
        assert search is None or retriever is None, "pass search or retriever, not both"
        self.rows = cached_dataset(load_qa_dataset, data, split) if isinstance(data, (str, Path)) else data
        assert len(self.rows) > 0, "SearchQAEnv needs at least one row"
        self.search = cached_search_tool(retriever, top_k) if retriever is not None else search
        self.top_k = top_k
        super().__init__(**options)

    def new_task(self, rng):
        self.row = self.rows[self.seed % len(self.rows)]  # seed i is row i: an eval sweep visits every row
        self.found_titles = set()
        search = self.search or tools.search_tool(self.row["paragraphs"], top_k=self.top_k)
        return self.row["question"], self.row["answers"], [search]

    def is_useful(self, call, output):
        # tools.search_tool writes each hit as "[rank] title\ntext"
        new_titles = {t for t in self.row["supporting_titles"] if f"] {t}\n" in output} - self.found_titles
        self.found_titles |= new_titles
        return bool(new_titles)

# -----------------------------------------------------------------------------
# Synthetic multi-hop QA: the offline task a tiny model learns on a CPU

# Entity names: short English words, each one token of the tiny model's tokenizer (nanoagent/models.py,
# TINY_NAMES), so copying a name is one step.
NAMES = ("Amber Aspen Birch Cedar Coral Daisy Delta Ember Fable Fern Flint Frost Gale Grove Hazel Heron "
         "Iris Ivory Jade Juniper Kestrel Lark Laurel Lotus Maple Marsh Meadow Mint Moss Nova Oak Olive "
         "Onyx Opal Orchid Pearl Pebble Pine Plum Quartz Raven Reed Ridge Robin Rose Ruby Rust Sage "
         "Slate Sparrow Spruce Thorn Tide Topaz Vale Willow Wren Zephyr Aurora Basil Clover Dune Echo Finch "
         "Garnet Harbor Indigo Jasper Lilac Linden Lumen Misty Nectar Orion Poppy Quill Rowan Saffron Sierra "
         "Tansy Umber Velvet Wisp Yarrow Zinnia Acorn Bramble Cinder Dawn Comet Fjord Glade Moor Tundra").split()
ENTITY_TYPES = ["film", "person", "city", "country"]  # each type points to the next by one relation:
RELATIONS = ["directed by", "born in", "located in"]  # film -> person -> city -> country
QUESTIONS = {(0, 1): "Who directed {}?",  # (type of the start entity, hops) -> question
             (0, 2): "Where was the director of {} born?",
             (0, 3): "In which country was the director of {} born?",
             (1, 1): "Where was {} born?",
             (1, 2): "In which country was {} born?",
             (2, 1): "In which country is {}?"}
DISTRACTORS = {"film": ("set in", "city"), "person": ("friend of", "person"), "city": ("twinned with", "city")}


class SyntheticQAEnv(ToolEnv):
    """k-hop questions over a knowledge base of made-up entities drawn fresh for every seed, so the
    answer can only be found by searching. A KB with 2 entities per type looks like:

        Amber: directed by Heron.   Heron: born in Maple.   Maple: located in Onyx.   (+ the others' facts)

    "Where was the director of Amber born?" needs search("Amber") -> Heron, then search("Heron") -> Maple,
    each query built from the previous result. Single-word names and fixed phrasings let a tiny model learn
    it. Knobs: `hops` (1-3), `entities_per_type`, and `distractor_facts`, extra facts with other relations
    ("Amber: set in Maple.") that a lookup returns next to the fact the question needs. The process reward
    goes to a search that reveals the next hop's fact."""
    system_prompt = ("Answer the question. Call search with a name to get its facts, "
                     "then answer as <answer>name</answer>.")
    warmup_options = {"hops": 1}  # a tiny model learns to copy a name far sooner than with two hops
    # Flawed demonstrations wrong at 0.4: train.py's 0.6 left too little success to start from, and too many
    # seeds never took off (docs/results.md, "The main job over seeds"). A 2-hop demonstration is then right
    # with chance 0.6^3 = 22%.
    train_defaults = {"warmup_mistake_rate": 0.4}

    def __init__(self, hops=2, entities_per_type=3, distractor_facts=0, **options):
        assert 1 <= hops <= 3, f"hops must be 1, 2 or 3, got {hops}"
        assert entities_per_type >= 2, "need at least 2 entities per type, or the question gives its answer away"
        self.hops, self.entities_per_type, self.distractor_facts = hops, entities_per_type, distractor_facts
        super().__init__(**options)

    def new_task(self, rng):
        chosen = rng.sample(NAMES, len(ENTITY_TYPES) * self.entities_per_type)
        entities = {kind: chosen[i::len(ENTITY_TYPES)] for i, kind in enumerate(ENTITY_TYPES)}
        self.kind_of = {entity: group for group in entities.values() for entity in group}  # its entities of that kind
        self.facts, self.next_entity = [], {}
        for i, relation in enumerate(RELATIONS):  # every film, person and city gets its one chain fact
            for subject in entities[ENTITY_TYPES[i]]:
                self.next_entity[subject] = rng.choice(entities[ENTITY_TYPES[i + 1]])
                self.facts.append((subject, relation, self.next_entity[subject]))
        for _ in range(self.distractor_facts):
            kind = rng.choice(list(DISTRACTORS))
            relation, object_kind = DISTRACTORS[kind]
            subject = rng.choice(entities[kind])
            self.facts.append((subject, relation, rng.choice([e for e in entities[object_kind] if e != subject])))
        rng.shuffle(self.facts)  # the order of facts in a lookup must not give the chain fact away
        start_type = rng.randrange(len(RELATIONS) - self.hops + 1)
        self.hop_entities = [rng.choice(entities[ENTITY_TYPES[start_type]])]  # the entity searched at each hop
        for _ in range(self.hops - 1):
            self.hop_entities.append(self.next_entity[self.hop_entities[-1]])
        answer = self.next_entity[self.hop_entities[-1]]
        self.chain_facts = [fact_text(entity, RELATIONS[start_type + hop], self.next_entity[entity])
                            for hop, entity in enumerate(self.hop_entities)]
        self.found_facts = set()
        question = QUESTIONS[start_type, self.hops].format(self.hop_entities[0])
        return question, [answer], [lookup_tool(self.facts)]

    def is_useful(self, call, output):
        new_facts = {fact for fact in self.chain_facts if fact in output} - self.found_facts
        self.found_facts |= new_facts
        return bool(new_facts)

    def demonstration(self, mistake_rate=0.0, rng=None) -> list[str]:
        """Assistant turns for the current episode (after reset), for the warm-up in sft.py: one search per
        hop, each query the entity the previous result named, then the answer; each decision goes wrong
        with probability `mistake_rate`, the way a weak agent's does."""
        rng = rng or random.Random(0)

        def think(thought):
            return f"<think>{thought}</think>\n" if self.require_think else ""

        def search(entity):
            return think(f"I need the facts about {entity}.") + format_tool_call("search", {"query": entity})

        def answer(entity):
            return think(f"The answer is {entity}.") + f"<answer>{entity}</answer>"

        turns, entity = [], self.hop_entities[0]
        for hop in range(self.hops):
            if hop > 0 and rng.random() < mistake_rate:
                return turns + [answer(entity)]  # stops one hop short: answers the intermediate entity
            if rng.random() < mistake_rate:
                if turns and rng.random() < 0.5:
                    turns.append(turns[-1])  # repeats the last query, wasting a turn
                else:  # searches another entity of the same kind, and follows the wrong chain from there
                    entity = rng.choice([other for other in self.kind_of[entity] if other != entity])
            turns.append(search(entity))
            entity = self.next_entity[entity]
        return turns + [answer(entity)]


def fact_text(subject: str, relation: str, obj: str) -> str:
    """One fact as the search returns it: "Amber: directed by Heron." """
    return f"{subject}: {relation} {obj}."


def lookup_tool(facts: list[tuple[str, str, str]]) -> tools.Tool:
    """A "search" tool over (subject, relation, object) facts: every fact whose subject is the queried name
    (case and surrounding punctuation ignored), or a short "no facts" message. Not BM25: it would also return
    facts naming it as object ("Cedar: directed by Heron." for "Heron"), so one query would not be one hop."""
    def search(query: str) -> str:
        key = query.strip().strip(string.punctuation + " ").lower()
        found = [fact_text(*fact) for fact in facts if fact[0].lower() == key]
        return " ".join(found) if found else f"No facts about {query.strip()}."
    return tools.Tool(name="search", description="Look up a name; returns the facts about it.",
                      parameters=tools.string_parameters("query", "A name."),
                      function=search)

# -----------------------------------------------------------------------------
# Calculator tasks: word problems whose numbers are too large to do in one's head


class CalculatorEnv(ToolEnv):
    """Two-step arithmetic word problems with 3-4 digit numbers and the `calculator` tool. The answer
    is an integer, scored by exact match (SQuAD normalisation also drops a thousands separator)."""
    system_prompt = ("Solve the problem. Use the calculator tool for the arithmetic, then give the "
                     "number as <answer>...</answer>.")

    def new_task(self, rng):
        kind = rng.randrange(3)
        if kind == 0:
            boxes, per_box = rng.randint(100, 999), rng.randint(100, 999)
            given = rng.randint(100, boxes * per_box - 1)
            question = (f"A shop has {boxes} boxes of {per_box} nails each and sells {given} nails. "
                        "How many nails are left?")
            answer = boxes * per_box - given
        elif kind == 1:
            per_hour, hours, days = rng.randint(100, 999), rng.randint(10, 24), rng.randint(10, 99)
            question = (f"A factory makes {per_hour} bolts an hour, {hours} hours a day, for {days} days. "
                        "How many bolts does it make?")
            answer = per_hour * hours * days
        else:
            shelves, per_shelf = rng.randint(12, 99), rng.randint(100, 999)
            bought = rng.randint(100, shelves * per_shelf - 100)
            question = (f"A library has {shelves * per_shelf - bought} books and buys {bought} more. It puts them "
                        f"equally on {shelves} shelves. How many books are on each shelf?")
            answer = per_shelf
        return question, [str(answer)], [tools.calculator_tool()]

# -----------------------------------------------------------------------------
# Computation: answers that need exact arithmetic, with the sandboxed `python` tool

PYTHON_TOOL = tools.python_tool()  # one tool for every episode, so a turn's programs run as one batch


def run_own_program(code: str) -> str:
    """What one of ComputeEnv's own demonstration programs prints, run in this process. The demonstrations are
    our code, not a model's, so they need no sandbox; the warm-up runs thousands of them."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    return printed.getvalue()


DEMONSTRATION_PYTHON_TOOL = replace(PYTHON_TOOL, function=run_own_program, batch_function=None)  # schema kept, run here


class ComputeEnv(ToolEnv):
    """Questions a small model cannot answer in its head: a product of large numbers, the digit sum of a power,
    a count over a range. The agent writes a short program for the `python` tool, reads what it printed and
    answers with the number (exact match). Each kind has one program shape, so a tiny model can learn it."""
    system_prompt = ("Answer the question. Run a short Python program with the python tool that prints the "
                     "result, then give the number as <answer>...</answer>.")
    # A call carries its program (96 tokens); copying a many-digit number takes 4 layers, not 2. The deeper model
    # trains steadily at half the main job's learning rate; from its warm-up a weak agent takes a mistake rate of
    # 0.85 (docs/results.md).
    train_defaults = {"max_new_tokens": 96, "model": "tiny-deep", "lr": 5e-4, "warmup_mistake_rate": 0.85}
    KINDS = {  # kind -> (question, program, the answer), filled in with the task's numbers a, b, c
        "product": ("What is {a} times {b}?", "print({a} * {b})", lambda a, b: a * b),
        "digit_sum": ("What is the sum of the digits of {a} to the power {b}?",
                      "print(sum(int(digit) for digit in str({a} ** {b})))",
                      lambda a, b: sum(int(digit) for digit in str(a ** b))),
        "count": ("How many numbers from {a} to {b} are divisible by {c}?",
                  "print(sum(1 for n in range({a}, {b} + 1) if n % {c} == 0))", lambda a, b, c: b // c - (a - 1) // c),
    }

    def __init__(self, kinds=tuple(KINDS), **options):
        assert kinds and set(kinds) <= set(self.KINDS), f"kinds must be some of {sorted(self.KINDS)}, got {kinds}"
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
            self.numbers = {"a": start, "b": start + rng.randint(100, 9999), "c": rng.randint(3, 97)}
        question, _, solve = self.KINDS[self.kind]
        return question.format(**self.numbers), [str(solve(**self.numbers))], [PYTHON_TOOL]

    def demonstration(self, mistake_rate=0.0, rng=None) -> list[str]:
        """Assistant turns for the current episode (after reset), for sft.py: the kind's program, then the
        number it prints. Each copy goes wrong with probability mistake_rate: a digit of the question miscopied
        into the program, a digit of the printed number miscopied into the answer. The agent always calls the
        tool (a guess instead, as QA's flawed demonstrations make, taught it to stop calling), and RL has the
        copying to sharpen. The episode's python tool becomes DEMONSTRATION_PYTHON_TOOL."""
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
        return [format_tool_call("python", {"code": program.format(**numbers)}), f"<answer>{answer}</answer>"]


def miscopied(number: int, rng) -> int:
    """`number` with one digit replaced by a random nonzero one (sometimes the same): a slip in copying it."""
    digits = list(str(number))
    digits[rng.randrange(len(digits))] = str(rng.randrange(1, 10))
    return int("".join(digits))


def final_number(text: str) -> str | None:
    """The last number in `text` (GSM8K's after "####"), without thousands separators or a trailing ".0"."""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text.split("####")[-1])
    if not numbers:
        return None
    number = numbers[-1].replace(",", "")
    return number[:-2] if number.endswith(".0") else number


def load_math_dataset(source: str, split: str = "train") -> list[dict]:
    """GSM8K-style rows {"question", "answer": "...reasoning... #### 72"} -> {"id", "question", "answers":
    ["72"]}, from a local file (split by local_split) or the Hub ("gsm8k", or a Hub name with its schema)."""
    raw, local = read_rows(source, split)
    rows = []
    for index, row in enumerate(raw):
        answer = final_number(str(row.get("answer") or ""))
        if not row.get("question") or answer is None:
            raise UserError(f"{source}: row {index} needs a question and an answer ending in '#### number'")
        rows.append({"id": str(row.get("id", index)), "question": row["question"], "answers": [answer]})
    return local_split(rows, split) if local else rows


class MathEnv(ToolEnv):
    """Grade-school math word problems (GSM8K) with the `python` tool, for instruct models on GPUs (the tiny
    model learns ComputeEnv instead). Scored by the final number: 72, 72.0 and 1,072's separators agree."""
    system_prompt = ("Solve the problem. You may run Python programs with the python tool. Give the final "
                     "number as <answer>...</answer>.")

    def __init__(self, data, split="train", **options):
        self.rows = cached_dataset(load_math_dataset, data, split) if isinstance(data, (str, Path)) else data
        assert len(self.rows) > 0, "MathEnv needs at least one row"
        super().__init__(**options)

    def new_task(self, rng):
        row = self.rows[self.seed % len(self.rows)]  # seed i is row i, as in SearchQAEnv
        return row["question"], row["answers"], [PYTHON_TOOL]

    def score(self, answer):
        number = final_number(answer)
        em = float(number is not None and float(number) == float(self.answers[0]))
        return {"em": em, "f1": em, "substring_em": em}

# -----------------------------------------------------------------------------
# RAGEN's games: the action is a word in <answer>...</answer>, several per turn joined by "||"


class GameEnv:
    """The shared turn logic of the text games. A subclass sets `rules` and `actions` and implements
    `new_game(rng)`, `move(action) -> (reward, done)` and `render()`; `move` sets self.success.
    Up to `max_actions_per_turn` actions per turn ("Up || Up || Left") is RAGEN's interaction
    granularity; later ones are dropped, and a move that ends the game skips the rest. A malformed turn
    (no <answer>, an unknown action, no leading <think> with `require_think`) executes nothing."""
    rules, actions = "", []
    warmup_options = {}  # as ToolEnv.warmup_options
    train_defaults = {}  # as ToolEnv.train_defaults

    def __init__(self, max_turns=5, max_actions_per_turn=3, format_penalty=-0.1, require_think=False):
        assert max_turns >= 1 and max_actions_per_turn >= 1, "max_turns and max_actions_per_turn must be >= 1"
        self.max_turns, self.max_actions_per_turn = max_turns, max_actions_per_turn
        self.format_penalty, self.require_think = format_penalty, require_think

    def reset(self, seed: int, episode: int = 0) -> tuple[list[dict], list[dict]]:
        """(opening messages, no tools) for `seed`. The luck (slips, payouts) comes from (seed, episode): a GRPO
        group faces one game with independent luck, as in RAGEN (with one coin, std-normalised GRPO would see
        the risky arm lose in 3 groups of 4)."""
        self.turn, self.done, self.success = 0, False, False
        self.new_game(random.Random(seed))
        self.rng = random.Random(f"{seed}/{episode}")  # the transitions' own random stream
        several = (f", up to {self.max_actions_per_turn} actions separated by ||"
                   if self.max_actions_per_turn > 1 else "")
        system = (f"{self.rules} Valid actions: {', '.join(self.actions)}. Reply with <answer>action</answer>{several}."
                  + (THINK_INSTRUCTION if self.require_think else ""))
        return [{"role": "system", "content": system}, {"role": "user", "content": self.render()}], []

    def parse_actions(self, text: str) -> tuple[list[str], str | None]:
        """(the valid actions of a turn, capped, in canonical spelling; or [] and an error message)."""
        thought_first, action_text = split_thinking(text)
        answer = extract_answer(action_text)
        if self.require_think and not thought_first:
            return [], "Invalid reply: begin with your reasoning in <think>...</think>."
        if answer is None:
            return [], f"Invalid reply: give your action as <answer>...</answer>, one of {', '.join(self.actions)}."
        canonical = {action.lower(): action for action in self.actions}  # actions are case-insensitive
        words = [word.strip() for word in answer.split("||")][:self.max_actions_per_turn]
        unknown = [word for word in words if word.lower() not in canonical]
        if unknown:
            return [], f"Invalid action {unknown[0]!r}: valid actions are {', '.join(self.actions)}."
        return [canonical[word.lower()] for word in words], None

    def step(self, assistant_text: str) -> StepResult:
        """Runs the turn's actions in order; the reward is their sum (or the format penalty)."""
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
        info = {"success": self.success, "tool_calls": 0, "invalid_calls": 0, "format_error": error is not None,
                "actions": executed}
        return StepResult([{"role": "user", "content": observation}], reward, self.done, info)

    def demonstration(self, mistake_rate=0.0, rng=None):
        """Warm-up replies, one a turn, read as the env steps: the optimal next actions (`plan()`)
        from each turn's state, each swapped for another with probability `mistake_rate`."""
        rng = rng or random.Random(0)
        while True:
            actions = (self.plan() or [rng.choice(self.actions)])[:self.max_actions_per_turn]
            actions = [rng.choice([a for a in self.actions if a != action])
                       if rng.random() < mistake_rate else action for action in actions]
            yield f"<answer>{' || '.join(actions)}</answer>"


def bfs_path(start, successors, is_goal) -> list | None:
    """Breadth-first search: the fewest actions from `start` to a state with is_goal(state) (None:
    no way); successors(state) yields (action, next state)."""
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
    """Two-armed bandit, one turn. The safe arm always pays `safe_reward` (0.1); the risky arm pays
    `risky_reward` (1.0) with probability `risky_probability` (0.25): worth 0.25 in expectation, so
    it is the better arm. Arm names and their order are drawn from the seed; success means the risky
    arm was picked."""
    rules = "Two slot machines: one pays a little every time, the other pays a lot but rarely. Pull one arm."

    def __init__(self, safe_reward=0.1, risky_reward=1.0, risky_probability=0.25,
                 max_turns=1, max_actions_per_turn=1, **options):
        self.safe_reward, self.risky_reward, self.risky_probability = safe_reward, risky_reward, risky_probability
        super().__init__(max_turns=max_turns, max_actions_per_turn=max_actions_per_turn, **options)

    def new_game(self, rng):
        self.safe_arm, self.risky_arm = rng.choice(SAFE_ARMS), rng.choice(RISKY_ARMS)
        self.actions = rng.sample([self.safe_arm, self.risky_arm], 2)

    def demonstration(self, mistake_rate=0.5, rng=None) -> list[str]:
        """One pull for supervised warm-up: the safe arm with probability `mistake_rate`, else the
        risky one. It teaches the format and leaves the choice of arm to RL."""
        rng = rng or random.Random(0)
        return [f"<answer>{self.safe_arm if rng.random() < mistake_rate else self.risky_arm}</answer>"]

    def move(self, action):
        self.success = action == self.risky_arm
        if self.success:
            return (self.risky_reward if self.rng.random() < self.risky_probability else 0.0), True
        return self.safe_reward, True

    def render(self):
        return f"Arms: {self.actions[0]}, {self.actions[1]}. Which arm do you pull?"


MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}  # (row, column) deltas
PERPENDICULAR = {"Up": ("Left", "Right"), "Down": ("Left", "Right"), "Left": ("Up", "Down"), "Right": ("Up", "Down")}


def shifted(cell, action):
    """The cell one move away from `cell`."""
    return cell[0] + MOVES[action][0], cell[1] + MOVES[action][1]


class FrozenLakeEnv(GameEnv):
    """Walk from the start to the goal without falling into a hole. Maps are random per seed (each
    cell but start and goal is a hole with `hole_probability`) and redrawn until a path exists.
    Walking into the edge leaves you in place. With `slippery=True` the intended move happens with
    p = 1/3, else one of the two perpendicular moves (1/3 each), as in Gym's FrozenLake. Reward 1 on
    reaching the goal; a hole ends the episode with 0. One move a turn by default: the next step of
    a path is what the tiny model learns, and a slip is seen before the next move."""
    rules = "FrozenLake: you are P; walk to the goal G over the ice _ without stepping into a hole O."
    actions = ["Left", "Down", "Right", "Up"]
    train_defaults = {"max_turns": 8, "warmup_mistake_rate": 0.3, "lr": 5e-4}

    def __init__(self, size=4, hole_probability=0.2, slippery=False, max_turns=8,
                 max_actions_per_turn=1, **options):
        self.size, self.hole_probability, self.slippery = size, hole_probability, slippery
        super().__init__(max_turns=max_turns, max_actions_per_turn=max_actions_per_turn, **options)

    def successors(self, cell):
        for action in self.actions:
            following = self.clamp(shifted(cell, action))
            if following not in self.holes:
                yield action, following

    def clamp(self, cell):
        return min(max(cell[0], 0), self.size - 1), min(max(cell[1], 0), self.size - 1)

    def new_game(self, rng):
        cells = [(row, column) for row in range(self.size) for column in range(self.size)]
        while True:
            self.start, self.goal = rng.sample(cells, 2)
            self.holes = {c for c in cells if c not in (self.start, self.goal) and rng.random() < self.hole_probability}
            if self.shortest_path(self.start) is not None:
                break
        self.player = self.start

    def shortest_path(self, cell):
        return bfs_path(cell, self.successors, lambda cell: cell == self.goal)

    def reach_probabilities(self, moves):
        """({cell: the best chance to reach the goal in `moves` moves}, {cell: the best action}),
        by value iteration."""
        cells = [(row, column) for row in range(self.size) for column in range(self.size)]
        chance, best = {cell: float(cell == self.goal) for cell in cells}, {}
        for _ in range(moves):
            def action_value(cell, action):
                ways = (action, *PERPENDICULAR[action]) if self.slippery else (action,)
                return sum(chance[self.clamp(shifted(cell, way))] for way in ways) / len(ways)
            best = {cell: max(self.actions, key=lambda action: action_value(cell, action))
                    for cell in cells}
            chance = {cell: float(cell == self.goal) if cell == self.goal or cell in self.holes
                      else action_value(cell, best[cell]) for cell in cells}
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
            return "P" if cell == self.player else "G" if cell == self.goal else "O" if cell in self.holes else "_"
        return "\n".join("".join(symbol((row, column)) for column in range(self.size)) for row in range(self.size))


class SokobanEnv(GameEnv):
    """Push the one box onto the target in a walled size x size room with `interior_walls` extra walls;
    levels are random per seed, redrawn until a breadth-first search over (player, box) states proves them
    solvable. Rewards (gym-sokoban's, as in RAGEN): `step_reward` -0.1 per move (a bump into a wall too),
    `box_on_target_reward` +1 and `solved_reward` +10 when the box lands on the target, which with one box
    also ends the game (so the -1 for pushing a box off a target never arises here)."""
    rules = ("Sokoban: you are P; push the box X onto the target O. # is a wall, _ is floor. You can push the "
             "box but not pull it. * is the box on the target, + is you on the target.")
    actions = ["Up", "Down", "Left", "Right"]
    # Five turns of three moves reach 97% of the levels; their grids take 640 tokens.
    train_defaults = {"max_turns": 5, "max_total_tokens": 640, "warmup_mistake_rate": 0.2,
                      "lr": 5e-4}

    def __init__(self, size=6, interior_walls=2, step_reward=-0.1, box_on_target_reward=1.0,
                 solved_reward=10.0, max_turns=10, **options):
        self.size, self.interior_walls = size, interior_walls
        self.step_reward, self.solved_reward = step_reward, solved_reward
        self.box_on_target_reward = box_on_target_reward
        super().__init__(max_turns=max_turns, **options)

    def transition(self, player, box, action):
        """(player, box) after one move: a wall stops you, a box moves if the cell beyond it is free."""
        ahead = shifted(player, action)
        if ahead in self.walls:
            return player, box
        if ahead == box:
            beyond = shifted(box, action)
            return (player, box) if beyond in self.walls else (ahead, beyond)
        return ahead, box

    def new_game(self, rng):
        edges = (0, self.size - 1)
        border = {(r, c) for r in range(self.size) for c in range(self.size) if r in edges or c in edges}
        interior = [(r, c) for r in range(1, self.size - 1) for c in range(1, self.size - 1)]
        while True:
            cells = rng.sample(interior, self.interior_walls + 3)
            self.walls = border | set(cells[3:])
            self.player, self.box, self.target = cells[:3]
            if self.plan() is not None:
                break

    def plan(self):
        """The fewest moves that push the box onto the target (None: it is stuck)."""
        return bfs_path((self.player, self.box), self.successors,
                        lambda state: state[1] == self.target)

    def successors(self, state):
        return ((action, self.transition(*state, action)) for action in self.actions)

    def move(self, action):
        self.player, box = self.transition(self.player, self.box, action)
        pushed_on = box != self.box and box == self.target
        self.box, self.success = box, box == self.target
        return self.step_reward + pushed_on * (self.box_on_target_reward + self.solved_reward), self.success

    def render(self):
        def symbol(cell):
            if cell in self.walls:
                return "#"
            if cell == self.box:
                return "*" if cell == self.target else "X"
            if cell == self.player:
                return "+" if cell == self.target else "P"
            return "O" if cell == self.target else "_"
        return "\n".join("".join(symbol((r, c)) for c in range(self.size)) for r in range(self.size))


ENVS = {"search_qa": SearchQAEnv, "synthetic_qa": SyntheticQAEnv, "calculator": CalculatorEnv,
        "compute": ComputeEnv, "math": MathEnv, "bandit": BanditEnv, "frozen_lake": FrozenLakeEnv,
        "sokoban": SokobanEnv}
DATA_ENVS = (SearchQAEnv, MathEnv)  # their tasks come from --data


def env_factory(name, options=None, data=None, split="train"):
    """A zero-argument callable that builds a fresh `name` env per episode (what rollout() takes).
    `options` are the env's constructor keywords; `data` and `split` are for the DATA_ENVS only."""
    assert name in ENVS, f"unknown env {name!r}; choose from {sorted(ENVS)}"
    env_class, options = ENVS[name], dict(options or {})
    if env_class in DATA_ENVS:
        assert data is not None, f"{name} needs data: a Hub name (hotpotqa, musique, gsm8k, ...) or a local file"
        options = {"data": data, "split": split, **options}
    return lambda: env_class(**options)
