"""
Benchmark: search at scale. The hand-written in-memory BM25 the search tool used before (copied below,
as it was) against nanoagent/retrieval.py's BM25Retriever (bm25s' index, saved, memory-mapped), on N
synthetic passages of ~100 words; then batched against per-call tool time.

    python bench/bench_retrieval.py --passages 100000            # one size, both indexes, ~4 min on 2 cores
    python bench/bench_retrieval.py --passages 1000000 --skip_hand_written --repeats 1   # ~7 min
    python bench/bench_retrieval.py --tool_time                   # batched vs per call (synthetic QA, BM25, HTTP)

Each index runs in its own subprocess (--repeats times, alternating; medians), so its peak memory
(ru_maxrss) is its own: "build peak" is the process' high-water mark less its size once the passages
are generated (both hold the same passages).
Latency is per query at batch 1 (100 queries one by one) and at batch 64 (the hand-written index has
no batch call: it loops). Agreement is the mean overlap of the two top-10 lists over 200 queries; the
two can only differ on ties and float32 rounding (bm25s stores scores in float32).

Passages are drawn deterministically: word w of a 50k-word vocabulary with Zipf weights 1/w^1.05
(as natural text: a few very common words, a long tail), 80-120 words each. Queries are 2-4 words of
one passage, so every query has a relevant passage.
"""

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the concept files live at the repository root
from nanoagent.retrieval import BM25Retriever, tokenize  # noqa: E402

VOCABULARY_SIZE = 50_000
SYLLABLES = "ka lo mi ne ru ta vo zi pe so da fu gri bel".split()


def vocabulary() -> list[str]:
    rng = np.random.default_rng(0)
    return ["".join(rng.choice(SYLLABLES, size=rng.integers(2, 5))) + str(i) for i in range(VOCABULARY_SIZE)]


def synthetic_passages(n: int, seed: int = 0):
    """n passages {"title", "text"}, generated lazily in chunks (the same ones for every n' >= n)."""
    words, rng = vocabulary(), np.random.default_rng(seed)
    weights = 1 / np.arange(1, VOCABULARY_SIZE + 1) ** 1.05
    weights /= weights.sum()
    for start in range(0, n, 10_000):
        count = min(10_000, n - start)
        lengths = rng.integers(80, 121, size=count)
        ids = rng.choice(VOCABULARY_SIZE, size=int(lengths.sum()), p=weights)
        for i, chunk in enumerate(np.split(ids, np.cumsum(lengths)[:-1])):
            yield {"title": f"Passage {start + i}", "text": " ".join(words[j] for j in chunk)}


def sample_queries(passages: list[dict], count: int = 200, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(passages), size=count)
    return [" ".join(rng.choice(passages[i]["text"].split(), size=rng.integers(2, 5), replace=False)) for i in picks]


class HandWrittenBM25:
    """The search tool's index before bm25s, as it was: Okapi BM25 with (k1 + 1), in memory, built by
    one np.unique over (term, doc) pairs."""

    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75):
        self.vocabulary = {}
        tokens = [tokenize(doc) for doc in docs]
        term_ids = np.array([self.vocabulary.setdefault(t, len(self.vocabulary)) for doc in tokens for t in doc],
                            dtype=np.int64)
        doc_lengths = np.array([len(doc) for doc in tokens], dtype=np.int64)
        num_docs, num_terms = len(docs), len(self.vocabulary)
        doc_of_token = np.repeat(np.arange(num_docs), doc_lengths)
        pair_keys, term_frequency = np.unique(term_ids * num_docs + doc_of_token, return_counts=True)
        term_of_pair, self.doc_of_pair = np.divmod(pair_keys, num_docs)
        self.offsets = np.searchsorted(term_of_pair, np.arange(num_terms + 1))
        document_frequency = np.diff(self.offsets)
        idf = np.log(1 + (num_docs - document_frequency + 0.5) / (document_frequency + 0.5))
        length_norm = 1 - b + b * doc_lengths[self.doc_of_pair] / max(doc_lengths.mean(), 1e-9)
        self.weights = idf[term_of_pair] * term_frequency * (k1 + 1) / (term_frequency + k1 * length_norm)
        self.num_docs = num_docs

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        scores = np.zeros(self.num_docs)
        for term in tokenize(query):
            if (t := self.vocabulary.get(term)) is not None:
                span = slice(self.offsets[t], self.offsets[t + 1])
                scores[self.doc_of_pair[span]] += self.weights[span]
        candidates = np.flatnonzero(scores > 0)
        best = candidates[np.argsort(-scores[candidates], kind="stable")[:k]]
        return [(int(i), float(scores[i])) for i in best]


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def measure(kind: str, num_passages: int, directory: str) -> dict:
    """Builds one index and times it; runs in its own process (see main)."""
    passages = list(synthetic_passages(num_passages))
    queries = sample_queries(passages)
    baseline = peak_gib()
    start = time.perf_counter()
    if kind == "hand_written":
        index = HandWrittenBM25([f"{p['title']}\n{p['text']}" for p in passages])
        build_s, load_s = time.perf_counter() - start, None

        def search(batch, k):
            return [[i for i, _ in index.search(query, k)] for query in batch]
    else:
        BM25Retriever.build(passages, directory, total=len(passages))
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        retriever = BM25Retriever.load(directory)
        load_s = time.perf_counter() - start

        def search(batch, k):
            return [[hit["id"] for hit in hits] for hits in retriever.retrieve(batch, k)]
    build_peak = peak_gib() - baseline
    search(queries[:5], 10)  # warm the page cache and the allocator
    start = time.perf_counter()
    for query in queries[:100]:
        search([query], 10)
    batch1_ms = (time.perf_counter() - start) / 100 * 1e3
    start = time.perf_counter()
    for i in range(0, 192, 64):
        search(queries[i:i + 64], 10)
    batch64_ms = (time.perf_counter() - start) / 192 * 1e3
    size = sum(f.stat().st_size for f in Path(directory).iterdir()) / 2**30 if kind == "bm25s" else None
    return {"kind": kind, "passages": num_passages, "build_s": build_s, "load_s": load_s,
            "build_peak_gib": build_peak, "process_peak_gib": peak_gib(), "index_gib": size,
            "batch1_ms_per_query": batch1_ms, "batch64_ms_per_query": batch64_ms,
            "top10": search(queries, 10)}


def run_in_subprocess(kind, num_passages) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        output = subprocess.run([sys.executable, __file__, "--measure", kind, "--passages", str(num_passages),
                                 "--directory", directory], check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, seconds: float = 60):
    """Waits until the retrieval server at url answers."""
    from nanoagent.retrieval import RemoteRetriever
    deadline = time.perf_counter() + seconds
    while True:
        try:
            return RemoteRetriever(url, timeout_s=5, retries=0).retrieve(["x"], 1)
        except RuntimeError:
            assert time.perf_counter() < deadline, f"the server at {url} did not start"
            time.sleep(0.5)


def tool_time(num_passages: int, episodes: int = 64, repeats: int = 9):
    """Seconds of tool work per turn of `episodes` episodes, per call vs batched: the synthetic QA task
    (a training step's envs, demonstration turns, same seeds), and one search call per episode on a
    shared BM25 index of num_passages, locally and through our server (another process) on loopback."""
    import envs
    import tools
    from nanoagent.retrieval import RemoteRetriever

    def synthetic_turns():
        group = [envs.SyntheticQAEnv(hops=2) for _ in range(episodes)]
        turns = []
        for seed, env in enumerate(group):
            env.reset(seed // 8, member=seed % 8)
            turns.append(env.demonstration(mistake_rate=0.5, rng=random.Random(seed)))
        return group, turns

    def play(step_together):
        group, turns = synthetic_turns()
        start, turn = time.perf_counter(), 0
        while active := [(env, t[turn]) for env, t in zip(group, turns) if not env.done and turn < len(t)]:
            if step_together:
                envs.step_envs([env for env, _ in active], [text for _, text in active])
            else:
                for env, text in active:
                    env.step(text)
            turn += 1
        return time.perf_counter() - start

    rows, timings = [], {"per call": [], "batched": []}
    for _ in range(repeats):  # alternating, so both see the same machine load
        timings["per call"].append(play(False))
        timings["batched"].append(play(True))
    rows.append(("synthetic QA: env stepping of a step's 64 episodes (all turns)", timings))

    passages = list(synthetic_passages(num_passages))
    queries = sample_queries(passages, episodes, seed=2)
    calls = [tools.ToolCall("search", {"query": query}) for query in queries]
    unmatched = [tools.ToolCall("search", {"query": f"unknownword{i}"}) for i in range(episodes)]  # ~no retrieval work
    with tempfile.TemporaryDirectory() as directory:
        retriever = BM25Retriever.build(passages, directory, total=len(passages))
        port = free_port()  # the server is its own process, as on a training node
        server = subprocess.Popen([sys.executable, "-m", "nanoagent.retrieval", "serve", "--index", directory,
                                   "--host", "127.0.0.1", "--port", str(port)],
                                  cwd=Path(__file__).resolve().parent.parent)
        url = f"http://127.0.0.1:{port}/retrieve"
        wait_for(url)
        remote = RemoteRetriever(url, timeout_s=30)
        workloads = (("BM25 index", retriever, calls), ("BM25 via HTTP server", remote, calls),
                     ("HTTP server, queries matching nothing (the requests' own cost)", remote, unmatched))
        for label, backend, calls in workloads:
            search = {"search": tools.search_tool(backend)}
            timings = {"per call": [], "batched": []}
            for _ in range(repeats):
                start = time.perf_counter()
                for call in calls:
                    tools.run_tool_call(call, search, timeout_s=60)
                timings["per call"].append(time.perf_counter() - start)
                start = time.perf_counter()
                tools.run_tool_calls(calls, [search] * len(calls), timeout_s=60)
                timings["batched"].append(time.perf_counter() - start)
            rows.append((f"{label}, {num_passages:,} passages: {episodes} search calls", timings))
        server.terminate()
        server.wait()
    print(f"\n| tool work per turn (median of {repeats}, alternating) | per call | batched |\n|---|---|---|")
    for label, timings in rows:
        print(f"| {label} | {statistics.median(timings['per call']) * 1e3:.1f} ms "
              f"| {statistics.median(timings['batched']) * 1e3:.1f} ms |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--skip_hand_written", action="store_true", help="bm25s only (the hand-written index "
                        "holds every token as a Python string: ~6 GB at 1M passages)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each index, alternating; medians")
    parser.add_argument("--tool_time", action="store_true", help="batched vs per-call tool time instead")
    parser.add_argument("--measure", choices=["hand_written", "bm25s"], help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.passages, args.directory)))
        return
    if args.tool_time:
        return tool_time(args.passages)
    kinds = ["bm25s"] if args.skip_hand_written else ["hand_written", "bm25s"]
    runs = {kind: [] for kind in kinds}
    for _ in range(args.repeats):  # alternating, so both see the same machine load
        for kind in kinds:
            runs[kind].append(run_in_subprocess(kind, args.passages))
    results = {kind: {key: statistics.median(r[key] for r in kind_runs) if isinstance(value, float) else value
                      for key, value in kind_runs[0].items()} for kind, kind_runs in runs.items()}
    print(f"\n| {args.passages:,} passages | build | load | build peak memory | index on disk "
          f"| query, batch 1 | query, batch 64 |\n|---|---|---|---|---|---|---|")
    for kind, r in results.items():
        load = f"{r['load_s']:.2f} s" if r["load_s"] is not None else "-"
        disk = f"{r['index_gib']:.2f} GiB" if r["index_gib"] is not None else "- (in memory)"
        print(f"| {kind} | {r['build_s']:.1f} s | {load} | {r['build_peak_gib']:.2f} GiB | {disk} "
              f"| {r['batch1_ms_per_query']:.1f} ms | {r['batch64_ms_per_query']:.1f} ms |")
    if len(results) == 2:
        overlaps = [len(set(a) & set(b)) / max(len(a), 1) for a, b in zip(results["hand_written"]["top10"],
                                                                         results["bm25s"]["top10"])]
        identical = sum(a == b for a, b in zip(results["hand_written"]["top10"], results["bm25s"]["top10"]))
        print(f"top-10 agreement over {len(overlaps)} queries: {statistics.mean(overlaps):.1%} "
              f"(identical lists: {identical})")


if __name__ == "__main__":
    main()
