"""A pool of verifier threads that grades completions off the controller's thread.

Guarantees: results come back in submission order, one per request, none lost; a grader that
raises gives reward 0 with the exception as the reason; a grader that runs past `timeout_s`
(measured from when it started, not from when it was queued) gives reward 0 with reason 'timeout'
and its thread is written off — a replacement worker is started so capacity is kept (Python
threads cannot be killed; code graders bound themselves with the sandbox's wall clock, so in
practice only a pathological pure-Python grader hangs). Workers are daemon threads: a hung grader
never blocks interpreter exit.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

from absl import logging

RewardFn = Callable[[str, Any], tuple[float, dict]]


@dataclasses.dataclass
class _Job:
  fn: RewardFn
  completion: str
  record: Any
  timeout_s: float
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  started: Optional[float] = None
  result: Optional[tuple[float, dict]] = None
  abandoned: bool = False


class GradeBatch:
  """Handle to a submitted batch; `results()` blocks until every job finished or timed out."""

  def __init__(self, jobs: list[_Job], pool: "VerifierPool"):
    self._jobs, self._pool = jobs, pool

  def done(self) -> bool:
    return all(j.done.is_set() for j in self._jobs)

  def results(self) -> list[tuple[float, dict]]:
    """[(reward, info)] in submission order."""
    for job in self._jobs:
      job.done.wait()  # the pool's watchdog sets it at the latest timeout_s after the job starts
    return [job.result for job in self._jobs]


class VerifierPool:
  """`num_workers` daemon threads running reward functions with per-call timeouts."""

  def __init__(self, num_workers: int = 8, timeout_s: float = 30.0, max_abandoned: int = 64):
    if num_workers <= 0 or timeout_s <= 0:
      raise ValueError(f"num_workers and timeout_s must be positive, got {num_workers}, {timeout_s}")
    self.timeout_s, self.max_abandoned = timeout_s, max_abandoned
    self._queue: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._threads: list[threading.Thread] = []
    self.abandoned = 0
    self.errors = 0
    self.completed = 0
    self._running: dict[int, _Job] = {}  # id(job) -> job, for the watchdog
    for _ in range(num_workers):
      self._spawn()
    threading.Thread(target=self._watchdog, daemon=True, name="verifier-watchdog").start()

  def _watchdog(self):
    while True:
      time.sleep(0.05)
      now = time.monotonic()
      with self._lock:
        overdue = [j for j in self._running.values() if now - j.started > j.timeout_s]
      for job in overdue:
        self._abandon(job)

  def _spawn(self):
    t = threading.Thread(target=self._work, daemon=True, name=f"verifier-{len(self._threads)}")
    self._threads.append(t)
    t.start()

  def _work(self):
    while True:
      job = self._queue.get()
      if job is None:
        return
      with self._lock:
        job.started = time.monotonic()
        self._running[id(job)] = job
      try:
        reward, info = job.fn(job.completion, job.record)
        result = (float(reward), dict(info))
      except Exception as e:  # pylint: disable=broad-except
        with self._lock:
          self.errors += 1
        name = getattr(job.record, "id", "?")
        logging.warning("verifier crashed on %s: %s: %s", name, type(e).__name__, e)
        result = (0.0, {"reason": f"grader error: {type(e).__name__}: {e}", "error": True})
      with self._lock:
        self._running.pop(id(job), None)
        if job.abandoned:
          continue  # its slot was already filled with a timeout result
        job.result = result
        self.completed += 1
        job.done.set()

  def _abandon(self, job: _Job):
    with self._lock:
      self._running.pop(id(job), None)
      if job.done.is_set():
        return
      job.abandoned = True
      job.result = (0.0, {"reason": f"timeout after {job.timeout_s:.1f}s", "timeout": True})
      self.abandoned += 1
      job.done.set()
      logging.warning("verifier timed out on %s after %.1fs; starting a replacement worker",
                      getattr(job.record, "id", "?"), job.timeout_s)
      if self.abandoned <= self.max_abandoned:
        self._spawn()
      else:
        logging.error("%d verifier threads hung; not replacing more", self.abandoned)

  def submit(self, fns: RewardFn | Sequence[RewardFn], completions: Sequence[str],
             records: Sequence[Any], timeout_s: Optional[float] = None) -> GradeBatch:
    """Queues one grading per (completion, record); `fns` is one function or one per item."""
    if len(completions) != len(records):
      raise ValueError(f"{len(completions)} completions but {len(records)} records")
    if callable(fns):
      fns = [fns] * len(completions)
    if len(fns) != len(completions):
      raise ValueError(f"{len(fns)} reward functions for {len(completions)} completions")
    jobs = [_Job(f, c, r, timeout_s or self.timeout_s) for f, c, r in zip(fns, completions, records)]
    for j in jobs:
      self._queue.put(j)
    return GradeBatch(jobs, self)

  def grade(self, fns, completions, records, timeout_s=None) -> list[tuple[float, dict]]:
    """Blocking `submit(...).results()`."""
    return self.submit(fns, completions, records, timeout_s).results()

  def close(self):
    """Stops idle workers (hung ones are daemons and die with the process)."""
    for _ in self._threads:
      self._queue.put(None)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
