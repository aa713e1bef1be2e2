"""The README's own-retriever example, run as written against a stand-in encoder (no model hub here): it must
load the corpus, return each query's k passages best first, and work as env.retriever through the service."""

import asyncio
import json
import os
import re
import sys
import types
import zlib

import numpy as np

from rlax.envs import retrieval

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


class _BagOfWords:
  """SentenceTransformer's encode over hashed words (normalized), enough to rank the passage sharing the words."""

  def __init__(self, name):
    self.name = name

  def encode(self, texts, normalize_embeddings=False):
    out = np.zeros((len(texts), 4096), np.float32)
    for i, t in enumerate(texts):
      for w in t.lower().replace(":", " ").replace(".", " ").split()[1:]:  # drop the "query:"/"passage:" prefix
        out[i, zlib.crc32(w.encode()) % 4096] += 1  # not hash(): it changes per process, and 64 buckets collided
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9) if normalize_embeddings else out


def test_the_readme_retriever_runs_as_written(tmp_path, monkeypatch):
  code = re.search(r"```python\n(# my_retriever\.py.*?)```", open(README).read(), re.S).group(1)
  corpus = tmp_path / "corpus.jsonl"
  rows = [{"id": "a", "title": "Ada Quill", "text": "Ada Quill was born in Norvale."},
          {"id": "b", "title": "Norvale", "text": "Norvale is a city in Estmark."},
          {"id": "c", "title": "Bo Tern", "text": "Bo Tern worked as a miller."}]
  corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
  monkeypatch.setitem(sys.modules, "sentence_transformers", types.SimpleNamespace(SentenceTransformer=_BagOfWords))
  module = types.ModuleType("my_retriever")
  exec(compile(code.replace("/data/corpus.jsonl", str(corpus)), "my_retriever.py", "exec"), module.__dict__)
  hits = module.search(["norvale city estmark", "miller bo tern"], 2)
  assert [h[0].id for h in hits] == ["b", "c"] and all(len(h) == 2 for h in hits)
  assert all(h[0].score >= h[1].score for h in hits)
  monkeypatch.setitem(sys.modules, "my_retriever", module)
  service = retrieval.service(types.SimpleNamespace(retriever="my_retriever:search", corpus="", tool_timeout_s=5.0,
                                                    retrieval_window_ms=1.0))
  assert asyncio.run(service.search("bo tern miller", 1))[0].id == "c"
  service.close()
