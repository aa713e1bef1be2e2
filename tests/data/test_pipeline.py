"""Records I/O and the grain stream: determinism, shards, mixture, epochs, resumable position."""

import collections
import json

import pytest

from rlax.data import pipeline
from rlax.data import records as R


def _recs(n, source="s", prefix="r"):
  return [R.Record(id=f"{prefix}{i}", prompt=f"q {prefix}{i}", answer=str(i), source=source)
          for i in range(n)]


def test_jsonl_round_trip(tmp_path):
  recs = _recs(5) + [R.Record(id="c", prompt="write f", tests=("assert f() == 1",), task="code",
                              metadata={"k": [1, 2]})]
  path = str(tmp_path / "x.jsonl")
  assert R.write_jsonl(recs, path) == 6
  back = R.read_records(path)
  assert back == recs
  assert back[-1].tests == ("assert f() == 1",)


def test_bad_inputs_raise_precise_errors(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"id": "a", "prompt": "p", "answer": "1"}\n{"id": "b", "answer": "1"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: .*missing 'id' or 'prompt'"):
    R.read_records(str(path))
  with pytest.raises(ValueError, match="unknown fields"):
    R.Record.from_dict({"id": "a", "prompt": "p", "answer": "1", "bogus": 1})
  with pytest.raises(ValueError, match="pyarrow|parquet"):
    R.read_records(str(tmp_path / "x.parquet"))
  with pytest.raises(ValueError, match="unsupported record file"):
    R.read_records("x.csv")


def test_shuffle_is_deterministic_and_seed_dependent():
  recs = _recs(50)
  a = [r.id for r in pipeline.RecordIterator(recs, seed=1, num_epochs=1)]
  b = [r.id for r in pipeline.RecordIterator(recs, seed=1, num_epochs=1)]
  c = [r.id for r in pipeline.RecordIterator(recs, seed=2, num_epochs=1)]
  assert a == b and a != c
  assert sorted(a) == sorted(r.id for r in recs)  # a permutation: nothing lost or repeated


def test_epochs_reshuffle_and_cover_each_record_once_per_epoch():
  recs = _recs(20)
  ids = [r.id for r in pipeline.RecordIterator(recs, seed=0, num_epochs=3)]
  assert len(ids) == 60
  epochs = [ids[i * 20:(i + 1) * 20] for i in range(3)]
  for e in epochs:
    assert sorted(e) == sorted(r.id for r in recs)
  assert epochs[0] != epochs[1]


def test_shards_are_disjoint_and_cover_the_stream():
  recs = _recs(40)
  full = [r.id for r in pipeline.RecordIterator(recs, seed=3, num_epochs=1)]
  shards = [[r.id for r in pipeline.RecordIterator(recs, seed=3, num_epochs=1, shard_index=i,
                                                  shard_count=4)] for i in range(4)]
  assert all(len(s) == 10 for s in shards)
  assert sorted(sum(shards, [])) == sorted(full)
  assert shards[1] == full[1::4]
  with pytest.raises(ValueError, match="shard_index"):
    pipeline.make_dataset(recs, seed=0, shard_index=4, shard_count=4)


def test_mixture_follows_weights():
  sources = {"a": _recs(30, "a", "a"), "b": _recs(30, "b", "b")}
  it = pipeline.RecordIterator(sources, seed=0, weights={"a": 3.0, "b": 1.0})
  counts = collections.Counter(r.source for r in it.next_batch(400))
  assert counts["a"] == 300 and counts["b"] == 100
  again = pipeline.RecordIterator(sources, seed=0, weights={"a": 3.0, "b": 1.0}).next_batch(50)
  assert [r.id for r in again] == [r.id for r in
                                   pipeline.RecordIterator(sources, seed=0, weights=[3, 1]).next_batch(50)]
  with pytest.raises(ValueError, match="weights keys"):
    pipeline.make_dataset(sources, seed=0, weights={"a": 1.0})
  with pytest.raises(ValueError, match="positive"):
    pipeline.make_dataset(sources, seed=0, weights=[1.0, 0.0])


def test_state_resumes_at_same_position_through_json():
  sources = {"a": _recs(13, "a", "a"), "b": _recs(7, "b", "b")}
  kw = dict(seed=5, weights=[2.0, 1.0], shard_index=1, shard_count=2)
  it = pipeline.RecordIterator(sources, **kw)
  it.next_batch(37)  # past the end of the first epochs of both sources
  state = json.loads(json.dumps(it.get_state()))
  expected = [r.id for r in it.next_batch(25)]
  fresh = pipeline.RecordIterator(sources, **kw)
  fresh.set_state(state)
  assert [r.id for r in fresh.next_batch(25)] == expected
  other = pipeline.RecordIterator(sources, **{**kw, "seed": 6})
  with pytest.raises(ValueError, match="saved for stream"):
    other.set_state(state)


def test_transform_is_applied_lazily():
  ds = pipeline.make_dataset(_recs(4), seed=0, num_epochs=1, transform=lambda r: len(r.prompt))
  assert sorted(ds) == [4, 4, 4, 4]
