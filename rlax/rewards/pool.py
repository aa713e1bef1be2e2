"""A pool of grading processes that grades completions off the controller's thread.

Guarantees: results come back in submission order, one per request, none lost; a grader that
raises gives reward 0 with the exception as the reason; a grading that runs past `timeout_s`
(measured from when a worker started it, not from when it was queued) gives reward 0 with reason
'timeout', and its process is killed and replaced, so capacity is kept however many graders hang.

Graders run in worker processes, not threads: math-verify can spend minutes in one C-level bigint
operation (`\\boxed{9^{9^{9^{9}}}}`) holding the GIL, which no thread-based timeout, signal
handler or watchdog in this process could interrupt. Each worker process grades one item at a
time under a hard deadline (SIGKILL), an address-space cap (`memory_mb` above its start-up size),
and completions longer than `max_chars` are refused without grading.

Workers are forked from a fork server (a clean, single-threaded interpreter, shared by the open
pools, that imported `rlax.rewards` once), so a replacement starts in milliseconds and the
controller itself, which runs JAX's threads, never forks. (multiprocessing's fork server is not
used: it re-imports the controller's `__main__` in every worker.) Nothing outlives the pools: the
fork server exits when its control socket closes (the last pool closed, or the controller died) and
each worker has PR_SET_PDEATHSIG. `close()` ends unfinished jobs with reward 0 at once.

Reward functions travel by pickle: by reference when importable (the built-in rewards,
`functools.partial`s of them, module-level functions), else by value with cloudpickle (lambdas,
closures, anything in `__main__`). A function neither can pickle is graded in a thread of this
process with the old thread semantics (its timeout gives reward 0 but cannot stop it), and one
warning says so.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Callable, Optional, Sequence

from absl import logging

from rlax.rewards import processes

RewardFn = Callable[[str, Any], tuple[float, dict]]



@dataclasses.dataclass
class _Job:
  fn: RewardFn
  completion: str
  record: Any
  timeout_s: float
  quiet: bool = False  # no warning on failure: the caller counts outcomes (tool calls)
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  result: Optional[tuple[float, dict]] = None


class GradeBatch:
  """Handle to a submitted batch; `results()` blocks until every job finished or timed out."""

  def __init__(self, jobs: list[_Job], pool: "VerifierPool"):
    self._jobs, self._pool = jobs, pool

  def done(self) -> bool:
    return all(j.done.is_set() for j in self._jobs)

  def results(self) -> list[tuple[float, dict]]:
    """[(reward, info)] in submission order."""
    for job in self._jobs:
      job.done.wait()  # set by a pool thread at the latest timeout_s after a worker starts the job
    return [job.result for job in self._jobs]


class VerifierPool:
  """`num_workers` grading processes with per-item timeouts; see the module docstring.

  Args:
    num_workers: worker processes (and the controller threads that feed them).
    timeout_s: default per-item deadline, from when a worker starts the item.
    memory_mb: address space each worker may grow by before its allocations fail.
    max_chars: longer completions get reward 0 ('completion too long') without being graded.
  """

  def __init__(self, num_workers: int = 8, timeout_s: float = 30.0, memory_mb: int = 4096,
               max_chars: int = 1 << 20):
    if num_workers <= 0 or timeout_s <= 0 or memory_mb <= 0 or max_chars <= 0:
      raise ValueError("num_workers, timeout_s, memory_mb and max_chars must be positive, got "
                       f"{num_workers}, {timeout_s}, {memory_mb}, {max_chars}")
    self.timeout_s, self.memory_mb, self.max_chars = timeout_s, memory_mb, max_chars
    self._queue: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._blobs: dict[int, tuple[Any, Optional[bytes]]] = {}  # id(fn) -> (fn, pickled fn or None)
    self._workers: dict[int, processes.Worker] = {}
    self.abandoned = 0  # gradings killed at their deadline
    self.errors = 0
    self.completed = 0
    self._closed = False
    processes.use_server(+1)
    self._threads = [threading.Thread(target=self._serve, args=(k,), daemon=True,
                                      name=f"verifier-{k}") for k in range(num_workers)]
    for t in self._threads:
      t.start()

  @property
  def worker_pids(self) -> list[int]:
    """Process ids of the live workers (for tests and operators)."""
    with self._lock:
      return [w.pid for w in self._workers.values()]

  def _start(self, k: int) -> Optional[processes.Worker]:
    try:
      worker = processes.Worker(self.memory_mb)
    except Exception as e:  # pylint: disable=broad-except
      logging.error("could not start grading process %d: %s: %s", k, type(e).__name__, e)
      with self._lock:
        self._workers.pop(k, None)
      return None
    with self._lock:
      self._workers[k] = worker
    return worker

  def _blob(self, fn) -> Optional[bytes]:
    """The pickled reward function, cached per function object; None if it cannot be pickled."""
    with self._lock:
      hit = self._blobs.get(id(fn))
    if hit is not None and hit[0] is fn:
      return hit[1]
    try:
      blob = processes.dumps(fn)
    except Exception as e:  # pylint: disable=broad-except
      blob = None
      logging.warning("reward function %r cannot be pickled (%s: %s); grading it in threads of this "
                      "process, where a grader that hangs cannot be stopped", fn, type(e).__name__, e)
    with self._lock:
      if len(self._blobs) >= 256:  # new closures every batch must not grow this without bound
        self._blobs.clear()
      self._blobs[id(fn)] = (fn, blob)  # holding fn keeps id(fn) from being reused
    return blob

  def _serve(self, k: int):
    worker = self._start(k)
    while True:
      job = self._queue.get()
      if job is None:
        break
      try:
        worker = self._grade(k, worker, job)
      except Exception as e:  # pylint: disable=broad-except
        # A bug here must not leave a caller waiting forever.
        logging.exception("verifier thread %d failed", k)
        if not job.done.is_set():
          self._finish(job, processes.error(e))
    if worker is not None:
      worker.retire()

  def _grade(self, k: int, worker: Optional[processes.Worker], job: _Job) -> Optional[processes.Worker]:
    """Grades `job` on `worker` (or not, see the module docstring); returns the worker to use next."""
    if len(job.completion) > self.max_chars:
      self._finish(job, (0.0, {"reason": f"completion too long: {len(job.completion)} chars > "
                                         f"{self.max_chars}", "too_long": True}))
      return worker
    blob = self._blob(job.fn)
    if blob is None:
      self._finish(job, self._run_in_thread(job))
      return worker
    try:
      payload = processes.dumps((job.completion, job.record))
    except Exception as e:  # pylint: disable=broad-except
      self._finish(job, processes.error(f"record cannot be sent to a grading process: {e}"))
      return worker
    if worker is None:  # a previous start failed: try again for every job rather than hang
      worker = self._start(k)
      if worker is None:
        self._finish(job, processes.error("no grading process could be started"))
        return None
    result, healthy = worker.run(blob, payload, job.timeout_s)
    self._finish(job, result)  # before the replacement starts: the caller is waiting
    if healthy:
      return worker
    worker.retire()
    return None if self._closed else self._start(k)

  def _run_in_thread(self, job: _Job) -> tuple[float, dict]:
    box = []
    t = threading.Thread(target=lambda: box.append(self._call(job)), daemon=True)
    t.start()
    t.join(job.timeout_s)
    return box[0] if box else processes.timeout(job.timeout_s)

  @staticmethod
  def _call(job: _Job) -> tuple[float, dict]:
    try:
      reward, info = job.fn(job.completion, job.record)
      return float(reward), dict(info)
    except Exception as e:  # pylint: disable=broad-except
      return processes.error(e)

  def _finish(self, job: _Job, result: tuple[float, dict]):
    name = getattr(job.record, "id", "?")
    with self._lock:
      if result[1].get("timeout"):
        self.abandoned += 1
      else:
        self.completed += 1
        self.errors += bool(result[1].get("error"))
    if job.quiet:  # the caller counts the outcome
      pass
    elif result[1].get("timeout"):
      logging.warning("verifier timed out on %s after %.1fs; its process was killed and replaced",
                      name, job.timeout_s)
    elif result[1].get("error"):
      logging.warning("verifier failed on %s: %s", name, result[1]["reason"])
    job.result = result
    job.done.set()

  def submit(self, fns: RewardFn | Sequence[RewardFn], completions: Sequence[str],
             records: Sequence[Any], timeout_s: Optional[float] = None, quiet: bool = False) -> GradeBatch:
    """Queues one grading per (completion, record); `fns` is one function or one per item. quiet: failures and
    timeouts are not logged (the caller counts them: tool calls)."""
    if self._closed:
      raise RuntimeError("this VerifierPool is closed")
    if len(completions) != len(records):
      raise ValueError(f"{len(completions)} completions but {len(records)} records")
    if callable(fns):
      fns = [fns] * len(completions)
    if len(fns) != len(completions):
      raise ValueError(f"{len(fns)} reward functions for {len(completions)} completions")
    jobs = [_Job(f, c, r, timeout_s or self.timeout_s, quiet) for f, c, r in zip(fns, completions, records)]
    for j in jobs:
      self._queue.put(j)
    return GradeBatch(jobs, self)

  def grade(self, fns, completions, records, timeout_s=None) -> list[tuple[float, dict]]:
    """Blocking `submit(...).results()`."""
    return self.submit(fns, completions, records, timeout_s).results()

  def close(self):
    """Ends the workers at once (and the fork server, after the last pool): a job not finished gets
    reward 0, so a controller shutting down within a preemption grace period never waits on one."""
    if self._closed:
      return
    self._closed = True
    while True:
      try:
        job = self._queue.get_nowait()
      except queue.Empty:
        break
      if job is not None:
        self._finish(job, processes.error("the verifier pool was closed"))
    for _ in self._threads:
      self._queue.put(None)
    with self._lock:
      workers = list(self._workers.values())
    for w in workers:  # an in-flight job ends now, as if its process had died
      w.kill()
    for t in self._threads:
      t.join()
    processes.use_server(-1)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
