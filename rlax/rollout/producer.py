"""The rollout producer: the sampler role's loop, generating, grading and packing one batch per step.

Batch `s` is generated with weights of version >= s - k (exactly s - k in deterministic mode: the
weights service keeps the last k + 1 versions), so staleness is bounded by construction; the queue's
check is the safety net. With dynamic sampling (DAPO), prompt groups whose rewards all tie are dropped
and refilled from fresh prompts through `GroupBuffer`, up to `MAX_ROUNDS` sampling rounds per batch
(then tied groups fill the rest, harmlessly: their advantage is 0), so the batch shape never changes.
Random keys derive from (seed, step, round, prompt) only, so a lost batch can be regenerated exactly.
Every rollout is an episode: a single-turn run's are one-turn episodes (rlax.envs.one_turn), so one path
serves every run.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from typing import Any, Callable, Optional

from absl import logging
import numpy as np

from rlax import envs
from rlax.data.dynamic_sampling import GroupBuffer, informative_groups
from rlax.rollout import packing
from rlax.rollout import stats as rollout_stats
from rlax.rollout.queue import Closed, Rollout
from rlax.sampler import concat_outputs
from rlax.topology import SliceLostError

MAX_ROUNDS = 4  # dynamic sampling: the most sampling rounds spent filling one batch


@dataclasses.dataclass(frozen=True)
class _Done:
  """A finished, graded prompt group: draw number, record, host output [G rows], rewards [G] (float32, as
  trained), oldest weight version among its tokens, per-episode stats and forks [G, N] or None
  (rlax.envs.episodes.FinishedEpisodes)."""
  seq: int
  record: Any
  out: Any
  rewards: np.ndarray
  oldest: int
  episodes: tuple
  forks: Optional[np.ndarray]

  @classmethod
  def of(cls, f, seq: int, record) -> "_Done":
    return cls(seq, record, f.out, np.asarray(f.rewards, np.float32), int(np.min(f.out.versions[:, 0])),
               tuple(f.episodes), f.forks)


class RolloutProducer:
  """Generates batches [first, end) into `sink(rollout)`; `start()` runs it in a thread.

  `weights`: the WeightsService the sampler reads; `data`: a RecordIterator; `grade(reward_fn,
  texts, records)`: the verifier pool's grading; `ensure_alive(mesh)`: raises when the sampler's
  slices are lost (failover). `rollout` is the run's RolloutConfig; `max_staleness` k. `episodes(stream,
  sync, keys)`: wraps a sampler stream in an episode stream (`rlax.builders.episodes`: the configured
  environment's, rewards from it); None: one-turn episodes graded with `reward_fn` (`envs.single_turn_episodes`).
  `teacher`: a distilling run's rlax.teachers.Teacher, which scores each batch here, in the rollout path: on
  the sampler's devices in this thread; on devices of its own (rlax.services) in a thread of its own (`_Stage`),
  so the sampler generates the next batch while the teacher scores this one.
  """

  def __init__(self, *, sampler, weights, data, render, reward_fn, grade, method, rollout, max_staleness: int,
               deterministic: bool, dynamic_sampling: bool, seed: int, sink: Callable[[Rollout], Any],
               ensure_alive: Callable[[Any], None] = lambda mesh: None, stale_policy: str = "drop",
               episodes: Optional[Callable[..., Any]] = None, teacher=None):
    self.sampler, self.weights, self.data, self.render = sampler, weights, data, render
    self.reward_fn, self.grade, self.method, self.r = reward_fn, grade, method, rollout
    self.k, self.deterministic, self.dynamic, self.seed = max_staleness, deterministic, dynamic_sampling, seed
    self.sink, self.ensure_alive, self.stale_policy, self.teacher = sink, ensure_alive, stale_policy, teacher
    self.episodes = episodes or envs.single_turn_episodes(render, reward_fn, grade)
    self.error: Optional[BaseException] = None
    self._thread: Optional[threading.Thread] = None
    self._current = None
    self._on_error: Callable[[], None] = lambda: None

  # -- weights ---------------------------------------------------------------------------------------------
  def _weights_for(self, s: int) -> float:
    """Takes weights fit for batch s (version >= s - k; exactly s - k in deterministic mode) as the ones the
    sampler uses next; returns the seconds spent waiting for them."""
    params, v, idle = self.weights.wait_for(max(0, s - self.k), exact=self.deterministic)
    self._current = (params, v)
    return idle

  def _source(self):
    """What the sampler reads at every decode chunk: the newest published version with
    rollout.inflight_updates, else the batch's own."""
    return self.weights.latest() if self.r.inflight_updates else self._current

  # -- one batch -------------------------------------------------------------------------------------------
  def _packed(self, groups: list[_Done]) -> tuple[Any, tuple[np.ndarray, ...]]:
    """Prompt groups → (RolloutBatch, per-row info: response lengths, truncated (hit max_new_tokens), records)."""
    out = concat_outputs([g.out for g in groups])
    forks = None if groups[0].forks is None else np.concatenate([g.forks for g in groups])
    batch = packing.pack(out, np.concatenate([g.rewards for g in groups]), self.sampler.max_prompt_len, forks)
    records = [g.record for g in groups for _ in range(len(g.rewards))]
    return batch, (np.asarray(out.lengths), rollout_stats.truncated_from_finish_reason(out.finish_reason), records)

  def _round(self, s: int, rnd: int):
    """One sampling round of P prompts x G samples, every episode to its end (each turn's answer applied before
    the next decode chunk: a schedule fixed by the tokens, so deterministic runs regenerate it exactly) →
    (groups in prompt order, seconds generating, seconds grading, the episode stream)."""
    P, G = self.r.prompts_per_step, self.r.samples_per_prompt
    records = self.data.next_batch(P)
    t0 = time.perf_counter()
    self.ensure_alive(self.sampler.mesh)
    with self.episodes(self.sampler.stream(self.method, weights=self._source), sync=True, keys=True) as eps:
      done = eps.run(records, samples_per_prompt=G, seed=self.seed, step=s,
                     prompt_ids=[(s * MAX_ROUNDS + rnd) * P + i for i in range(len(records))])
    groups = [_Done.of(f, i, rec) for i, (f, rec) in enumerate(zip(done, records))]
    return groups, time.perf_counter() - t0 - eps.reward_s, eps.reward_s, eps

  def batch(self, s: int) -> tuple[Any, tuple[np.ndarray, ...], dict]:
    """Batch s, graded and packed → (RolloutBatch, per-row (lengths, truncated, records), stats)."""
    if not self.dynamic:
      groups, t_gen, t_rew, eps = self._round(s, 0)
      stats = {"gen_s": t_gen, "reward_s": t_rew}
    else:
      buf = GroupBuffer(self.r.prompts_per_step)
      t_gen = t_rew = 0.0
      for rnd in range(MAX_ROUNDS):
        done, g, w, eps = self._round(s, rnd)
        t_gen, t_rew = t_gen + g, t_rew + w
        buf.add(done, np.stack([d.rewards for d in done]))
        if buf.ready():
          break
      groups, rewards = buf.pop_batch(fill=True)
      _, tied = informative_groups(rewards)
      stats = {"gen_s": t_gen, "reward_s": t_rew, "dyn_dropped_groups": float(buf.dropped),
               "dyn_rounds": float(rnd + 1), "dyn_tied_in_batch": float(tied)}
    stats.update(eps.stats([e for g in groups for e in g.episodes]))
    batch, rows = self._packed(groups)
    return batch, rows, stats

  # -- streaming groups ---------------------------------------------------------------------------
  def streams(self) -> bool:
    """Groups stream into batches unless the run is deterministic (a deterministic batch is generated whole,
    by exactly version s - k)."""
    return not self.deterministic

  def _draw(self, stream, s: int, n: int) -> int:
    """Submits up to n more prompts, each remembering the data position before it; returns how many."""
    for i in range(n):
      before = self.data.get_state()
      records = self.data.next_batch(1)
      if not records:
        return i
      seq, self._seq = self._seq, self._seq + 1
      self._drawn[seq] = before
      stream.submit(records, samples_per_prompt=self.r.samples_per_prompt, seed=self.seed, step=s,
                    prompt_ids=[seq], tags=[(seq, records[0])])
    return n

  def _resume_state(self) -> dict:
    """Where a restart resumes the data: before the oldest prompt not yet in a sunk batch (its group is then
    generated again, never lost), or the current position when none is in flight."""
    return self._drawn[min(self._drawn)] if self._drawn else self.data.get_state()

  def _stream_batch(self, stream, s: int) -> tuple[Any, tuple[np.ndarray, ...], dict]:
    """Batch s from prompt groups in the order they finish.

    A group serves batch s when its oldest token is at most k versions older than s. With
    stale_policy="drop" an older one is dropped, and a decoding one is stopped as soon as it can no longer
    serve (its prompt was consumed; both counted in `stale_groups_dropped`); "importance_weight" keeps them
    for the trainer's per-token correction. Prompts stay in flight for the
    rest of this batch plus `rollout.stream_ahead` more when the sampler's weights can serve batch s + 1,
    so slots freed by short rows start the next batch's prompts. Dynamic sampling sets tied groups aside
    and draws replacements, up to MAX_ROUNDS x P prompts per batch (then tied groups fill the rest).
    """
    P = self.r.prompts_per_step
    buf = GroupBuffer(P) if self.dynamic else None
    ready: list[_Done] = []
    done, self._carry = self._carry, []
    drawn = stale = 0
    t_gen = t_rew = 0.0
    dropping = self.stale_policy == "drop"  # else stale groups are kept and importance-weighted
    while True:
      if dropping:
        for seq, _ in stream.cancel_older(s - self.k):  # can no longer serve any batch: free their slots
          stale += 1
          del self._drawn[seq]
        for g in [g for g in done if g.oldest < s - self.k]:
          stale += 1
          del self._drawn[g.seq]
        done = [g for g in done if g.oldest >= s - self.k]
      if buf is not None and done:
        buf.add(done, np.stack([g.rewards for g in done]))
      elif buf is None:
        ready += done
      have = P - buf.needed() if buf is not None else len(ready)
      if have >= P or (buf is not None and drawn >= MAX_ROUNDS * P and not stream.pending):
        break
      # In flight: what this batch still needs, plus the next batch's share when the weights can serve it
      # (otherwise a prompt past this batch's need could only finish too stale).
      ahead = self.r.ahead if self._source()[1] >= s + 1 - self.k else 0  # the weights the next chunk uses
      want = P - have + ahead - stream.pending
      if buf is not None:
        want = min(want, MAX_ROUNDS * P - drawn)
      drawn += self._draw(stream, s, want)
      if not stream.pending:
        raise RuntimeError(f"the prompt stream ended before batch {s} was full ({have} of {P} groups)")
      t0, r0 = time.perf_counter(), stream.reward_s
      self.ensure_alive(self.sampler.mesh)
      done = [_Done.of(f, *f.tag) for f in stream.step()]
      graded = stream.reward_s - r0
      t_gen, t_rew = t_gen + time.perf_counter() - t0 - graded, t_rew + graded
    stats = {"gen_s": t_gen, "reward_s": t_rew, "stale_groups_dropped": float(stale),
             "slot_utilization": stream.timings()["slot_utilization"]}
    if buf is not None:
      groups, rewards = buf.pop_batch(fill=True)
      self._carry = buf.take_surplus()  # informative groups past this batch serve the next one
      for g in buf.take_spares():       # tied groups not needed: dropped, as dynamic sampling does
        del self._drawn[g.seq]
      _, tied = informative_groups(rewards)
      stats.update(dyn_dropped_groups=float(buf.dropped), dyn_rounds=float(-(-drawn // P)),
                   dyn_tied_in_batch=float(tied))
    else:
      groups, self._carry = ready[:P], ready[P:]
    stats.update(stream.stats([e for g in groups for e in g.episodes]))
    for g in groups:
      del self._drawn[g.seq]
    batch, rows = self._packed(groups)
    return batch, rows, stats

  # -- the loop --------------------------------------------------------------------------------------------
  def run(self, first: int, end: int) -> None:
    """Produces batches first..end-1 in this thread; returns at the end or when the weights close."""
    stream = None
    apart = self.teacher is not None and self.teacher.mesh != self.sampler.mesh
    stage = _Stage(self._fail) if apart else None
    try:
      for s in range(first, end):
        idle = self._weights_for(s)
        if stream is None and self.streams():  # opened once weights are installed
          stream = self.episodes(self.sampler.stream(self.method, weights=self._source), sync=False, keys=True)
          self._drawn, self._seq, self._carry = {}, 0, []
        t0 = time.perf_counter()
        batch, rows, stats = self._stream_batch(stream, s) if stream else self.batch(s)
        stats["sampler_idle_s"] = idle
        data_state = self._resume_state() if stream else self.data.get_state()
        finish = functools.partial(self._finish, s, batch, rows, stats, data_state, t0)
        if stage:
          stage.put(finish)
        else:
          finish()
    except BaseException:
      if stage:
        stage.close(drain=False)  # the batches waiting are not handed over: report now
      raise
    if stage:
      stage.close()

  def _finish(self, s: int, batch, rows, stats: dict, data_state: dict, t0: float) -> None:
    """The teacher's scores (a distilling run's), the batch's stats, and the batch to the sink."""
    lens, truncated, records = rows
    if self.teacher is not None:  # off the trainer's path: it takes batches from the queue
      t1 = time.perf_counter()
      self.ensure_alive(self.teacher.mesh)
      batch = batch.replace(**self.teacher.scores(batch, records))
      stats["teacher_s"] = time.perf_counter() - t1
      for name, (n, secs) in self.teacher.last.items():  # each teacher's cost this step
        stats.update({f"teacher_s/{name}": secs, f"teacher_rows/{name}": float(n)})
    rw = np.asarray(batch.rewards)
    stats.update(rollout_stats.rollout_stats(lens, truncated, rw, [r.source for r in records]))
    stats.update(reward=float(rw.mean()), pass_rate=float((rw > 0.5).mean()), response_len=float(lens.mean()),
                 response_tokens=float(lens.sum()), gen_tokens_per_s=float(lens.sum()) / max(stats["gen_s"], 1e-9),
                 rollout_s=time.perf_counter() - t0)
    self.sink(Rollout(s, int(np.asarray(batch.versions).min()), batch, stats, data_state))

  def _fail(self, e: BaseException) -> None:
    """An error in the producer or its scoring stage: kept in `.error` (the trainer loop surfaces it)."""
    if e is self.error:  # the stage's, raised again by the producer
      return
    if not isinstance(e, SliceLostError):
      logging.exception("rollout producer failed", exc_info=e)
    self.error = e
    self._on_error()

  def start(self, first: int, end: int, on_error: Callable[[], None]) -> None:
    """Runs `run(first, end)` in a daemon thread; an error is kept in `.error` and `on_error()` is called."""
    def body():
      try:
        self.run(first, end)
      except Closed:
        pass
      except BaseException as e:  # surfaced by the trainer loop, which owns the run
        self._fail(e)
    self.error, self._on_error = None, on_error
    self._thread = threading.Thread(target=body, daemon=True, name="rollout-producer")
    self._thread.start()

  def join(self, timeout: float = 60.0) -> None:
    if self._thread is not None:
      self._thread.join(timeout=timeout)


class _Stage:
  """Runs the callables `put` hands it in order, in a thread of its own, one waiting at most (the producer runs
  a batch ahead of it, no more). Its error goes to `fail` at once (so a trainer waiting for the batch stops) and
  is raised again by the next `put` and by `close`."""

  def __init__(self, fail: Callable[[BaseException], None]):
    self._fail, self._jobs = fail, queue.Queue(maxsize=1)
    self._error: Optional[BaseException] = None
    self._stopped, self._drain = False, True
    self._thread = threading.Thread(target=self._body, daemon=True, name="rollout-scoring")
    self._thread.start()

  def _body(self) -> None:
    while (job := self._jobs.get()) is not None and self._drain:
      try:
        job()
      except Closed:  # the trainer's queue closed: nothing more to hand over
        break
      except BaseException as e:
        self._error = e
        self._fail(e)
        break
    self._stopped = True

  def _raise(self) -> None:
    if self._error is not None:
      raise self._error
    raise Closed("the scoring stage stopped")

  def put(self, job: Callable[[], None]) -> None:
    while not self._stopped:
      try:
        return self._jobs.put(job, timeout=0.1)
      except queue.Full:
        pass
    self._raise()

  def close(self, drain: bool = True) -> None:
    """Waits for the jobs handed over to finish (`drain`), or for the one running (not `drain`); raises the
    stage's error."""
    self._drain = drain
    while not self._stopped:
      try:
        self._jobs.put(None, timeout=0.1)
        break
      except queue.Full:
        pass
    self._thread.join()
    if self._error is not None:
      raise self._error
