"""The rollout producer: the sampler role's loop, generating, grading and packing one batch per step.

Batch `s` is generated with weights of version >= s - k (exactly s - k in deterministic mode: the
weights service keeps the last k + 1 versions), so staleness is bounded by construction; the queue's
check is the safety net. With dynamic sampling (DAPO), prompt groups whose rewards all tie are dropped
and refilled from fresh prompts through `GroupBuffer`, up to `MAX_ROUNDS` sampling rounds per batch
(then tied groups fill the rest, harmlessly: their advantage is 0), so the batch shape never changes.
Random keys derive from (seed, step, round, prompt) only, so a lost batch can be regenerated exactly.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from absl import logging
import numpy as np

from rlax.data.dynamic_sampling import GroupBuffer, informative_groups
from rlax.rollout import packing
from rlax.rollout import stats as rollout_stats
from rlax.rollout.queue import Closed, Rollout
from rlax.topology import SliceLostError

MAX_ROUNDS = 4  # dynamic sampling: the most sampling rounds spent filling one batch


class RolloutProducer:
  """Generates batches [first, end) into `sink(rollout)`; `start()` runs it in a thread.

  `weights`: the WeightsService the sampler subscribes to; `data`: a RecordIterator; `grade(reward_fn,
  texts, records)`: the verifier pool's grading; `ensure_alive(mesh)`: raises when the sampler's
  slices are lost (failover). `rollout` is the run's RolloutConfig; `max_staleness` k.
  """

  def __init__(self, *, sampler, weights, data, render, reward_fn, grade, method, rollout, max_staleness: int,
               deterministic: bool, dynamic_sampling: bool, seed: int, sink: Callable[[Rollout], Any],
               ensure_alive: Callable[[Any], None] = lambda mesh: None):
    self.sampler, self.weights, self.data, self.render = sampler, weights, data, render
    self.reward_fn, self.grade, self.method, self.r = reward_fn, grade, method, rollout
    self.k, self.deterministic, self.dynamic, self.seed = max_staleness, deterministic, dynamic_sampling, seed
    self.sink, self.ensure_alive = sink, ensure_alive
    self.error: Optional[BaseException] = None
    self._thread: Optional[threading.Thread] = None
    self._unsubscribe = None

  # -- weights ---------------------------------------------------------------------------------------------
  def _install(self, params, version: int) -> None:
    if version != self.sampler.version:
      self.sampler.update_weights(params, version)

  def _weights_for(self, s: int) -> float:
    """Installs weights fit for batch s; returns the seconds spent waiting for them."""
    params, v, idle = self.weights.wait_for(max(0, s - self.k), exact=self.deterministic)
    self._install(params, v)
    return idle

  def _inflight(self, chunk: int, t: int) -> None:
    """Between decode chunks: swap in the newest published version (rollout.inflight_updates)."""
    self._install(*self.weights.latest())

  # -- one batch -------------------------------------------------------------------------------------------
  def _round(self, s: int, rnd: int):
    """One sampling round of P prompts x G samples → (packed numpy batch, per-row info, seconds).

    Per-row info: response lengths, truncated (hit max_new_tokens), record sources."""
    P, G = self.r.prompts_per_step, self.r.samples_per_prompt
    records = self.data.next_batch(P)
    t0 = time.perf_counter()
    self.ensure_alive(self.sampler.mesh)
    out = self.sampler.generate(self.render.encode_all(records), samples_per_prompt=G,
                                strategy=self.method, seed=self.seed, step=s,
                                prompt_ids=[(s * MAX_ROUNDS + rnd) * P + i for i in range(len(records))],
                                on_chunk=self._inflight if self.r.inflight_updates else None)
    out = packing.to_host(out)  # the one device → host crossing of this round
    t1 = time.perf_counter()
    graded = self.grade(self.reward_fn, packing.completions(self.render.tokenizer, out),
                        [rec for rec in records for _ in range(G)])
    rewards = np.array([g[0] for g in graded], np.float32)
    batch = packing.pack(out, rewards, self.sampler.max_prompt_len)
    rows = (np.asarray(out.lengths), rollout_stats.truncated_from_finish_reason(out.finish_reason),
            np.array([rec.source for rec in records for _ in range(G)], dtype=object))
    return batch, rows, t1 - t0, time.perf_counter() - t1

  def batch(self, s: int) -> tuple[Any, tuple[np.ndarray, ...], dict]:
    """Batch s, graded and packed → (RolloutBatch, per-row (lengths, truncated, sources), stats)."""
    P, G = self.r.prompts_per_step, self.r.samples_per_prompt
    if not self.dynamic:
      batch, rows, t_gen, t_rew = self._round(s, 0)
      return batch, rows, {"gen_s": t_gen, "reward_s": t_rew}
    buf = GroupBuffer(P)
    t_gen = t_rew = 0.0
    for rnd in range(MAX_ROUNDS):
      batch, info, g, w = self._round(s, rnd)
      t_gen, t_rew = t_gen + g, t_rew + w
      groups = [np.arange(i * G, (i + 1) * G) for i in range(P)]
      buf.add([(batch, info, r) for r in groups], np.asarray(batch.rewards).reshape(P, G))
      if buf.ready():
        break
    groups, rewards = buf.pop_batch(fill=True)
    batch = packing.concat([packing.take_rows(b, r) for b, _, r in groups])
    rows = tuple(np.concatenate([info[j][r] for _, info, r in groups]) for j in range(3))
    _, tied = informative_groups(rewards)
    return batch, rows, {"gen_s": t_gen, "reward_s": t_rew, "dyn_dropped_groups": float(buf.dropped),
                         "dyn_rounds": float(rnd + 1), "dyn_tied_in_batch": float(tied)}

  # -- the loop --------------------------------------------------------------------------------------------
  def run(self, first: int, end: int) -> None:
    """Produces batches first..end-1 in this thread; returns at the end or when the weights close."""
    for s in range(first, end):
      idle = self._weights_for(s)
      t0 = time.perf_counter()
      batch, (lens, truncated, sources), stats = self.batch(s)
      rw = np.asarray(batch.rewards)
      stats.update(rollout_stats.rollout_stats(lens, truncated, rw, sources))
      stats.update(reward=float(rw.mean()), pass_rate=float((rw > 0.5).mean()), response_len=float(lens.mean()),
                   response_tokens=float(lens.sum()), sampler_idle_s=idle,
                   gen_tokens_per_s=float(lens.sum()) / max(stats["gen_s"], 1e-9),
                   rollout_s=time.perf_counter() - t0)
      self.sink(Rollout(s, int(np.asarray(batch.versions).min()), batch, stats, self.data.get_state()))

  def start(self, first: int, end: int, on_error: Callable[[], None]) -> None:
    """Runs `run(first, end)` in a daemon thread; an error is kept in `.error` and `on_error()` is called."""
    def body():
      try:
        self.run(first, end)
      except Closed:
        pass
      except BaseException as e:  # surfaced by the trainer loop, which owns the run
        if not isinstance(e, SliceLostError):
          logging.exception("rollout producer failed")
        self.error = e
        on_error()
    self.error = None
    self._thread = threading.Thread(target=body, daemon=True, name="rollout-producer")
    self._thread.start()

  def join(self, timeout: float = 60.0) -> None:
    if self._thread is not None:
      self._thread.join(timeout=timeout)
