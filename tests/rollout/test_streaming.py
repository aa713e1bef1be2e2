"""Streaming groups: the rollout producer over the engine fills each batch from the prompt groups
that finish first, keeps the next batch's prompts in flight, and resumes without losing a prompt."""

import dataclasses

import numpy as np
import pytest

from rlax import sampler as S
from rlax.config import RolloutConfig
from rlax.rollout.producer import RolloutProducer

from harness.sampling_ref import CFG, P0


@dataclasses.dataclass(frozen=True)
class Rec:
  id: int
  tokens: tuple
  limit: int
  source: str = "default"


class Data:
  """Records 0, 1, 2, ... in order; the position is the next id."""

  def __init__(self, records):
    self.records, self.pos = records, 0

  def next_batch(self, n):
    out = self.records[self.pos:self.pos + n]
    self.pos += len(out)
    return out

  def get_state(self):
    return {"pos": self.pos}

  def set_state(self, state):
    self.pos = state["pos"]


class Render:
  class tokenizer:  # pylint: disable=invalid-name
    @staticmethod
    def decode(tokens):
      return " ".join(map(str, tokens))

  @staticmethod
  def encode_all(records):
    return [list(r.tokens) for r in records]


class Weights:
  """A trainer `lag` versions behind the newest it could have pushed: batch s gets version s - lag."""

  def __init__(self, lag):
    self.version, self.lag, self.step = 0, lag, 0

  def wait_for(self, v, exact=False):  # called once per batch, in order
    self.version = max(v, self.step - self.lag)
    self.step += 1
    return P0, self.version, 0.0

  def latest(self):
    return P0, self.version


class LimitedEngine(S.Sampler):
  """Each record's length is its `limit` (random weights never stop): a prompt's group takes that long."""

  def stream(self, strategy=S.Temperature(1.0), *, weights=None, on_chunk=None):
    st = super().stream(strategy, weights=weights, on_chunk=on_chunk)
    submit = st.submit

    def with_limits(prompts, **kw):
      rec = kw["tags"][0][1]
      return submit(prompts, max_new_tokens=rec.limit, **kw)

    st.submit = with_limits
    return st


def producer(records, *, prompts=2, ahead=-1, dynamic=False, reward=None, k=1, lag=0):
  engine = LimitedEngine(CFG, max_prompt_len=8, max_new_tokens=40, slots=4, decode_chunk=2, params=P0)
  batches = []
  r = RolloutConfig(prompts_per_step=prompts, samples_per_prompt=2, max_prompt_len=8, max_new_tokens=40,
                    stream_ahead=ahead)
  reward = reward or (lambda text, rec: float(rec.id % 2))
  grade = lambda fn, texts, recs: [(fn(t, rec), {}) for t, rec in zip(texts, recs)]
  data = Data(records)
  p = RolloutProducer(sampler=engine, weights=Weights(lag), data=data, render=Render(), reward_fn=reward,
                      grade=grade, method=S.Temperature(1.0), rollout=r, max_staleness=k, deterministic=False,
                      dynamic_sampling=dynamic, seed=0, sink=batches.append)
  return p, batches, data


def records(limits):
  return [Rec(i, (1, 3 + i % 50, 7), n) for i, n in enumerate(limits)]


def batch_prompts(rollout):
  """The record ids of a batch's groups, in batch order (each group's G rows share one)."""
  ids = np.asarray(rollout.data.group_ids).reshape(-1, 2)
  assert np.all(ids[:, 0] == ids[:, 1])
  return ids[:, 0].tolist()


def test_batches_fill_from_the_groups_that_finish_first():
  # 4 slots = 2 groups decode at once; a trainer that keeps up gives batch s version s, which can serve
  # batch s + 1 too (k = 1), so P = 2 more prompts stay in flight. Prompt 0 runs 30 tokens: prompts 1
  # and 2 finish first and make batch 0, then 3 and 4 make batch 1. Batch 2 needs version >= 1: prompt 0,
  # begun with version 0, can serve no batch any more, so it is stopped and its slots go to 5 and 6.
  limits = [30, 2, 3, 2, 4, 3, 2, 2, 2]
  p, batches, _ = producer(records(limits))
  p.run(0, 3)
  assert [b.index for b in batches] == [0, 1, 2]
  assert batch_prompts(batches[0]) == [1, 2] and batch_prompts(batches[1]) == [3, 4]
  assert sorted(batch_prompts(batches[2])) == [5, 6]
  assert [b.stats["stale_groups_dropped"] for b in batches] == [0, 0, 1]
  for b in batches:  # whole groups: every row ran to its record's limit
    lens = np.asarray(b.data.input_mask)[:, 8:].sum(1)
    np.testing.assert_array_equal(lens, [limits[i] for i in batch_prompts(b) for _ in range(2)])
    assert b.version == int(np.asarray(b.data.versions).min())
  # A restart resumes the data before the oldest prompt still in flight (prompt 0 while it decodes):
  # its group is generated again rather than lost. After batch 2 nothing is in flight.
  assert [b.data_state for b in batches] == [{"pos": 0}, {"pos": 0}, {"pos": 7}]


def test_importance_weight_policy_keeps_long_groups():
  # The same long prompt 0, importance-weighted instead of dropped: it decodes on while short groups
  # stream past it, and lands whole in a later batch, its oldest tokens many versions old.
  p, batches, _ = producer(records([30] + [2] * 40))
  p.stale_policy = "importance_weight"
  p.run(0, 18)  # a short group takes one decode step: a chunk ends as soon as one finishes
  used = sum((batch_prompts(b) for b in batches), [])
  assert 0 in used and len(used) == len(set(used)) == 36
  late = next(b for b in batches if 0 in batch_prompts(b))
  assert late.index - late.version > 1 and late.stats["stale_groups_dropped"] == 0


def test_a_lagging_trainer_keeps_no_prompt_in_flight_past_the_batch():
  # Batch s gets version s - 1 (k = 1), which cannot serve batch s + 1: only this batch's prompts are
  # drawn, so batch 1 waits for prompt 0 rather than start prompts that would finish too stale.
  p, batches, _ = producer(records([30, 2, 3, 2, 4, 3, 2]), lag=1)
  p.run(0, 3)
  assert [batch_prompts(b) for b in batches[:2]] == [[1, 2], [3, 0]]
  assert sorted(batch_prompts(batches[2])) == [4, 5]
  assert [b.stats["stale_groups_dropped"] for b in batches] == [0, 0, 0]
  assert [b.data_state for b in batches] == [{"pos": 0}, {"pos": 4}, {"pos": 6}]


def test_dynamic_sampling_on_the_stream_replaces_tied_groups():
  # Odd prompts have both samples rewarded 1, even ones 0: every group ties except where the reward
  # depends on the sample; here reward = sample text parity, so some groups tie and are replaced.
  limits = [2] * 40
  reward = lambda text, rec: float(int(text.split()[0]) % 2) if rec.id % 3 else 0.0
  p, batches, _ = producer(records(limits), dynamic=True, reward=reward)
  p.run(0, 2)
  for b in batches:
    r = np.asarray(b.data.rewards).reshape(-1, 2)
    assert r.shape == (2, 2)
    assert b.stats["dyn_tied_in_batch"] == int(np.sum(r[:, 0] == r[:, 1]))
    assert all(i % 3 for i in batch_prompts(b)) or b.stats["dyn_tied_in_batch"] > 0
  assert sum(b.stats["dyn_dropped_groups"] for b in batches) > 0


class SlowTeacher:
  """A teacher on devices of its own (its mesh is not the sampler's): each scoring takes `delay` seconds, in the
  thread it is called from; the `fail_at`-th call raises."""

  mesh = "the teacher's own devices"
  last: dict = {}  # each teacher's (rows, seconds) of the last batch: none named here

  def __init__(self, delay, fail_at=-1):
    self.delay, self.fail_at, self.calls = delay, fail_at, []

  def scores(self, batch, records=None):
    import threading
    import time
    if len(self.calls) == self.fail_at:
      raise RuntimeError("the teacher failed")
    t0 = time.perf_counter()
    time.sleep(self.delay)
    self.calls.append((threading.current_thread().name, t0, time.perf_counter()))
    return {"teacher_logprobs": np.zeros(np.shape(batch.loss_mask), np.float32)}


def _timed_producer(teacher):
  import time
  p, batches, _ = producer(records([2] * 12))
  p.teacher = teacher
  asked, wait_for = [], p.weights.wait_for
  p.weights.wait_for = lambda v, exact=False: (asked.append(time.perf_counter()), wait_for(v, exact))[1]
  return p, batches, asked


def test_a_teacher_on_its_own_devices_scores_while_the_next_batch_generates():
  p, batches, asked = _timed_producer(SlowTeacher(0.5))
  p.run(0, 3)
  assert [b.index for b in batches] == [0, 1, 2] and all(b.stats["teacher_s"] >= 0.5 for b in batches)
  calls = p.teacher.calls
  assert [name for name, _, _ in calls] == ["rollout-scoring"] * 3
  assert asked[1] < calls[0][2] and asked[2] < calls[1][2]  # batch s + 1 began before batch s was scored


def test_the_scoring_stage_stops_the_producer_on_an_error():
  closed = []
  p, batches, _ = _timed_producer(SlowTeacher(0.0, fail_at=1))
  p.start(0, 3, on_error=lambda: closed.append(True))
  p.join()
  assert [b.index for b in batches] == [0] and closed == [True]
  assert isinstance(p.error, RuntimeError) and str(p.error) == "the teacher failed"
  direct, batches, _ = _timed_producer(SlowTeacher(0.0, fail_at=1))  # a sampler process calls run() itself
  with pytest.raises(RuntimeError, match="the teacher failed"):
    direct.run(0, 3)
  assert [b.index for b in batches] == [0]
