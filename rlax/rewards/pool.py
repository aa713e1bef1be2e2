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
used: it re-imports the controller's `__main__` in every worker.) Nothing outlives a job or the pools:
each worker runs in a session of its own and kills whatever its job left after every job (so a grader
cannot keep a helper process from one job to the next); a deadline, retirement or `close()` kills a
worker's whole process tree; a grading that may run the code sandbox gets the sandbox's wall clock plus
`job_margin_s` (`grading_deadline`); a job whose worker died before taking it goes to a fresh
one. The fork server exits when its control socket closes (the last pool closed, or the controller died),
killing its tree; each worker has PR_SET_PDEATHSIG. `close()` ends unfinished jobs with reward 0 at once.
Each worker configures the code sandbox with the pool's `sandbox` mode. Results come back as JSON; an info
value JSON has no type for becomes its repr.

Reward functions travel by pickle: by reference when importable (the built-in rewards,
`functools.partial`s of them, module-level functions), else by value with cloudpickle (lambdas,
closures, anything in `__main__`). A function neither can pickle is refused at submit with one
ValueError line, unless the pool (or the submit) opted in with `in_process=True`: then it is graded in a
thread of this process, where its timeout gives reward 0 but cannot stop it, and no memory cap applies.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import types
from typing import Any, Callable, Optional, Sequence

from absl import logging

from rlax.rewards import code
from rlax.rewards import processes
from rlax.rewards import registry
from rlax.rewards import results
from rlax.rewards import sandbox as sandbox_lib

RewardFn = Callable[[str, Any], tuple[float, dict]]


JOB_MARGIN_S = sandbox_lib.JOB_MARGIN_S  # a sandbox's start, kill and clean-up around its wall clock
_EMPTY_CELL = types.CellType()  # compares equal to an empty closure cell only (reading one raises)


def grading_deadline(timeout_s: float, sandbox_wall_s: float, margin_s: float = JOB_MARGIN_S) -> float:
  """A job's deadline: `timeout_s`, raised to the sandbox's wall clock plus `margin_s` for a job that runs the
  code sandbox, so that the sandbox ends (and cleans up) its own job before the pool kills the worker.
  The one place this rule lives; VerifierPool.submit applies it to every grading and tool call."""
  return max(timeout_s, sandbox_wall_s + margin_s) if sandbox_wall_s > 0 else timeout_s


def sandbox_wall_s(fn, depth: int = 0) -> float:
  """The longest sandbox wall clock one call of `fn` may run into (0: none known): what `fn.sandbox_wall_s`
  declares (the `python` tool; any function may), the `SandboxLimits` a partial or closure holds
  (`make_code_reward`), the default limits' for the built-in code and auto rewards, else the most over the
  functions a partial or closure wraps (combined rewards, format bonuses)."""
  declared = getattr(fn, "sandbox_wall_s", None)
  if isinstance(declared, (int, float)):
    return float(declared)
  if fn is code.code_reward or fn is registry.auto_reward:
    return sandbox_lib.SandboxLimits().wall_s
  if isinstance(fn, functools.partial):
    parts = [fn.func, *fn.args, *fn.keywords.values()]
  else:
    parts = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if c != _EMPTY_CELL]
  parts += [v for p in parts if isinstance(p, dict) for v in p.values()]
  limits = [p.wall_s for p in parts if isinstance(p, sandbox_lib.SandboxLimits)]
  if limits or depth >= 4:
    return max(limits, default=0.0)
  return max((sandbox_wall_s(p, depth + 1) for p in parts if callable(p)), default=0.0)



@dataclasses.dataclass
class _Job:
  fn: RewardFn
  blob: Optional[bytes]  # the pickled fn; None: graded in a thread (in_process)
  completion: str
  record: Any
  timeout_s: float  # the deadline (grading_deadline)
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
    sandbox: the code sandbox's mode in every worker: "auto" (the jail; policy-written code is refused where
      there is none) or "unsafe" (explicit opt-in: run it with resource limits only).
    job_margin_s: a grading that may run the code sandbox gets its wall clock plus this, at least.
    in_process: opt-in to grade functions that cannot be pickled in threads of this process (no kill, no
      memory cap); without it they are refused at submit.
  """

  def __init__(self, num_workers: int = 8, timeout_s: float = 30.0, memory_mb: int = 4096,
               max_chars: int = 1 << 20, sandbox: str = "auto", job_margin_s: float = JOB_MARGIN_S,
               in_process: bool = False):
    if num_workers <= 0 or timeout_s <= 0 or memory_mb <= 0 or max_chars <= 0 or job_margin_s < 0:
      raise ValueError("num_workers, timeout_s, memory_mb and max_chars must be positive and job_margin_s >= 0, "
                       f"got {num_workers}, {timeout_s}, {memory_mb}, {max_chars}, {job_margin_s}")
    if sandbox_lib.mode_error(sandbox):
      raise ValueError(sandbox_lib.mode_error(sandbox))
    self.timeout_s, self.memory_mb, self.max_chars = timeout_s, memory_mb, max_chars
    self.sandbox, self.job_margin_s, self.in_process = sandbox, job_margin_s, in_process
    self._queue: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._fns: dict[int, tuple] = {}  # id(fn) -> (fn, pickled fn or None, its sandbox wall, why not)
    self._workers: dict[int, processes.Worker] = {}
    self._start_error = ""
    self.abandoned = 0  # gradings killed at their deadline
    self.errors = 0
    self.completed = 0
    self._closed = False
    sandbox_lib.remove_stale_jobs()  # what a killed run's jobs left
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
      worker = processes.Worker(self.memory_mb, self.sandbox)
    except Exception as e:  # pylint: disable=broad-except
      logging.error("could not start grading process %d: %s: %s", k, type(e).__name__, e)
      with self._lock:
        self._workers.pop(k, None)
        self._start_error = f"{type(e).__name__}: {e}"
      return None
    with self._lock:
      self._workers[k] = worker
    return worker

  def _prepare(self, fn, in_process: bool) -> tuple[Optional[bytes], float]:
    """(the pickled fn, or None to grade it in a thread; its sandbox wall clock), cached per function object.
    ValueError (one line) for a function that cannot be pickled, unless `in_process`."""
    with self._lock:
      hit = self._fns.get(id(fn))
    if hit is None or hit[0] is not fn:
      try:
        blob, why = processes.dumps(fn), ""
      except Exception as e:  # pylint: disable=broad-except
        blob, why = None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
      hit = (fn, blob, sandbox_wall_s(fn), why)
      with self._lock:
        if len(self._fns) >= 256:  # new closures every batch must not grow this without bound
          self._fns.clear()
        self._fns[id(fn)] = hit  # holding fn keeps id(fn) from being reused
      if blob is None and in_process:
        logging.warning("reward function %r cannot be pickled (%s); grading it in threads of this process "
                        "(in_process=True), where a grader that hangs cannot be stopped", fn, why)
    if hit[1] is None and not in_process:
      name = getattr(fn, "__qualname__", None) or " ".join(repr(fn).split())[:200]
      raise ValueError(f"reward function {name} cannot be sent to a "
                       f"grading process ({hit[3]}): make it a module-level function, or opt in with "
                       "VerifierPool(in_process=True) to grade it in this process with no kill and no memory cap")
    return hit[1], hit[2]

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
          self._finish(job, results.error(e))
    if worker is not None:
      worker.retire()

  def _grade(self, k: int, worker: Optional[processes.Worker], job: _Job) -> Optional[processes.Worker]:
    """Grades `job` on `worker` (or in a thread, see the module docstring); returns the worker to use next."""
    if len(job.completion) > self.max_chars:
      self._finish(job, (0.0, {"reason": f"completion too long: {len(job.completion)} chars > "
                                         f"{self.max_chars}", "too_long": True}))
      return worker
    if job.blob is None:
      self._finish(job, self._run_in_thread(job))
      return worker
    try:
      payload = processes.dumps((job.completion, job.record))
    except Exception as e:  # pylint: disable=broad-except
      self._finish(job, results.error(f"record cannot be sent to a grading process: {e}"))
      return worker
    for _ in range(2):  # a worker that died before it took the job is replaced, once
      if worker is None:  # a previous start failed: try again for every job rather than hang
        worker = None if self._closed else self._start(k)
        if worker is None:
          self._finish(job, results.error(f"no grading process could be started: {self._start_error}"))
          return None
      result, healthy = worker.run(job.blob, payload, job.timeout_s)
      if not healthy:
        worker.retire()  # before the result: what the job started is dead when the caller hears of it
        worker = None
      if result is not None:
        break
    else:
      result = results.error("the grading process died before the job reached it")
    self._finish(job, result)  # before a replacement starts: the caller is waiting
    return worker if worker is not None or self._closed else self._start(k)

  def _run_in_thread(self, job: _Job) -> tuple[float, dict]:
    box = []
    t = threading.Thread(target=lambda: box.append(self._call(job)), daemon=True)
    t.start()
    t.join(job.timeout_s)
    return box[0] if box else results.timeout(job.timeout_s)

  @staticmethod
  def _call(job: _Job) -> tuple[float, dict]:
    try:
      reward, info = job.fn(job.completion, job.record)
      return float(reward), dict(info)
    except Exception as e:  # pylint: disable=broad-except
      return results.error(e)

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

  def submit(self, fns: RewardFn | Sequence[RewardFn], completions: Sequence[str], records: Sequence[Any],
             timeout_s: Optional[float] = None, quiet: bool = False,
             in_process: Optional[bool] = None) -> GradeBatch:
    """Queues one grading per (completion, record); `fns` is one function or one per item. quiet: failures and
    timeouts are not logged (the caller counts them: tool calls). in_process: the pool's opt-in, for this
    batch. A function that cannot be pickled, without the opt-in, is a ValueError before anything is queued."""
    if self._closed:
      raise RuntimeError("this VerifierPool is closed")
    if len(completions) != len(records):
      raise ValueError(f"{len(completions)} completions but {len(records)} records")
    if callable(fns):
      fns = [fns] * len(completions)
    if len(fns) != len(completions):
      raise ValueError(f"{len(fns)} reward functions for {len(completions)} completions")
    in_process = self.in_process if in_process is None else in_process
    jobs = []
    for f, c, r in zip(fns, completions, records):
      blob, wall = self._prepare(f, in_process)
      deadline = grading_deadline(timeout_s or self.timeout_s, wall, self.job_margin_s)
      jobs.append(_Job(f, blob, c, r, deadline, quiet))
    for j in jobs:
      self._queue.put(j)
    return GradeBatch(jobs, self)

  def grade(self, fns, completions, records, timeout_s=None, in_process=None) -> list[tuple[float, dict]]:
    """Blocking `submit(...).results()`; a reward that grades whole batches in this process (`grade_batch`: a
    generative judge, rlax.judges) is handed the batch instead."""
    if callable(getattr(fns, "grade_batch", None)):
      if len(completions) != len(records):
        raise ValueError(f"{len(completions)} completions but {len(records)} records")
      try:
        return fns.grade_batch(list(completions), list(records))
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("reward %r failed on a batch of %d: %s", fns, len(records), e)
        return [results.error(e)] * len(records)
    return self.submit(fns, completions, records, timeout_s, in_process=in_process).results()

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
        self._finish(job, results.error("the verifier pool was closed"))
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
