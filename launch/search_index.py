"""Builds (or loads) a corpus's BM25 index and runs a few searches on it: the check before a search run.

  python -m launch.search_index --corpus=corpus.jsonl --query="Ada Lovelace" --query="Analytical Engine"
  python -m launch.search_index --corpus=rlax.data.entities:corpus --query="Noufaer Stasvaes"
  python -m launch.search_index --retriever=http://localhost:8000/retrieve --query="who wrote hamlet"

Prints one JSON line: the passages, where the index lives, whether this call built it, the seconds it took,
and each query's top-k (id, title, score, the text's start). The same index is what env.retriever=bm25 with
this env.corpus loads.
"""

import json
import sys
import time

from absl import app
from absl import flags

from launch.flags_util import parse_or_exit, quiet_library_logs
from rlax.envs import retrieval

_CORPUS = flags.DEFINE_string("corpus", "", "The corpus: .jsonl/.parquet/datasets dir of id/title/text, or module:fn.")
_RETRIEVER = flags.DEFINE_string("retriever", "bm25", "bm25, an http(s):// Search-R1 server, or module:fn.")
_QUERY = flags.DEFINE_multi_string("query", [], "A query to run (repeatable).")
_K = flags.DEFINE_integer("k", 3, "Passages per query.", lower_bound=1)


def main(argv):
  del argv
  quiet_library_logs()
  t0 = time.perf_counter()
  try:
    r = retrieval.make_retriever(_RETRIEVER.value, _CORPUS.value)
    ready = time.perf_counter() - t0
    hits = r.search(_QUERY.value, _K.value) if _QUERY.value else []
  except (ValueError, OSError) as e:  # a missing corpus, a bad row, a server that does not answer: one line
    print(f"search_index: {e}", file=sys.stderr)
    sys.exit(2)
  out = {"retriever": _RETRIEVER.value, "corpus": _CORPUS.value, "ready_s": round(ready, 3)}
  if isinstance(r, retrieval.BM25Retriever):
    out.update(passages=len(r.passages), index=r.index_dir, built=r.built)
  out["queries"] = {q: [{"id": p.id, "title": p.title, "score": round(p.score, 3), "text": p.text[:80]} for p in h]
                    for q, h in zip(_QUERY.value, hits)}
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
