"""Tests for envs.py: hand-worked transitions, reward sums, format penalties, solvability by an
independent BFS, slip frequencies, answer normalisation, and the dataset loaders on shipped samples."""
import hashlib
import json
import random
import re
import threading
from collections import Counter, deque
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers.utils import get_json_schema

import envs
import tools
from nanoagent import sandbox
from nanoagent.common import UserError

DATA = Path(__file__).parent / "data"


def search_call(query):
    return envs.format_tool_call("search", {"query": query})

# -----------------------------------------------------------------------------
# Answer scoring


def test_normalize_answer_follows_squad():
    assert envs.normalize_answer("The  Danube!") == "danube"
    assert envs.normalize_answer("An apple, a day") == "apple day"
    assert envs.normalize_answer("Theory of the Leisure Class") == "theory of leisure class"  # "the" only as a word
    assert envs.normalize_answer("12,345") == "12345"


def test_exact_match_and_f1_scores():
    assert envs.exact_match("the Danube", ["Danube"]) == 1.0
    assert envs.exact_match("Danube river", ["Danube"]) == 0.0
    assert envs.exact_match("sol", ["Peruvian sol", "sol"]) == 1.0  # any alias counts
    assert envs.f1_score("Peruvian sol currency", ["Peruvian sol"]) == pytest.approx(0.8)  # p = 2/3, r = 1
    assert envs.f1_score("sol", ["Peruvian sol", "boliviano"]) == pytest.approx(2 / 3)  # p = 1, r = 1/2
    assert envs.f1_score("Rhine", ["Danube"]) == 0.0


def test_eval_seeds_are_disjoint_from_training_seeds():
    assert list(envs.eval_seeds(3)) == [10_000_000, 10_000_001, 10_000_002]
    assert envs.EVAL_SEED_START == 10_000_000
    assert list(envs.eval_seeds(2, "math")) == [0, 1]  # a dataset's held-out rows, from the first

# -----------------------------------------------------------------------------
# Synthetic multi-hop QA


def test_synthetic_search_schema_equals_transformers_schema_of_a_documented_function():
    # What bench/bench_trl.py relies on: TRL renders the same tool from a Python method's docstring.
    def search(query: str):
        """Look up a name; returns the facts about it.

        Args:
            query: A name.
        """
    _, schemas = envs.SyntheticQAEnv().reset(0)
    assert json.dumps(schemas) == json.dumps([get_json_schema(search)])


def test_synthetic_two_hop_question_solved_by_two_searches():
    env = envs.SyntheticQAEnv(hops=2)
    messages, tool_schemas = env.reset(3)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == "Where was the director of Oak born?"
    assert [schema["function"]["name"] for schema in tool_schemas] == ["search"]
    first = env.step(search_call("Oak"))
    assert first.observations == [{"role": "tool", "content": "Oak: directed by Fable."}]
    assert (first.reward, first.done, first.info["tool_calls"], first.info["success"]) == (0.0, False, 1, False)
    second = env.step(search_call("fable"))  # the lookup ignores case
    assert second.observations == [{"role": "tool", "content": "Fable: born in Aspen."}]
    final = env.step("<answer>Aspen</answer>")
    assert final.observations == [] and final.done and final.reward == 1.0
    assert final.info["success"] and final.info["em"] == 1.0 and final.info["answer"] == "Aspen"


def test_synthetic_chain_followed_by_reading_observations_only():
    """Follow the chain the way a model must: each query is the object of the previous result."""
    for seed in range(30):
        env = envs.SyntheticQAEnv(hops=3)
        messages, _ = env.reset(seed)
        question = messages[1]["content"]
        assert question.startswith("In which country was the director of ")
        entity = question.split()[-2]  # "... of Oak born?" -> "Oak"
        for relation in ["directed by", "born in", "located in"]:
            (observation,) = env.step(search_call(entity)).observations
            match = re.fullmatch(rf"{entity}: {relation} ([A-Z][a-z]+)\.", observation["content"])
            assert match, observation
            entity = match.group(1)
        assert env.step(f"<answer>{entity}</answer>").info["success"]


def test_synthetic_demonstration_solves_every_episode():
    for hops in (1, 2, 3):
        for seed in range(40):
            env = envs.SyntheticQAEnv(hops=hops, distractor_facts=4)
            env.reset(seed)
            turns = env.demonstration()
            assert len(turns) == hops + 1
            results = [env.step(turn) for turn in turns]
            assert results[-1].done and results[-1].info["success"]
            assert sum(r.reward for r in results) == 1.0


def test_synthetic_names_are_drawn_per_seed_and_kb_changes_with_seed():
    env = envs.SyntheticQAEnv(entities_per_type=4, distractor_facts=3)
    env.reset(0)
    names = {name for subject, _, obj in env.facts for name in (subject, obj)}
    assert 12 < len(names) <= 16  # 4 films, persons and cities are subjects; the 4 countries may not all be named
    assert names <= set(envs.NAMES) and all(name.isalpha() and name[0].isupper() for name in names)
    assert len(env.facts) == 3 * 4 + 3  # one chain fact per film, person and city, plus distractors
    other = envs.SyntheticQAEnv(entities_per_type=4, distractor_facts=3)
    other.reset(1)
    assert other.facts != env.facts
    again = envs.SyntheticQAEnv(entities_per_type=4, distractor_facts=3)
    assert again.reset(0) == env.reset(0) and again.facts == env.facts  # deterministic given the seed


def test_distractor_facts_come_back_with_the_chain_fact():
    env = envs.SyntheticQAEnv(hops=1, entities_per_type=2, distractor_facts=30)
    env.reset(5)
    (observation,) = env.step(search_call(env.hop_entities[0])).observations
    assert env.chain_facts[0] in observation["content"] and len(observation["content"]) > len(env.chain_facts[0])


def test_reward_accounting_with_process_and_format_rewards():
    env = envs.SyntheticQAEnv(hops=2, process_reward=0.2, format_reward=0.05, max_turns=6)
    env.reset(3)  # Where was the director of Oak born? Oak -> Fable -> Aspen
    rewards = [env.step(search_call("Oak")).reward,   # new hop fact: 0.05 + 0.2
               env.step(search_call("Oak")).reward,   # repeated call: 0.05
               env.step("I am not sure.").reward,      # no action: -0.1
               env.step(search_call("Nobody")).reward,   # no such entity: well-formed, useless: 0.05
               env.step(search_call("Fable")).reward]   # second hop fact: 0.05 + 0.2
    final = env.step("<answer>aspen</answer>")          # correct: 1 + 0.05
    assert rewards == pytest.approx([0.25, 0.05, -0.1, 0.05, 0.25])
    assert final.reward == pytest.approx(1.05) and final.done
    assert sum(rewards) + final.reward == pytest.approx(1.55)


def test_wrong_answer_ends_episode_without_outcome_reward():
    env = envs.SyntheticQAEnv(format_reward=0.05)
    env.reset(3)
    result = env.step("<answer>Fable</answer>")
    assert result.done and not result.info["success"]
    assert result.reward == pytest.approx(0.05) and result.info["em"] == 0.0


def test_turn_without_action_gets_format_penalty_and_explanation():
    env = envs.SyntheticQAEnv()
    env.reset(0)
    result = env.step("The answer must be somewhere.")
    assert result.reward == -0.1 and result.info["format_error"] and not result.done
    (observation,) = result.observations
    assert observation["role"] == "user"
    assert "<tool_call>" in observation["content"] and "<answer>" in observation["content"]


def test_end_on_format_error_ends_the_episode_at_the_first_malformed_turn():
    for reply in ("The answer must be somewhere.", '<tool_call>\n{"name": "search", "arguments": {"query": "Oak'):
        env = envs.SyntheticQAEnv(end_on_format_error=True)
        env.reset(3)
        result = env.step(reply)
        assert result.done and result.reward == -0.1 and result.info["format_error"] and not result.info["success"]
    env = envs.SyntheticQAEnv(end_on_format_error=True)
    env.reset(3)
    assert not env.step(search_call("Oak")).done  # a well-formed turn goes on as usual


def test_invalid_tool_calls_are_counted_and_explained():
    env = envs.SyntheticQAEnv()
    env.reset(0)
    bad_argument = '<tool_call>\n{"name": "search", "arguments": {"q": "Felo"}}\n</tool_call>'
    result = env.step(bad_argument + "\n<tool_call>{not json}</tool_call>")
    assert result.info["tool_calls"] == 2 and result.info["invalid_calls"] == 2 and result.info["format_error"]
    assert result.reward == -0.1
    assert [o["role"] for o in result.observations] == ["tool", "tool"]
    assert all(o["content"].startswith("Error:") for o in result.observations)
    # One valid call among invalid ones makes a well-formed turn.
    mixed = env.step(bad_argument + "\n" + search_call("Felo"))
    assert mixed.info["invalid_calls"] == 1 and not mixed.info["format_error"] and mixed.reward == 0.0


def test_max_turns_ends_the_episode():
    env = envs.SyntheticQAEnv(max_turns=2)
    env.reset(3)
    assert not env.step(search_call("Oak")).done
    last = env.step(search_call("Fable"))
    assert last.done and last.reward == 0.0 and not last.info["success"]
    with pytest.raises(AssertionError):
        env.step("<answer>Aspen</answer>")


def test_require_think_format():
    env = envs.SyntheticQAEnv(require_think=True)
    messages, _ = env.reset(3)
    assert "<think>" in messages[0]["content"]
    result = env.step(search_call("Oak"))  # no thinking first
    assert result.info["format_error"] and result.reward == -0.1 and result.info["tool_calls"] == 0
    assert "<think>" in result.observations[0]["content"]
    turns = env.demonstration()
    assert all(turn.startswith("<think>") for turn in turns)
    assert [env.step(turn).reward for turn in turns][-1] == 1.0


def test_actions_inside_thinking_do_not_count():
    env = envs.SyntheticQAEnv()
    env.reset(3)
    result = env.step("<think>maybe <answer>Aspen</answer>?</think> I should check first.")
    assert result.info["format_error"] and not result.done and result.info["answer"] is None

# -----------------------------------------------------------------------------
# Search QA and the dataset loaders


def test_loaders_read_the_shipped_samples():
    hotpot = envs.load_qa_dataset(str(DATA / "hotpotqa_sample.jsonl"), split="all")
    assert len(hotpot) == 2
    assert hotpot[0] == {
        "id": "hp-sample-1", "question": "Which river flows through the capital of Austria?",
        "answers": ["Danube"],
        "paragraphs": [
            {"title": "Austria",
             "text": "Austria is a landlocked country in Central Europe. Its capital and largest city is Vienna."},
            {"title": "Vienna",
             "text": "Vienna is the largest city of Austria. The city lies on both banks of the Danube."},
            {"title": "Budapest", "text": "Budapest is the capital of Hungary. It is also built on the Danube."},
            {"title": "Rhine",
             "text": "The Rhine is a river that rises in the Swiss Alps. It flows into the North Sea."}],
        "supporting_titles": ["Austria", "Vienna"]}
    wiki = envs.load_qa_dataset(str(DATA / "2wikimultihopqa_sample.json"), split="all")
    assert [row["id"] for row in wiki] == ["2wiki-sample-1", "2wiki-sample-2"]
    assert wiki[0]["answers"] == ["Greta Marten"] and wiki[0]["supporting_titles"] == ["Quiet Harbour", "Ilse Marten"]
    assert wiki[0]["paragraphs"][0] == {
        "title": "Quiet Harbour", "text": "Quiet Harbour is a 1961 drama film. It was directed by Ilse Marten."}
    musique = envs.load_qa_dataset(str(DATA / "musique_sample.jsonl"), split="all", limit=1)
    assert len(musique) == 1
    assert musique[0]["answers"] == ["Peruvian sol", "sol", "PEN"]
    assert musique[0]["supporting_titles"] == ["Puno", "Peru"]
    assert musique[0]["paragraphs"][2] == {
        "title": "Bolivia", "text": "Bolivia shares Lake Titicaca with Peru. Its currency is the boliviano."}


def test_parquet_and_dict_layout_2wiki_rows(tmp_path):
    import datasets
    path = tmp_path / "hotpot.parquet"
    datasets.load_dataset("json", data_files=str(DATA / "hotpotqa_sample.jsonl"), split="train").to_parquet(str(path))
    assert envs.load_qa_dataset(str(path)) == envs.load_qa_dataset(str(DATA / "hotpotqa_sample.jsonl"))
    hf_2wiki_row = {"_id": "x", "question": "Q?", "answer": "A", "type": "comparison",
                    "context": {"title": ["T1", "T2"], "content": [["One.", "Two."], ["Three."]]},
                    "supporting_facts": {"title": ["T2"], "sent_id": [0]},
                    "evidences": {"fact": [], "relation": [], "entity": []}}
    assert envs.normalize_qa_row(hf_2wiki_row) == {
        "id": "x", "question": "Q?", "answers": ["A"], "supporting_titles": ["T2"],
        "paragraphs": [{"title": "T1", "text": "One. Two."}, {"title": "T2", "text": "Three."}]}


def write_rows(path, count, drop=None):
    """A local HotpotQA-style file of `count` rows; row 3 lacks the field `drop`."""
    rows = [{"id": f"q{index}", "question": f"Question {index}?", "answer": f"A{index}",
             "context": [[f"T{index}", [f"Text {index}."]]], "supporting_facts": [[f"T{index}", 0]]}
            for index in range(count)]
    if drop:
        del rows[3][drop]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def test_a_local_file_holds_out_a_fixed_share_for_validation(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", 50)
    train = envs.load_qa_dataset(str(tmp_path / "rows.jsonl"), split="train")
    validation = envs.load_qa_dataset(str(tmp_path / "rows.jsonl"), split="held-out")
    assert len(validation) == 5 and len(train) == 45  # HELD_OUT_SHARE of the rows
    assert {row["id"] for row in train} | {row["id"] for row in validation} == {row["id"] for row in rows}
    assert not {row["id"] for row in train} & {row["id"] for row in validation}  # never trained on
    # The split follows the rows' ids, not their order in the file: shuffled, the same rows are held out.
    shuffled = tmp_path / "shuffled.jsonl"
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    shuffled.write_text("\n".join(lines[::-1]) + "\n")
    again = envs.load_qa_dataset(str(shuffled), split="held-out")
    assert sorted(row["id"] for row in again) == sorted(row["id"] for row in validation)
    # Reference: the 5 ids with the lowest hash, computed here by hand.
    digests = {row["id"]: hashlib.blake2b(row["id"].encode(), digest_size=8).digest() for row in rows}
    lowest = sorted(digests, key=lambda row_id: int.from_bytes(digests[row_id], "little"))[:5]
    assert sorted(row["id"] for row in validation) == sorted(lowest)
    # Training and evaluation envs read disjoint rows; "all" is every row (a file of held-out questions).
    make_train = envs.env_factory("search_qa", {}, data=str(tmp_path / "rows.jsonl"), split="train")
    make_eval = envs.env_factory(
        "search_qa", {}, data=str(tmp_path / "rows.jsonl"), split="held-out"
    )
    asked = lambda make, seeds: {make().reset(seed)[0][1]["content"] for seed in seeds}
    assert not asked(make_train, range(100)) & asked(make_eval, envs.eval_seeds(16))
    assert len(envs.load_qa_dataset(str(tmp_path / "rows.jsonl"), split="all")) == 50


# The named Hub datasets' splits, as their dataset cards list them: GSM8K has no validation.
HUB_SPLITS = {
    "hotpotqa/hotpot_qa": ["train", "validation"],
    "framolfese/2WikiMultihopQA": ["train", "validation"],
    "dgslibisey/MuSiQue": ["train", "validation"],
    "openai/gsm8k": ["train", "test"],
}


def fake_hub(monkeypatch, rows):
    """datasets.load_dataset answering for HUB_SPLITS's datasets with `rows`, and raising as the
    real one does for a split the dataset lacks; the list it returns records each ask."""
    import datasets
    asked = []

    def load_dataset(name, config=None, split=None):
        asked.append((name, config, split))
        if split not in HUB_SPLITS[name]:
            raise ValueError(f'Unknown split "{split}". Should be one of {HUB_SPLITS[name]}.')
        return rows
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return asked


def test_each_named_hub_dataset_is_asked_only_for_splits_it_has(monkeypatch):
    asked = fake_hub(monkeypatch, [])
    for short_name in ("hotpotqa", "2wikimultihopqa", "musique", "gsm8k"):
        for split in ("train", "held-out"):
            assert envs.read_rows(short_name, split) == ([], False)
    assert asked == [
        ("hotpotqa/hotpot_qa", "distractor", "train"),
        ("hotpotqa/hotpot_qa", "distractor", "validation"),
        ("framolfese/2WikiMultihopQA", None, "train"),
        ("framolfese/2WikiMultihopQA", None, "validation"),
        ("dgslibisey/MuSiQue", None, "train"), ("dgslibisey/MuSiQue", None, "validation"),
        ("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test"),  # no validation
    ]


def test_the_readme_gsm8k_commands_held_out_evaluation_reads_gsm8ks_test_split(monkeypatch):
    import eval as evaluation  # here: only this test needs the trainer and eval.py
    import train
    rows = [json.loads(line) for line in (DATA / "gsm8k_sample.jsonl").read_text().splitlines()]
    asked = fake_hub(monkeypatch, rows)
    args = train.get_args([
        "--model", "Qwen/Qwen2.5-3B-Instruct", "--warmup_steps", "0", "--sampler", "vllm",
        "--env", "math", "--data", "gsm8k", "--lr", "1e-6", "--max_new_tokens", "512",
        "--max_total_tokens", "4096",
    ])
    questions = []

    def rollout(sampler, tokenizer, make_env, seeds, *settings, **options):
        questions.extend(make_env().reset(seed)[0][1]["content"] for seed in seeds[:3])
        return [SimpleNamespace(info={"success": True}, score=1.0)]
    monkeypatch.setattr(train.rollout, "rollout", rollout)
    envs.cached_dataset.cache_clear()  # "gsm8k" must come from the fake Hub, and not stay
    try:
        assert evaluation.evaluate_held_out(None, None, args) == {"eval_success": 1.0, "eval_score": 1.0}
    finally:
        envs.cached_dataset.cache_clear()
    assert asked == [("openai/gsm8k", "main", "test")]
    assert questions == [row["question"] for row in rows[:3]]


@pytest.mark.parametrize("layout", ["save_to_disk", "hub_parquet"])
@pytest.mark.parametrize("splits, held_out", [(("train", "test"), "test"),
                                              (("train", "validation", "test"), "validation")])
def test_a_local_dataset_directory_holds_out_its_own_split(tmp_path, layout, splits, held_out):
    import datasets
    rows = [json.loads(line) for line in (DATA / "gsm8k_sample.jsonl").read_text().splitlines()]
    parts = {"train": rows[:4], "validation": rows[4:6], "test": rows[6:]}
    dataset = datasets.DatasetDict(
        {split: datasets.Dataset.from_list(parts[split]) for split in splits}
    )
    if layout == "save_to_disk":
        dataset.save_to_disk(tmp_path / "gsm8k")
    else:  # a repository as the Hub lays it out
        for split in splits:
            path = tmp_path / "gsm8k" / "data" / f"{split}-00000-of-00001.parquet"
            dataset[split].to_parquet(path)
    source = str(tmp_path / "gsm8k")
    question = lambda split: [row["question"] for row in envs.load_math_dataset(source, split)]
    assert question("train") == [row["question"] for row in parts["train"]]
    assert question("held-out") == [row["question"] for row in parts[held_out]]
    make_env = envs.env_factory("math", {}, data=source, split="held-out")
    assert make_env().reset(1)[0][1]["content"] == parts[held_out][1]["question"]


@pytest.mark.parametrize("drop, field", [("question", "'question'"), ("answer", "'answer'"),
                                         ("context", "'context (or paragraphs)'")])
def test_a_row_without_a_field_names_the_row_and_the_field(tmp_path, drop, field):
    write_rows(tmp_path / "rows.jsonl", 6, drop=drop)
    with pytest.raises(UserError, match=rf"row 3 \(id 'q3'\) has no {re.escape(field)} field"):
        envs.load_qa_dataset(str(tmp_path / "rows.jsonl"))
    with pytest.raises(UserError, match="does not exist"):
        envs.load_qa_dataset(str(tmp_path / "missing.jsonl"))


def test_search_qa_episode_with_process_reward():
    rows = envs.load_qa_dataset(str(DATA / "hotpotqa_sample.jsonl"), split="all")
    env = envs.SearchQAEnv(rows, process_reward=0.1, top_k=2)
    messages, tool_schemas = env.reset(0)  # seed i is row i
    assert messages[1]["content"] == rows[0]["question"] and tool_schemas[0]["function"]["name"] == "search"
    found = env.step(search_call("capital of Austria"))
    assert "Vienna" in found.observations[0]["content"] and found.reward == pytest.approx(0.1)
    nothing_new = env.step(search_call("Austria capital city Vienna"))  # same gold passages again
    assert nothing_new.reward == 0.0
    final = env.step("<answer>the Danube</answer>")
    assert final.done and final.info["success"] and final.reward == 1.0
    assert envs.SearchQAEnv(rows).reset(3)[0][1]["content"] == rows[1]["question"]


def corpus_from_rows(rows):
    """The rows' paragraphs, deduplicated: a shared corpus without a Wikipedia dump."""
    return list({(p["title"], p["text"]): p for row in rows for p in row["paragraphs"]}.values())


def test_search_qa_from_a_path_with_a_shared_corpus():
    rows = envs.load_qa_dataset(str(DATA / "2wikimultihopqa_sample.json"), split="all")
    corpus = corpus_from_rows(rows)
    assert len(corpus) == 3  # the two rows share the two Harbour paragraphs
    env = envs.SearchQAEnv(str(DATA / "2wikimultihopqa_sample.json"), split="all",
                           search=tools.search_tool(corpus, top_k=1))
    env.reset(0)
    assert "Ilse Marten" in env.step(search_call("director of Quiet Harbour")).observations[0]["content"]
    result = env.step("<answer>Greta</answer>")
    assert result.info["em"] == 0.0 and result.info["f1"] == pytest.approx(2 / 3) and result.reward == 0.0


def test_search_qa_over_a_saved_index_or_a_server_shares_one_tool_and_steps_in_one_batch(tmp_path):
    from nanoagent.retrieval import BM25Retriever, make_server
    rows = envs.load_qa_dataset(str(DATA / "hotpotqa_sample.jsonl"))
    BM25Retriever.build(corpus_from_rows(rows), tmp_path / "index")
    server = make_server(BM25Retriever.load(tmp_path / "index"), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    try:
        for retriever in (str(tmp_path / "index"), url):
            group = [envs.SearchQAEnv(rows, retriever=retriever, process_reward=0.1) for _ in range(3)]
            for env in group:
                env.reset(0)
            assert group[0].tools["search"] is group[2].tools["search"]  # one tool, so one batch per turn
            turns = [search_call("capital of Austria"), "no action", search_call("capital of Austria")]
            batched = envs.step_envs(group, turns)
            alone = envs.SearchQAEnv(rows, retriever=retriever, process_reward=0.1)
            alone.reset(0)
            assert batched[0] == batched[2] == alone.step(turns[0])
            assert "Vienna" in batched[0].observations[0]["content"] and batched[0].reward == pytest.approx(0.1)
            assert batched[1].info["format_error"]
    finally:
        server.shutdown()
        server.server_close()


# -----------------------------------------------------------------------------
# Calculator tasks


def test_calculator_questions_have_the_right_answers():
    """An independent reading of each template's numbers."""
    for seed in range(200):
        env = envs.CalculatorEnv()
        messages, _ = env.reset(seed)
        question = messages[1]["content"]
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        if "left" in question:
            expected = numbers[0] * numbers[1] - numbers[2]
        elif "bolts" in question:
            expected = numbers[0] * numbers[1] * numbers[2]
        else:
            assert (numbers[0] + numbers[1]) % numbers[2] == 0, question
            expected = (numbers[0] + numbers[1]) // numbers[2]
        assert env.answers == [str(expected)] and expected > 0 and max(numbers) >= 100


def test_calculator_episode():
    env = envs.CalculatorEnv()
    messages, tool_schemas = env.reset(1)
    assert tool_schemas == [tools.calculator_tool().schema()]
    numbers = re.findall(r"\d+", messages[1]["content"])
    result = env.step(envs.format_tool_call("calculator", {"expression": " * ".join(numbers)}))
    assert result.observations[0]["role"] == "tool" and result.reward == 0.0
    wrong = env.step(f"<answer>{result.observations[0]['content']}</answer>")
    assert wrong.done and wrong.reward == float(wrong.info["success"])

# -----------------------------------------------------------------------------
# RAGEN's games


def test_bandit_rewards_and_success():
    orders, safe_rewards, risky_wins = set(), set(), []
    for seed in range(3000):
        env = envs.BanditEnv()
        messages, tools_given = env.reset(seed)
        assert tools_given == []
        arms = re.fullmatch(r"Arms: (\w+), (\w+)\. Which arm do you pull\?", messages[1]["content"]).groups()
        risky = next(arm for arm in arms if arm in envs.RISKY_ARMS)
        safe = next(arm for arm in arms if arm in envs.SAFE_ARMS)
        orders.add(arms.index(risky))
        pick = risky if seed % 2 else safe.lower()  # names are case-insensitive
        result = env.step(f"<answer>{pick}</answer>")
        assert result.done and result.info["success"] == (pick == risky)
        if pick == risky:
            risky_wins.append(result.reward)
        else:
            safe_rewards.add(result.reward)
    assert orders == {0, 1} and safe_rewards == {0.1}
    assert set(risky_wins) == {0.0, 1.0}
    assert sum(risky_wins) / len(risky_wins) == pytest.approx(0.25, abs=0.03)  # 1500 draws: std 0.011


def test_bandit_advantages_prefer_the_risky_arm_with_independent_coins():
    """GRPO groups of 16 share a seed, 8 members pull each arm; the mean advantage of the risky pulls
    is the direction GRPO moves the policy. With one coin per group std-normalised advantages favour
    the safe arm; with a coin per member (its episode), or with mean-centred advantages, the risky arm wins."""
    def mean_risky_advantage(per_member_coin, scale_by_std):
        advantages = []
        for group in range(300):
            rewards = []
            for member in range(16):
                env = envs.BanditEnv()
                env.reset(group, member=member if per_member_coin else 0)
                rewards.append(env.step(f"<answer>{env.risky_arm if member < 8 else env.safe_arm}</answer>").reward)
            mean = sum(rewards) / 16
            std = (sum((r - mean) ** 2 for r in rewards) / 15) ** 0.5 if scale_by_std else 1.0
            advantages += [(r - mean) / (std + 1e-6) for r in rewards[:8]]
        return sum(advantages) / len(advantages)
    assert mean_risky_advantage(per_member_coin=False, scale_by_std=True) < -0.3  # about -0.48
    assert mean_risky_advantage(per_member_coin=True, scale_by_std=True) > 0.05  # about +0.12
    assert mean_risky_advantage(per_member_coin=False, scale_by_std=False) > 0.02  # about +0.075, noisy
    assert mean_risky_advantage(per_member_coin=True, scale_by_std=False) > 0.04  # about +0.075


def test_bandit_unknown_arm_is_a_format_error():
    env = envs.BanditEnv()
    messages, _ = env.reset(0)
    result = env.step("<answer>Horse</answer>")
    assert result.done and result.reward == -0.1 and result.info["format_error"] and not result.info["success"]
    observation = result.observations[0]["content"]
    assert "Horse" in observation and all(arm in observation for arm in env.actions)


def set_lake(env, text):
    """Replaces the generated FrozenLake map by a hand-drawn one."""
    rows = text.split()
    env.size = len(rows)
    cells = {(r, c): char for r, row in enumerate(rows) for c, char in enumerate(row)}
    env.player = next(cell for cell, char in cells.items() if char == "P")
    env.goal = next(cell for cell, char in cells.items() if char == "G")
    env.holes = {cell for cell, char in cells.items() if char == "O"}


def test_frozen_lake_path_to_the_goal():
    env = envs.FrozenLakeEnv(max_actions_per_turn=3)
    env.reset(0)
    set_lake(env, "P___ _O_O ___O O__G")
    bump = env.step("<answer>Up</answer>")  # the edge: stay in place
    assert bump.reward == 0.0 and not bump.done and env.player == (0, 0)
    first = env.step("<answer>Down || Down || right</answer>")
    assert first.observations[0]["content"] == "____\n_O_O\n_P_O\nO__G"
    assert (first.reward, first.done, first.info["actions"]) == (0.0, False, 3)
    second = env.step("<answer>Right || Down || Right</answer>")
    assert second.reward == 1.0 and second.done and second.info["success"]


def test_frozen_lake_hole_ends_the_episode_and_skips_later_actions():
    env = envs.FrozenLakeEnv(max_actions_per_turn=2)
    env.reset(0)
    set_lake(env, "_P__ _O_O ___O O__G")
    result = env.step("<answer>Down || Right || Right</answer>")
    assert result.done and result.reward == 0.0 and not result.info["success"] and result.info["actions"] == 1


def test_frozen_lake_action_cap_and_max_turns():
    env = envs.FrozenLakeEnv(max_turns=2, max_actions_per_turn=2)
    env.reset(0)
    set_lake(env, "P___ ____ ____ ___G")
    result = env.step("<answer>Right || Right || Right</answer>")
    assert result.info["actions"] == 2 and env.player == (0, 2) and not result.done
    malformed = env.step("Right")
    assert malformed.done and malformed.reward == -0.1 and malformed.info["format_error"]
    assert "<answer>" in malformed.observations[0]["content"] and env.player == (0, 2)


def test_frozen_lake_slip_frequencies():
    displacements = Counter()
    for seed in range(3000):
        env = envs.FrozenLakeEnv(slippery=True)
        env.reset(seed)
        set_lake(env, "____ _P__ ____ ___G")
        env.step("<answer>Down</answer>")
        displacements[env.player[0] - 1, env.player[1] - 1] += 1
    assert set(displacements) == {(1, 0), (0, -1), (0, 1)}  # down, or a slip left or right; never up
    for count in displacements.values():
        assert count / 3000 == pytest.approx(1 / 3, abs=0.04)


def grid_bfs(start, moves, is_goal):
    """Reference breadth-first search written for the tests, independent of envs.bfs_path on purpose:
    the fewest moves to a goal state, or None."""
    queue, distance = deque([start]), {start: 0}
    while queue:
        state = queue.popleft()
        if is_goal(state):
            return distance[state]
        for following in moves(state):
            if following not in distance:
                distance[following] = distance[state] + 1
                queue.append(following)
    return None


def parse_grid(text):
    return {(r, c): char for r, row in enumerate(text.split("\n")) for c, char in enumerate(row)}


def play_demonstration(env, seed, mistake_rate=0.0, rng=None):
    """An episode of env.demonstration, the env stepped between its replies as the warm-up does."""
    env.reset(seed)
    results = []
    for text in env.demonstration(mistake_rate, rng):
        results.append(env.step(text))
        if results[-1].done:
            return results


def test_every_frozen_lake_map_is_solvable():
    for size, seeds in ((4, range(300)), (6, range(50))):
        for seed in seeds:
            env = envs.FrozenLakeEnv(size=size, hole_probability=0.4)
            messages, _ = env.reset(seed)
            grid = parse_grid(messages[1]["content"])
            assert len(grid) == size * size and Counter(grid.values())["P"] == 1 and Counter(grid.values())["G"] == 1
            start = next(cell for cell, char in grid.items() if char == "P")
            moves = lambda cell: [(cell[0] + dr, cell[1] + dc) for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0))
                                  if grid.get((cell[0] + dr, cell[1] + dc), "O") != "O"]
            fewest = grid_bfs(start, moves, lambda cell: grid[cell] == "G")
            assert fewest is not None, messages[1]["content"]
            played = play_demonstration(envs.FrozenLakeEnv(size=size, hole_probability=0.4,
                                                           max_turns=fewest), seed)
            assert played[-1].info["success"] and sum(r.info["actions"] for r in played) == fewest


def test_every_sokoban_level_is_solvable():
    for seed in range(300):
        env = envs.SokobanEnv()
        messages, _ = env.reset(seed)
        grid = parse_grid(messages[1]["content"])
        counts = Counter(grid.values())
        assert len(grid) == 36 and counts["P"] == counts["X"] == counts["O"] == 1 and counts["*"] == 0
        player, box, target = (next(cell for cell, char in grid.items() if char == symbol) for symbol in "PXO")

        def moves(state):
            player, box = state
            for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0)):
                ahead = (player[0] + dr, player[1] + dc)
                if grid[ahead] == "#":
                    continue
                if ahead != box:
                    yield ahead, box
                elif grid[(box[0] + dr, box[1] + dc)] != "#":
                    yield ahead, (box[0] + dr, box[1] + dc)
        fewest = grid_bfs((player, box), moves, lambda state: state[1] == target)
        assert fewest is not None, messages[1]["content"]
        # The warm-up's demonstration pushes the box home in exactly that many moves.
        played, moves_made = play_demonstration(env, seed), 0
        for result in played:
            moves_made += result.info["actions"]
        assert played[-1].info["success"] and moves_made == fewest, (seed, moves_made, fewest)


def test_slippery_frozen_lake_demonstration_succeeds_as_often_as_value_iteration_predicts():
    # The demonstration acts as the optimal policy for one action a turn, so over many maps and
    # slips its success rate is the mean of the maps' optimal chances; a worse policy falls short.
    successes, predicted, rng = 0, 0.0, random.Random(0)
    for seed in range(1500):
        env = envs.FrozenLakeEnv(slippery=True, max_turns=6)
        env.reset(seed)
        predicted += env.reach_probabilities(6)[0][env.start]
        successes += play_demonstration(env, seed, rng=rng)[-1].info["success"]
    assert successes / 1500 == pytest.approx(predicted / 1500, abs=0.03)
    assert predicted / 1500 > 0.3


def test_frozen_lake_slippery_is_frozen_lake_with_slip_on():
    # The named env plays the same maps, slips and rewards as FrozenLake(slippery=True), turn by turn.
    for seed in range(20):
        named, lake = envs.ENVS["frozen_lake_slippery"](max_turns=6), envs.FrozenLakeEnv(slippery=True, max_turns=6)
        assert named.reset(seed, member=1) == lake.reset(seed, member=1)
        for action in ["Down", "Right", "Right", "Down", "Left", "Down"]:
            step, expected = named.step(f"<answer>{action}</answer>"), lake.step(f"<answer>{action}</answer>")
            assert step == expected
            if step.done:
                break
    assert not envs.ENVS["frozen_lake_slippery"](slippery=False).slippery  # an option still wins


def test_flawed_demonstrations_take_another_action_at_the_mistake_rate():
    rng, mistakes, actions = random.Random(1), 0, 0
    for seed in range(300):
        env = envs.SokobanEnv()
        env.reset(seed)
        reply = next(env.demonstration(0.3, rng))
        planned = env.plan()[:env.max_actions_per_turn]
        taken = envs.extract_answer(reply).split(" || ")
        mistakes += sum(a != b for a, b in zip(taken, planned))
        actions += len(planned)
    assert mistakes / actions == pytest.approx(0.3, abs=0.05)


@pytest.mark.parametrize("options, expected", [
    ({"step_reward": -0.1}, [-0.1, -0.2, -0.3, -0.3, 10.9]),  # gym-sokoban's (and RAGEN's) rewards
    ({}, [0, 0, 0, 0, 11]),  # the default charges no move
])
def test_sokoban_push_sequence_and_wall_bump(options, expected):
    env = envs.SokobanEnv(**options)
    env.reset(0)
    level = parse_grid("######\n#P___#\n#_X__#\n#_#__#\n#__O_#\n######")
    env.walls = {cell for cell, char in level.items() if char == "#"}
    env.player, env.box, env.target = (1, 1), (2, 2), (4, 3)
    rewards = [env.step("<answer>Up</answer>").reward]  # wall bump: still a move
    assert env.player == (1, 1)
    rewards.append(env.step("<answer>Right || Down</answer>").reward)  # the box cannot go into the wall below it
    assert (env.player, env.box) == ((1, 2), (2, 2))
    step = env.step("<answer>Left || Down || Right</answer>")  # push the box right
    rewards.append(step.reward)
    assert step.observations[0]["content"] == "######\n#____#\n#_PX_#\n#_#__#\n#__O_#\n######"
    rewards.append(env.step("<answer>Up || Right || Down</answer>").reward)  # push it down
    assert (env.player, env.box) == ((2, 3), (3, 3))
    last = env.step("<answer>Down || Up</answer>")  # onto the target: the game ends, "Up" is skipped
    rewards.append(last.reward)
    assert last.done and last.info["success"] and last.info["actions"] == 1
    assert last.observations[0]["content"] == "######\n#____#\n#____#\n#_#P_#\n#__*_#\n######"
    assert rewards == pytest.approx(expected)


def test_games_are_deterministic_and_require_think_works():
    for env_class in (envs.FrozenLakeEnv, envs.SokobanEnv, envs.BanditEnv):
        assert env_class().reset(7) == env_class().reset(7)
        assert len({env_class().reset(seed)[0][1]["content"] for seed in range(20)}) > 1
    env = envs.SokobanEnv(require_think=True)
    messages, _ = env.reset(0)
    assert "<think>" in messages[0]["content"]
    assert env.step("<answer>Up</answer>").info["format_error"]
    assert not env.step("<think>wall above?</think><answer>Up</answer>").info["format_error"]
    # Nothing may follow the answer: RL would otherwise reinforce whatever a winning reply trails
    # (docs/games.md, "Predicting the next grid").
    trailing = env.step("<think>go</think><answer>Up</answer>GGGG\nDownDown")
    assert trailing.info["format_error"] and trailing.info["actions"] == 0 and trailing.reward == -0.1
    assert not env.step("<think>go</think> <answer>Up</answer> \n").info["format_error"]
    assert env.step("<answer>Up</answer></answer></answer>").info["format_error"]  # an answer's end once


def test_every_env_speaks_the_interface():
    data = {"search_qa": envs.load_qa_dataset(str(DATA / "musique_sample.jsonl")),
            "math": envs.load_math_dataset(str(DATA / "gsm8k_sample.jsonl"), "all")}
    assert set(envs.ENVS) == {"search_qa", "synthetic_qa", "calculator", "compute", "math", "bandit", "frozen_lake",
                              "frozen_lake_slippery", "sokoban"}
    for name, env_class in envs.ENVS.items():
        env = env_class(data[name]) if name in data else env_class()
        messages, tool_schemas = env.reset(envs.EVAL_SEED_START)
        assert [m["role"] for m in messages] == ["system", "user"] and isinstance(tool_schemas, list)
        result = env.step("no idea")
        assert isinstance(result, envs.StepResult) and result.reward == -0.1
        assert {"success", "tool_calls", "invalid_calls", "format_error"} <= set(result.info)
        assert env.max_turns >= 1

# -----------------------------------------------------------------------------
# The README example for adding an environment, read from README.md and run verbatim


def readme_example():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("**Adding an environment**"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_readme_example_runs(capsys):
    namespace = {}
    exec(readme_example(), namespace)
    result, env = namespace["result"], namespace["env"]
    assert result.reward == 1.0 and result.done and result.info["success"]
    assert capsys.readouterr().out.splitlines()[-1] == "1.0 True True"
    assert env.answers == [str(eval(env.question.removeprefix("What is ").removesuffix("?")))]


def test_every_env_name_is_a_single_token_of_the_tiny_tokenizer():
    from nanoagent.models import TINY_NAMES
    assert set(envs.NAMES) | set(envs.SAFE_ARMS) | set(envs.RISKY_ARMS) <= set(TINY_NAMES)


# -----------------------------------------------------------------------------
# Computation with the python tool


def test_compute_env_answers_are_what_its_programs_print():
    env, kinds = envs.ComputeEnv(), set()
    for seed in range(24):
        _, tool_schemas = env.reset(seed)
        kinds.add(env.kind)
        program, answer = env.demonstration(0.0)
        printed = env.step(program).observations[0]["content"]  # run in this process (envs.run_own_program)
        code = tools.parse_tool_calls(program)[0].arguments["code"]
        assert printed == sandbox.run_python(code)[0] == env.answers[0] + "\n", (env.question, printed)
        result = env.step(answer)
        assert result.done and result.info["success"] and result.reward == 1.0
    assert kinds == set(envs.ComputeEnv.KINDS) and [s["function"]["name"] for s in tool_schemas] == ["python"]
    assert env.reset(0)[0] == envs.ComputeEnv().reset(0)[0]  # deterministic given the seed
    assert all("divisible" in envs.ComputeEnv(kinds=["count"]).reset(seed)[0][1]["content"] for seed in range(3))


def test_compute_env_flawed_demonstrations():
    env, rng, outcomes = envs.ComputeEnv(), random.Random(0), Counter()
    for seed in range(120):
        env.reset(seed)
        turns = env.demonstration(0.5, rng)
        results = [env.step(turn) for turn in turns]
        code = tools.parse_tool_calls(turns[0])[0].arguments["code"]
        program_copied = code == envs.ComputeEnv.KINDS[env.kind][1].format(**env.numbers)
        answer_copied = f"<answer>{results[0].observations[0]['content'].strip()}</answer>" == turns[1]
        # Always a program; it succeeds when both copies are right, and only by chance otherwise (a count that
        # the program's slip does not change, an answer's slip that lands on the right number).
        assert len(turns) == 2 and (results[-1].info["success"] or not (program_copied and answer_copied))
        outcomes[program_copied, answer_copied] += 1
        outcomes["lucky"] += results[-1].info["success"] and not (program_copied and answer_copied)
    assert min(outcomes[copies] for copies in [(True, True), (True, False), (False, True), (False, False)]) >= 15
    assert outcomes["lucky"] <= 12, outcomes
    assert envs.miscopied(7, random.Random(0)) in range(1, 10) and envs.miscopied(12345, rng) // 10000 in range(1, 10)
    slips = [envs.miscopied(123456, random.Random(seed)) for seed in range(50)]
    assert all(sum(a != b for a, b in zip(str(slip), "123456")) <= 1 for slip in slips) and len(set(slips)) > 20


def test_calculator_demonstrations_solve_each_kind_and_a_flawed_one_miscopies_one_number():
    env, rng, solved, slipped = envs.CalculatorEnv(), random.Random(0), [], 0
    for seed in range(60):
        question = env.reset(seed)[0][-1]["content"]
        turns = env.demonstration(0.0, rng)
        results = [env.step(turn) for turn in turns]
        expression = tools.parse_tool_calls(turns[0])[0].arguments["expression"]
        assert set(re.findall(r"\d+", expression)) <= set(re.findall(r"\d+", question))  # copied, not computed
        assert turns[1] == f"<answer>{results[0].observations[0]['content']}</answer>"
        solved.append(results[-1].info["success"] and results[-1].done)
        env.reset(seed)
        flawed = env.demonstration(1.0, rng)
        wrong = tools.parse_tool_calls(flawed[0])[0].arguments["expression"]
        slips = [(a, b) for a, b in zip(re.findall(r"\d+", wrong), re.findall(r"\d+", expression)) if a != b]
        assert len(slips) <= 1 and flawed[1] == f"<answer>{tools.calculate(wrong)}</answer>"
        slipped += len(slips)
    assert all(solved) and slipped >= 45  # a slip may write the digit it replaces


def test_math_env_on_a_gsm8k_sample_in_the_hubs_schema(tmp_path):
    rows = envs.load_math_dataset(str(DATA / "gsm8k_sample.jsonl"), "all")
    assert [row["answers"] for row in rows] == [["38"], ["315"], ["25"], ["50"], ["2125"], ["32"], ["-7"], ["700"]]
    train, held_out = (envs.load_math_dataset(str(DATA / "gsm8k_sample.jsonl"), split) for split in
                       ("train", "held-out"))
    assert len(held_out) == 1 and len(train) == 7 and held_out[0] not in train
    env = envs.MathEnv(rows)
    env.reset(4)  # 3,400 - 1,275
    assert [env.score(text)["em"] for text in ("2,125", "It is 2125.", "2125.0", "2124", "no idea")] == [1, 1, 1, 0, 0]
    assert env.step("<answer>$2,125</answer>").info["success"]
    assert envs.final_number("so 4 * 12.50 = 50.\n#### 50") == "50" and envs.final_number("#### -7") == "-7"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "How many?", "answer": "many"}) + "\n")
    with pytest.raises(UserError, match="needs a question and an answer ending in '#### number'"):
        envs.load_math_dataset(str(bad))
    with pytest.raises(UserError, match="does not exist"):
        envs.load_math_dataset(str(tmp_path / "missing.jsonl"))
