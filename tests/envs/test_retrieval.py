"""Retrievers for search tools: BM25 over a corpus file (index built once, keyed by the corpus's content),
Search-R1's HTTP protocol against a local server, a user's function, and the run's batching service."""

import asyncio
import http.server
import json
import os
import threading
import time

import pytest

from rlax.envs import retrieval as R

ROWS = [{"id": "p1", "title": "Quellan", "text": "Quellan is the capital of Zorbia, founded by Mira Tolvane."},
        {"id": "p2", "title": "Mira Tolvane", "text": "Mira Tolvane was born in Ostrevar in 1702."},
        {"id": "p3", "title": "Ostrevar", "text": "Ostrevar is a river port known for glass."},
        {"id": "p4", "title": "Glass", "text": "Glass is made from sand."}]


def _corpus(tmp_path, rows=ROWS, name="corpus.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_bm25_finds_the_passage_and_keeps_its_index_for_the_next_run(tmp_path):
  path = _corpus(tmp_path)
  first = R.make_retriever("bm25", path)
  assert first.built and os.path.isdir(first.index_dir) and first.index_dir.startswith(path + ".bm25-")
  hits = first.search(["capital of Zorbia", "where was Mira Tolvane born", "xylophone"], 2)
  assert hits[0][0].id == "p1" and hits[1][0].id == "p2"
  assert hits[0][0].score >= hits[0][-1].score > 0
  assert hits[2] == []  # nothing matches: no passage, never a zero-score filler
  again = R.make_retriever("bm25", path)
  assert not again.built and again.index_dir == first.index_dir
  assert again.search(["capital of Zorbia"], 2) == first.search(["capital of Zorbia"], 2)
  edited = _corpus(tmp_path, ROWS + [{"id": "p5", "title": "Zorbia", "text": "Zorbia lies east."}])
  assert R.make_retriever("bm25", edited).index_dir != first.index_dir  # new content, new index


def test_corpus_rows_are_mapped_or_named_when_wrong(tmp_path):
  search_r1 = _corpus(tmp_path, [{"id": 7, "contents": '"Quellan"\nQuellan is the capital of Zorbia.'}], "s.jsonl")
  p = R.read_passages(search_r1)[0]
  assert (p.id, p.title, p.text) == ("7", "Quellan", "Quellan is the capital of Zorbia.")
  nested = _corpus(tmp_path, [{"doc": {"key": "a", "body": "text"}}], "n.jsonl")
  assert R.read_passages(nested, R.CorpusColumns(id="doc.key", title="doc.t", text="doc.body"))[0].id == "a"
  with pytest.raises(ValueError, match=r"n.jsonl:1: no 'id' field"):
    R.read_passages(nested)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": 1, "text": "a"}\n{oops\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
    R.read_passages(str(bad))
  with pytest.raises(ValueError, match="does not exist"):
    R.make_retriever("bm25", str(tmp_path / "missing.jsonl"))
  with pytest.raises(ValueError, match="use 'bm25', 'bm25_fuzzy', an http"):
    R.make_retriever("faiss")


class _SearchR1Handler(http.server.BaseHTTPRequestHandler):
  def do_POST(self):
    req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    result = [[{"document": {"id": f"{q}-{i}", "contents": f'"T{i}"\nabout {q}'}, "score": 1.0 / (i + 1)}
               for i in range(req["topk"])] for q in req["queries"]]
    body = json.dumps({"result": result}).encode()
    self.send_response(200)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args):
    pass


def test_http_retriever_speaks_search_r1s_protocol():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SearchR1Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    r = R.make_retriever(f"http://127.0.0.1:{server.server_port}/retrieve")
    hits = r.search(["alpha", "beta"], 2)
    assert [[h.id for h in row] for row in hits] == [["alpha-0", "alpha-1"], ["beta-0", "beta-1"]]
    assert hits[1][1] == R.Passage("beta-1", "T1", "about beta", 0.5)
  finally:
    server.shutdown()


def user_retriever(queries, k):
  return [[{"id": q, "title": "", "text": q.upper(), "score": 1.0}] * 3 for q in queries]


def test_a_users_function_by_import_path():
  r = R.make_retriever(f"{__name__}:user_retriever")
  assert r.search(["a"], 2) == [[R.Passage("a", "", "A", 1.0)] * 2]
  with pytest.raises(ValueError, match="cannot import"):
    R.make_retriever("no_such_module:fn")


class _Slow:
  def __init__(self, delay):
    self.delay, self.calls = delay, []

  def search(self, queries, k):
    self.calls.append(list(queries))
    time.sleep(self.delay)
    if "boom" in queries:
      raise RuntimeError("index offline")
    return [[R.Passage(q, "", q, 1.0)][:k] for q in queries]


def test_service_batches_concurrent_episodes_and_bounds_their_wait():
  """Episodes on two event loops search at once: one retriever call answers them; a deadline ends a caller's
  wait (the service goes on); a retriever error fails that batch's calls only; close answers what is queued."""
  slow = _Slow(0.05)
  service = R.RetrievalService(slow, window_s=0.05)

  async def episodes(names):
    return await asyncio.gather(*(service.search(n, 3) for n in names))

  out = {}
  threads = [threading.Thread(target=lambda i=i: out.update({i: asyncio.run(episodes([f"q{i}a", f"q{i}b"]))}))
             for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(h[0].id for r in out.values() for h in r) == ["q0a", "q0b", "q1a", "q1b"]
  assert len(slow.calls) == 1 and service.batches == 1 and service.queries == 4

  async def with_deadline():
    return await asyncio.wait_for(service.search("late", 1), timeout=0.01)

  slow.delay = 0.3
  with pytest.raises(asyncio.TimeoutError):
    asyncio.run(with_deadline())
  slow.delay = 0.0
  with pytest.raises(RuntimeError, match="index offline"):
    asyncio.run(service.search("boom", 1))
  assert asyncio.run(service.search("after", 1))[0].id == "after"
  pending = service.submit("queued", 1)
  service.close()
  assert pending.result(timeout=1)[0].id == "queued"
  with pytest.raises(RuntimeError, match="closed"):
    service.submit("x", 1).result()


def test_fuzzy_bm25_finds_a_misspelt_name_and_ranks_the_exact_one_first(tmp_path):
  path = str(tmp_path / "c.jsonl")
  rows = [{"id": "a", "title": "Mosnan Nevi", "text": "Mosnan Nevi was born in Kidol in 1886."},
          {"id": "b", "title": "Giki Kolpes", "text": "Giki Kolpes worked as a botanist."},
          {"id": "c", "title": "Kidol", "text": "Kidol is a city in Nisgi."},
          {"id": "d", "title": "Mosna Nevin", "text": "Mosna Nevin worked as a miller."}]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  words, fuzzy = R.make_retriever("bm25", path), R.make_retriever("bm25_fuzzy", path)
  assert fuzzy.index_dir == words.index_dir + "-fuzzy" and fuzzy.built
  assert words.search(["Moschen Nevvi"], 2) == [[]]  # no word in common
  assert [p.id for p in fuzzy.search(["Moschen Nevvi"], 2)[0]][:1] in (["a"], ["d"])
  assert [p.id for p in fuzzy.search(["Mosnan Nevi"], 2)[0]] == ["a", "d"]  # the exact name first
  assert [p.id for p in fuzzy.search(["Kolpes"], 1)[0]] == ["b"]
  assert not R.make_retriever("bm25_fuzzy", path).built  # its own index, loaded the second time


def test_one_bad_query_fails_only_its_own_search_and_a_hung_call_is_abandoned():
  slow = _Slow(0.0)
  service = R.RetrievalService(slow, window_s=0.05, stall_s=0.3)

  async def together(names):
    return await asyncio.gather(*(service.search(n, 1) for n in names), return_exceptions=True)

  good, bad = asyncio.run(together(["fine", "boom"]))
  assert good[0].id == "fine" and isinstance(bad, RuntimeError)  # the batch failed, then each query alone
  release = threading.Event()

  class Hung:
    def search(self, queries, k):
      if "hang" in queries:
        release.wait(10)
      return [[R.Passage(q, "", q)] for q in queries]

  service = R.RetrievalService(Hung(), window_s=0.0, stall_s=0.3)
  stuck = service.submit("hang", 1)
  time.sleep(0.5)  # past stall_s: the next search starts a fresh thread
  assert asyncio.run(asyncio.wait_for(service.search("next", 1), timeout=2))[0].id == "next"
  assert service.stalled == 1 and not stuck.done()
  t0 = time.monotonic()
  service.close()  # waits at most stall_s for the fresh thread; the stuck one is a daemon
  assert time.monotonic() - t0 < 2
  release.set()
  assert stuck.result(timeout=5)[0].id == "hang"  # it finishes and exits


def test_two_builders_of_one_index_both_succeed(tmp_path, monkeypatch):
  path = str(tmp_path / "c.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps({"id": "a", "title": "A", "text": "alpha beta"}) + "\n")
  first = R.make_retriever("bm25", path)
  real, asked = R.os.path.isfile, []

  def isfile(p):  # the second builder looked before the first had saved: it builds too, then finds theirs
    asked.append(p)
    return False if len(asked) == 1 else real(p)
  monkeypatch.setattr(R.os.path, "isfile", isfile)
  second = R.BM25Retriever(path)
  assert second.built and second.index_dir == first.index_dir and second.search(["alpha"], 1)[0][0].id == "a"
  assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
