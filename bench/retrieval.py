"""BM25 retrieval for search tools: index build time, query latency per batch and peak memory.

  python bench/retrieval.py [--passages=100000] [--batch=64] [--batches=20] [--repeats=3] [--fuzzy]

A synthetic corpus of --passages passages (about 60 words each from a 50k-word vocabulary with a Zipf law, so
words repeat as in text) is written to a temporary JSONL file; rlax's BM25Retriever (bm25s) builds its index
(the first run) and loads it (later runs); --batches batches of --batch queries (8 words each, drawn from the
corpus's own passages) give the per-batch latency p50/p99. `rank_bm25` (pure Python, the other common BM25
package), when installed, is timed on the same corpus as the peer, on --peer_batches batches (it scores
every passage per query). Build and load are medians of --repeats. Peak memory: the process's max RSS after
each phase. --fuzzy times `bm25_fuzzy` (words and their character trigrams) instead of word BM25. The last line
is JSON.
"""

import json
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlax.envs import retrieval  # pylint: disable=g-import-not-at-top,wrong-import-position

_PASSAGES = flags.DEFINE_integer("passages", 100_000, "Passages in the corpus.")
_BATCH = flags.DEFINE_integer("batch", 64, "Queries per batch.")
_BATCHES = flags.DEFINE_integer("batches", 20, "Timed batches.")
_PEER_BATCHES = flags.DEFINE_integer("peer_batches", 2, "Timed batches for rank_bm25.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Builds and loads timed (median).")
_FUZZY = flags.DEFINE_bool("fuzzy", False, "Time bm25_fuzzy (words + character trigrams) instead of word BM25.")


def _rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def corpus(path: str, n: int, rng) -> list[str]:
  """Writes the synthetic corpus to `path` (JSONL); its texts. Also bench/search_episodes.py's corpus."""
  vocab = [f"w{i}" for i in range(50_000)]
  ids = np.minimum(rng.zipf(1.2, size=(n, 60)) - 1, len(vocab) - 1)
  texts = [" ".join(vocab[j] for j in row) for row in ids]
  with open(path, "w") as f:
    for i, t in enumerate(texts):
      f.write(json.dumps({"id": str(i), "title": f"passage {i}", "text": t}) + "\n")
  return texts


def _latency(search, queries, batch: int, batches: int) -> dict:
  times = []
  for b in range(batches):
    part = queries[b * batch:(b + 1) * batch]
    t0 = time.perf_counter()
    search(part)
    times.append(time.perf_counter() - t0)
  return {"p50_s": float(np.percentile(times, 50)), "p99_s": float(np.percentile(times, 99)),
          "queries_per_s": batch * len(times) / sum(times)}


def main(_):
  rng = np.random.default_rng(0)
  out = {"passages": _PASSAGES.value, "batch": _BATCH.value, "retriever": "bm25_fuzzy" if _FUZZY.value else "bm25"}
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "corpus.jsonl")
    texts = corpus(path, _PASSAGES.value, rng)
    n_q = _BATCH.value * _BATCHES.value
    picks = rng.integers(0, len(texts), n_q)
    queries = [" ".join(rng.choice(texts[i].split(), 8)) for i in picks]
    base = _rss_gb()
    builds, loads = [], []
    for r in range(_REPEATS.value):
      index = os.path.join(d, f"index{r}")
      t0 = time.perf_counter()
      retrieval.BM25Retriever(path, index_dir=index, fuzzy=_FUZZY.value)
      builds.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      ret = retrieval.BM25Retriever(path, index_dir=index, fuzzy=_FUZZY.value)
      loads.append(time.perf_counter() - t0)
      assert not ret.built
    out["bm25s"] = {"build_s": statistics.median(builds), "load_s": statistics.median(loads),
                    "peak_rss_gb_after_build": _rss_gb(), "rss_gb_before": base}
    out["bm25s"].update(_latency(lambda q: ret.search(q, 5), queries, _BATCH.value, _BATCHES.value))
    hits = ret.search(queries[:_BATCH.value], 5)
    out["bm25s"]["source_passage_in_top5"] = float(np.mean(
        [any(h.id == str(i) for h in row) for row, i in zip(hits, picks)]))
    try:
      import rank_bm25
    except ImportError:
      rank_bm25 = None
    if rank_bm25 is not None:
      t0 = time.perf_counter()
      peer = rank_bm25.BM25Okapi([t.lower().split() for t in texts])
      build = time.perf_counter() - t0
      search = lambda q: [np.argsort(-peer.get_scores(x.lower().split()))[:5] for x in q]
      out["rank_bm25"] = {"build_s": build, **_latency(search, queries, _BATCH.value, _PEER_BATCHES.value)}
      out["build_ratio_peer_over_bm25s"] = out["rank_bm25"]["build_s"] / out["bm25s"]["build_s"]
      out["query_ratio_peer_over_bm25s"] = out["rank_bm25"]["p50_s"] / out["bm25s"]["p50_s"]
    out["peak_rss_gb"] = _rss_gb()
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
