"""Retrieval for search tools: passages of a corpus behind one small protocol, and one batching service per run.

A retriever maps a batch of queries to each query's top-k passages (`search(queries, k)`; id, title, text,
score, best first; a query nothing matches gets no passage). Three kinds, named by `make_retriever(spec, corpus)`:

  "bm25"          BM25 over the corpus (`bm25s`: pip install 'rlax[search]'): a file, or "module:fn" whose fn()
                  gives the passages (a generated corpus); the index is built once and saved under a key of the
                  corpus's content (beside a file; in ~/.cache/rlax/bm25 for a function), and every later run
                  loads it;
  "bm25_fuzzy"    the same over words and their character trigrams: a misspelt name ("Moschen Nevi" for "Mosnan
                  Nevi") still finds its passages, an exact one ranks first;
  "http(s)://..." a retrieval server in Search-R1's protocol (POST {"queries", "topk", "return_scores"} to
                  .../retrieve; each hit {"document": {"id", "contents" or "title"/"text"}, "score"}), e.g. a
                  user's dense E5/BGE index;
  "module:fn"     a user's function fn(queries, k) -> per query a list of Passage or dicts with those keys
                  (`no_passages` here: every search finds nothing, a control run's retriever).

`RetrievalService` owns one retriever for the whole run: episodes `await service.search(query, k)` from any
event loop; a thread gathers the queries that arrive within `window_s` (at most `max_batch`) into one call, so
concurrent episodes share a batch and the retriever's latency overlaps decoding as tool calls do. A caller
bounds its wait with a deadline (asyncio.wait_for); a retriever error fails only the calls of that batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import logging as py_logging
import os
import queue
import shutil
import threading
import time
import urllib.request
from typing import Any, Callable, Optional, Protocol, Sequence

from absl import logging

from rlax import imports


@dataclasses.dataclass(frozen=True)
class Passage:
  id: str
  title: str
  text: str
  score: float = 0.0


class Retriever(Protocol):
  def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
    """Each query's top-k passages, best first (fewer, or none, when fewer match)."""


@dataclasses.dataclass(frozen=True)
class CorpusColumns:
  """Which fields of a corpus row hold a passage's id, title and text (dotted paths reach nested fields). A row
  with `contents` and no title (Search-R1's corpora: '"Title"\\ntext') is split at its first line."""
  id: str = "id"
  title: str = "title"
  text: str = "text"


def _field(row: dict, path: str) -> Any:
  for part in path.split("."):
    row = row.get(part) if isinstance(row, dict) else None
  return row


def _passage(row: dict, where: str, cols: CorpusColumns) -> Passage:
  if not isinstance(row, dict):
    raise ValueError(f"{where}: a corpus row must be an object, got {type(row).__name__}")
  pid, title, text = _field(row, cols.id), _field(row, cols.title), _field(row, cols.text)
  if text is None and isinstance(row.get("contents"), str):
    head, _, rest = row["contents"].partition("\n")
    title, text = (title if title is not None else head.strip().strip('"')), rest
  if pid is None or text is None:
    missing = cols.id if pid is None else cols.text
    raise ValueError(f"{where}: no {missing!r} field (fields: {sorted(row)[:8]}); map it with the corpus columns")
  return Passage(id=str(pid), title="" if title is None else str(title), text=str(text))


def read_passages(path: str, columns: CorpusColumns = CorpusColumns()) -> list[Passage]:
  """A corpus from a .jsonl or .parquet file or a `datasets` directory; one ValueError naming a bad row."""
  from rlax.data import records
  if records.is_dataset_dir(path):
    import datasets
    rows = datasets.load_from_disk(path)
    return [_passage(dict(r), f"{path}:row {i}", columns) for i, r in enumerate(rows)]
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq
    return [_passage(r, f"{path}:row {i}", columns) for i, r in enumerate(pq.read_table(path).to_pylist())]
  if not path.endswith((".jsonl", ".json")):
    raise ValueError(f"corpus {path!r}: expected a .jsonl or .parquet file or a datasets directory")
  out = []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f):
      if line.strip():
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{i + 1}: not JSON ({e})") from None
        out.append(_passage(row, f"{path}:{i + 1}", columns))
  return out


def corpus_key(path: str) -> str:
  """A key of the corpus's content (sha256 of its files' bytes, in name order), so that an edited corpus gets a
  new index and an unchanged one finds the old."""
  h = hashlib.sha256()
  files = ([os.path.join(d, n) for d, _, names in sorted(os.walk(path)) for n in sorted(names)]
           if os.path.isdir(path) else [path])
  for name in files:
    h.update(os.path.relpath(name, path).encode() if os.path.isdir(path) else b"")
    with open(name, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
  return h.hexdigest()[:16]


def corpus_passages(corpus: str, columns: CorpusColumns = CorpusColumns()) -> tuple[list[Passage], str]:
  """(passages, where their BM25 index lives) of a corpus file or directory, or of "module:fn" (fn() -> Passages
  or dicts with id/title/text); one ValueError naming what is wrong."""
  if ":" in corpus and not os.path.exists(corpus):
    rows = imports.by_path(corpus, f"corpus {corpus!r}", "a function")()
    passages = [p if isinstance(p, Passage) else _passage(p, f"corpus {corpus}: passage {i}", columns)
                for i, p in enumerate(rows)]
    blob = json.dumps([dataclasses.astuple(p) for p in passages]).encode()
    home = os.environ.get("RLAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlax"))
    return passages, os.path.join(home, "bm25", f"{corpus.replace(':', '.')}-{hashlib.sha256(blob).hexdigest()[:16]}")
  if not os.path.exists(corpus):
    raise ValueError(f"corpus {corpus!r} does not exist")
  return read_passages(corpus, columns), f"{corpus.rstrip(os.sep)}.bm25-{corpus_key(corpus)}"


def no_passages(queries: Sequence[str], k: int) -> list[list[Passage]]:
  """A retriever that finds nothing: a control run's (what the policy does when search never helps)."""
  return [[] for _ in queries]


def _bm25s():
  try:
    import bm25s
  except ImportError:
    raise ValueError("retriever 'bm25' needs the bm25s package: pip install 'rlax[search]'") from None
  py_logging.getLogger("bm25s").setLevel(py_logging.WARNING)  # it logs every empty (all-stopword) query
  return bm25s


def _fuzzy_tokens(text: str) -> list[str]:
  """Lower-cased alphanumeric words less English stopwords, each followed by its character trigrams (of
  "#word#"): `bm25_fuzzy`'s tokens."""
  from bm25s.stopwords import STOPWORDS_EN  # pylint: disable=g-import-not-at-top
  out = []
  for w in "".join(c.lower() if c.isalnum() else " " for c in text).split():
    if w not in STOPWORDS_EN:
      p = f"#{w}#"
      out += [w] + [p[i:i + 3] for i in range(len(p) - 2)]
  return out


class BM25Retriever:
  """BM25 (bm25s, English stopwords, lower-cased word tokens; with `fuzzy` their character trigrams too) over
  title + text of every passage. The index is saved in `index_dir` (default: `corpus_passages`'s place for it)
  and loaded when present."""

  def __init__(self, corpus: str, columns: CorpusColumns = CorpusColumns(), index_dir: Optional[str] = None,
               fuzzy: bool = False):
    bm25s = _bm25s()
    self.passages, default_dir = corpus_passages(corpus, columns)
    if not self.passages:
      raise ValueError(f"corpus {corpus!r} holds no passage")
    self.fuzzy = fuzzy
    self.index_dir = index_dir or (default_dir + ("-fuzzy" if fuzzy else ""))
    self.built = not os.path.isfile(os.path.join(self.index_dir, "params.index.json"))
    if self.built:
      texts = [f"{p.title}\n{p.text}" for p in self.passages]
      self.index = bm25s.BM25()
      self.index.index(self._tokens(texts), show_progress=False)
      tmp = f"{self.index_dir}.tmp-{os.getpid()}"
      os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)
      self.index.save(tmp)
      try:
        os.replace(tmp, self.index_dir)  # whole or absent: a killed build leaves no half index to load
      except OSError:  # another process built the same index first (same content key): keep theirs
        if not os.path.isfile(os.path.join(self.index_dir, "params.index.json")):
          raise
        shutil.rmtree(tmp, ignore_errors=True)
    else:
      self.index = bm25s.BM25.load(self.index_dir)

  def _tokens(self, texts: Sequence[str]):
    if self.fuzzy:
      return [_fuzzy_tokens(t) for t in texts]
    return _bm25s().tokenize(list(texts), stopwords="en", show_progress=False)

  def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
    if not queries:
      return []
    k = max(1, min(int(k), len(self.passages)))
    docs, scores = self.index.retrieve(self._tokens(list(queries)), k=k, show_progress=False, n_threads=1)
    return [[dataclasses.replace(self.passages[int(d)], score=float(s)) for d, s in zip(row, srow) if s > 0]
            for row, srow in zip(docs, scores)]


class HttpRetriever:
  """A retrieval server in Search-R1's protocol at `url` (…/retrieve)."""

  def __init__(self, url: str, timeout_s: float = 30.0):
    self.url, self.timeout_s = url, timeout_s

  def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
    body = json.dumps({"queries": list(queries), "topk": int(k), "return_scores": True}).encode()
    req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
      result = json.loads(r.read()).get("result")
    if not isinstance(result, list) or len(result) != len(queries):
      raise ValueError(f"retrieval server {self.url}: expected 'result' with {len(queries)} lists")
    out = []
    for i, hits in enumerate(result):
      row = []
      for j, hit in enumerate(hits):
        doc = hit.get("document", hit) if isinstance(hit, dict) else {}
        p = _passage(doc, f"{self.url}: result {i} hit {j}", CorpusColumns())
        row.append(dataclasses.replace(p, score=float(hit.get("score", 0.0))))
      out.append(row)
    return out


class FunctionRetriever:
  """A user's function fn(queries, k) -> per query a list of Passage or dicts (id, title, text, score)."""

  def __init__(self, fn: Callable):
    self.fn = fn

  def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
    result = self.fn(list(queries), k)
    if len(result) != len(queries):
      raise ValueError(f"retriever function returned {len(result)} lists for {len(queries)} queries")
    return [[h if isinstance(h, Passage) else
             dataclasses.replace(_passage(dict(h), "retriever function", CorpusColumns()), score=float(h.get("score", 0)))
             for h in hits][:k] for hits in result]


def service(cfg) -> Optional["RetrievalService"]:
  """The run's retrieval service from its `env` section (rlax.envs.config.EnvConfig), None where env.retriever is
  unset; called once per run by rlax.builders.episodes."""
  if not cfg.retriever:
    return None
  return RetrievalService(make_retriever(cfg.retriever, cfg.corpus, timeout_s=cfg.tool_timeout_s),
                          window_s=cfg.retrieval_window_ms / 1000, stall_s=cfg.tool_timeout_s)


def make_retriever(spec: str, corpus: str = "", columns: CorpusColumns = CorpusColumns(), timeout_s: float = 30.0
                   ) -> Retriever:
  """The retriever `spec` names (see the module docstring); one ValueError naming what is wrong."""
  if spec in ("bm25", "bm25_fuzzy"):
    if not corpus:
      raise ValueError(f"retriever {spec!r} needs a corpus (env.corpus)")
    return BM25Retriever(corpus, columns, fuzzy=spec == "bm25_fuzzy")
  if spec.startswith(("http://", "https://")):
    return HttpRetriever(spec, timeout_s=timeout_s)
  if ":" in spec:
    return FunctionRetriever(imports.by_path(spec, f"retriever {spec!r}", "a function"))
  raise ValueError(f"retriever {spec!r}: use 'bm25', 'bm25_fuzzy', an http(s):// URL or 'module:function'")


class RetrievalService:
  """One retriever for the run, shared by every episode: queries that arrive within `window_s` of the first
  (at most `max_batch`) go to the retriever in one call on this service's thread; a call that fails is retried
  query by query, so one bad query fails only its own search. A call running past `stall_s` (a hung server or
  function: user code, trusted but bounded) is abandoned: a fresh thread serves the queue from the next
  search on, and the stuck one exits when its call returns. `version` names the index's content where known (a
  BM25 index's key), for the tool journal's fingerprint."""

  def __init__(self, retriever: Retriever, window_s: float = 0.005, max_batch: int = 256, stall_s: float = 30.0):
    self.retriever, self.window_s, self.max_batch, self.stall_s = retriever, window_s, max_batch, stall_s
    self.version = os.path.basename(getattr(retriever, "index_dir", "") or "")
    self.batches, self.queries, self.stalled = 0, 0, 0
    self._q: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._busy_since: Optional[float] = None  # when the serving thread's retriever call began
    self._closed = False
    self._thread = self._start()

  def _start(self) -> threading.Thread:
    t = threading.Thread(target=self._run, name="retrieval", daemon=True)
    t.start()
    return t

  def submit(self, query: str, k: int) -> concurrent.futures.Future:
    """A future of `query`'s top-k passages."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      if self._closed:
        fut.set_exception(RuntimeError("the retrieval service is closed"))
        return fut
      busy = self._busy_since
      if busy is not None and time.monotonic() - busy > self.stall_s:
        self.stalled += 1
        logging.warning("retrieval: a retriever call has run %.0fs (over %gs); it is abandoned and a fresh thread "
                        "serves the searches", time.monotonic() - busy, self.stall_s)
        self._busy_since, self._thread = None, self._start()
      self._q.put((str(query), int(k), fut))
    return fut

  async def search(self, query: str, k: int) -> list[Passage]:
    """`submit`, awaited on the caller's event loop (bound it with asyncio.wait_for for a deadline)."""
    return await asyncio.wrap_future(self.submit(query, k))

  def _run(self) -> None:
    me = threading.current_thread()
    while True:
      first = self._q.get()
      if first is None:
        return
      batch, end = [first], time.monotonic() + self.window_s
      while len(batch) < self.max_batch:
        try:
          item = self._q.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
          break
        if item is None:
          self._q.put(None)  # finish this batch, then stop
          break
        batch.append(item)
      self._answer([b for b in batch if b[2].set_running_or_notify_cancel()], me)
      if self._thread is not me:  # abandoned while its call hung: the fresh thread serves the queue
        return

  def _call(self, queries: list, k: int, me: threading.Thread) -> list:
    with self._lock:
      if self._thread is me:
        self._busy_since = time.monotonic()
    try:
      return self.retriever.search(queries, k)
    finally:
      with self._lock:
        if self._thread is me:
          self._busy_since = None

  def _answer(self, batch: list, me: threading.Thread) -> None:
    """One retriever call per distinct k (callers that asked for fewer get their top-k)."""
    for k in sorted({b[1] for b in batch}):
      part = [b for b in batch if b[1] == k]
      try:
        hits = self._call([b[0] for b in part], k, me)
        if len(hits) != len(part):
          raise ValueError(f"the retriever returned {len(hits)} lists for {len(part)} queries")
      except Exception as e:  # the retriever is user code: its failure fails these calls, not the run
        if len(part) == 1:
          part[0][2].set_exception(e)
          continue
        for b in part:  # one query's failure (a bad query) must not fail the batch's others
          self._answer([b], me)
        continue
      self.batches, self.queries = self.batches + 1, self.queries + len(part)
      for b, h in zip(part, hits):
        b[2].set_result(list(h))

  def close(self) -> None:
    """Answers what was submitted (waiting at most `stall_s` for a running call), then stops the thread."""
    with self._lock:
      self._closed = True
      self._q.put(None)
      thread = self._thread
    thread.join(timeout=self.stall_s)
