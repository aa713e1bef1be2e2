"""Grading processes for the verifier pool: the fork server, a worker's loop, the controller's handle on one
worker, and the rules that bound a job's lifetime (see `rlax.rewards.pool` for why graders run in processes).

Lifetimes. The fork server and every worker run in sessions of their own, never in the controller's process
group, so a job calling `os.killpg(0, ...)` or `os.kill(0, ...)` reaches its own worker at most. A worker is
a child subreaper: whatever a job starts, double-forks or `setsid`s away stays its descendant, and after
every job, successful or not, the worker kills each descendant left (`kill_tree`). At a deadline, a
retirement or `close()` the controller kills the worker's whole tree. What a worker killed from outside
leaves is re-parented to the fork server (a subreaper too), which kills every child of its own that is not a
live worker when the controller asks (`sweep`, after each worker it retires) and everything when it exits.

A worker acknowledges each job it takes: a job whose worker died before that (killed while idle, or with its
fork server) goes to a fresh worker, so a grading scores 0 for a death only when its own run died. Results
cross as JSON data (a hostile grader cannot make the controller unpickle anything); requests, controller to
worker, are pickles.
"""

from __future__ import annotations

import collections
import json
from multiprocessing import connection
import os
import pickle
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import cloudpickle

from rlax.rewards import proctree, sandbox
from rlax.rewards.results import MAX_MESSAGE, decode, encode, error, timeout

_START_TIMEOUT_S = 300.0  # the fork server's first start imports rlax.rewards (seconds on a busy host)
_LOAD_TIMEOUT_S = 120.0  # unpickling a reward function (importing its module) in a fresh worker
_FN_CACHE = 64  # pickled reward functions kept per worker (they are reused batch after batch)


def _cap_memory(memory_mb: int) -> None:
  """RLIMIT_AS = this process's current size + memory_mb: the fork server's imports are not counted."""
  with open("/proc/self/statm") as f:
    size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  cap = size + (memory_mb << 20)
  hard = resource.getrlimit(resource.RLIMIT_AS)[1]
  resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))


# -- the worker and the fork server --------------------------------------------------------------------------
def _worker_main(conn: connection.Connection, memory_mb: int, mode: str) -> None:
  """A worker process: grades (pickled fn, pickled (completion, record)) messages one at a time."""
  proctree.prctl(proctree.PR_SET_CHILD_SUBREAPER, 1)
  try:
    sandbox.configure(mode)
  except Exception as e:  # pylint: disable=broad-except
    conn.send_bytes(json.dumps({"ready": False, "reason": f"{type(e).__name__}: {e}"[:1000]}).encode())
    return
  _cap_memory(memory_mb)
  fns: collections.OrderedDict = collections.OrderedDict()
  conn.send_bytes(json.dumps({"ready": True}).encode())
  while True:
    try:
      fn_blob, payload, deadline_s = pickle.loads(conn.recv_bytes())
      conn.send_bytes(b"")  # taken: a death from here on is this job's
      sandbox.job_deadline(time.monotonic() + deadline_s)  # a sandbox the job starts ends before the pool's
    except (EOFError, OSError):
      return  # the controller closed the pool or exited
    fatal = False
    try:
      fn = fns.get(fn_blob)
      if fn is None:
        fn = fns[fn_blob] = pickle.loads(fn_blob)
        if len(fns) > _FN_CACHE:
          fns.popitem(last=False)
      if payload is None:  # load only (`Worker.run`): the function's imports happen outside any deadline
        out = (0.0, {"loaded": True})
      else:
        completion, record = pickle.loads(payload)
        reward, info = fn(completion, record)
        out = (float(reward), dict(info))
    except MemoryError:
      out, fatal = error(f"MemoryError: the grader exceeded its {memory_mb} MB memory cap"), True
      out[1]["memory_cap"] = True
    except BaseException as e:  # pylint: disable=broad-except
      out = error(e)
    try:
      proctree.clean_up_children()
      blob = encode(out)
    except MemoryError:
      blob, fatal = encode(error("MemoryError after the grading: the worker is replaced")), True
    conn.send_bytes(blob)
    if fatal:
      return  # after a MemoryError the interpreter's state is suspect: a fresh worker replaces us


def serve_forks(ctl_fd: int) -> None:
  """The fork server's loop (`python -c`): one forked worker per b"f" request, a `_sweep` per b"s", until
  the controller's end of the control socket closes (it exited, or was killed)."""
  ctl = socket.socket(fileno=ctl_fd)
  proctree.prctl(proctree.PR_SET_CHILD_SUBREAPER, 1)
  try:  # math-verify builds its parsers on first use (~0.5 s): once here, not in every worker
    from rlax.data.records import Record  # pylint: disable=g-import-not-at-top
    from rlax.rewards import math as math_rewards  # pylint: disable=g-import-not-at-top
    math_rewards.math_reward(r"\boxed{\frac{1}{2}}", Record(id="warm-up", prompt="", answer="0.5"))
  except Exception:  # pylint: disable=broad-except
    pass
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stray Ctrl-C is the controller's to act on
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps dead workers (and adopted orphans)
  workers: dict[int, Optional[int]] = {}  # pid -> start time of each worker forked here
  try:
    while True:
      try:
        msg, fds, _, _ = socket.recv_fds(ctl, 64, 1)
      except OSError:  # reset: the controller died
        return
      if not msg:
        return
      if msg[:1] == b"s":
        ctl.sendall(proctree.sweep(workers).to_bytes(8, "little"))
        continue
      me, pid = os.getpid(), os.fork()
      if pid == 0:
        try:
          ctl.close()
          proctree.prctl(proctree.PR_SET_PDEATHSIG, int(signal.SIGKILL))  # the worker dies with this server
          if os.getppid() == me:  # which did not die before that was set
            os.setsid()  # its own session and group: nothing a job signals reaches the controller's group
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the code sandbox waits for its children
            _worker_main(connection.Connection(fds[0]), int.from_bytes(msg[1:9], "little"), msg[9:].decode())
        finally:
          os._exit(0)
      os.close(fds[0])
      workers[pid] = (proctree.stat(pid) or (0, "", None))[2]
      ctl.sendall(pid.to_bytes(8, "little"))
  finally:  # nothing forked here outlives the server
    proctree.kill_tree(os.getpid(), include_root=False)
    os._exit(0)


class _ForkServer:
  """A clean interpreter that imported `rlax.rewards` once and forks workers on request.

  The controller runs JAX's threads, so it must not fork itself; starting each worker as a fresh
  interpreter would pay the imports (seconds) again for every replacement of a killed grader.
  """

  def __init__(self):
    mine, theirs = socket.socketpair()
    # The server imports what the controller can: pickled-by-reference functions resolve there.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # One thread, so fork is safe: numpy's OpenBLAS would start a thread pool at import (and one
    # more per worker, for graders that are one item each).
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    self.proc = subprocess.Popen(
        [sys.executable, "-c", f"from rlax.rewards import processes; processes.serve_forks({theirs.fileno()})"],
        pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    theirs.close()
    mine.settimeout(_START_TIMEOUT_S)
    self.sock, self.lock = mine, threading.Lock()

  def _reply(self) -> int:
    reply = b""
    while len(reply) < 8:
      chunk = self.sock.recv(8 - len(reply))
      if not chunk:
        raise EOFError("the grading fork server exited")
      reply += chunk
    return int.from_bytes(reply, "little")

  def fork(self, memory_mb: int, mode: str) -> tuple[int, connection.Connection]:
    """(pid, the controller's end of its pipe) of a new worker."""
    mine, theirs = socket.socketpair()
    try:
      with self.lock:
        socket.send_fds(self.sock, [b"f" + memory_mb.to_bytes(8, "little") + mode.encode()], [theirs.fileno()])
        pid = self._reply()
    except BaseException:
      mine.close()
      raise
    finally:
      theirs.close()
    return pid, connection.Connection(mine.detach())

  def sweep(self) -> None:
    """Has the server kill what dead workers' jobs left (see `_sweep`); quiet if the server is gone."""
    try:
      with self.lock:
        self.sock.sendall(b"s")
        self._reply()
    except (OSError, EOFError):
      pass

  def close(self) -> None:
    self.sock.close()  # the server kills its whole tree and exits at EOF
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


_server: Optional[_ForkServer] = None
_server_users = 0  # open pools: the server outlives none of them, so a closed pool leaves no process
_server_lock = threading.Lock()


def _fork_worker(memory_mb: int, mode: str) -> tuple[_ForkServer, int, connection.Connection]:
  """Forks a worker from the shared fork server, (re)starting the server if it is gone (a job killed it)."""
  global _server
  for attempt in range(2):
    with _server_lock:
      if _server is None or _server.proc.poll() is not None:
        if _server is not None:
          _server.close()
        _server = _ForkServer()
      server = _server
    try:
      return (server, *server.fork(memory_mb, mode))
    except (OSError, EOFError):
      if attempt:
        raise
      server.proc.wait(timeout=5)  # it died under us (a job killed it): poll() sees it dead next time
  raise AssertionError("unreachable")


def use_server(delta: int) -> None:
  """Counts open pools (+1 when one opens, -1 when it closes); the server stops at zero."""
  global _server, _server_users
  with _server_lock:
    _server_users += delta
    if _server_users == 0 and _server is not None:
      _server.close()
      _server = None


def dumps(obj) -> bytes:
  """pickle (fast, by reference) where the worker can load it, else cloudpickle (by value)."""
  try:
    blob = pickle.dumps(obj)
    if b"__main__" not in blob:  # the fork server's __main__ is not the controller's
      return blob
  except Exception:  # pylint: disable=broad-except
    pass
  return cloudpickle.dumps(obj)


class _Unsent(Exception):
  """The worker died before it took the job: the job may go to another one."""


class _Malformed(Exception):
  """The worker's reply is not a result: the worker is not to be trusted with another job."""


class Worker:
  """One worker process and the controller's end of its pipe."""

  def __init__(self, memory_mb: int, mode: str = "auto"):
    self.server, self.pid, self.conn = _fork_worker(memory_mb, mode)
    self.loaded: set[bytes] = set()  # reward functions this worker has unpickled
    self._lock = threading.Lock()  # the pidfd: kill() from close() races retire() in the pool's thread
    self._retired = False
    try:  # the worker is alive (it has not said ready), so this pid is still its own
      self.pidfd = os.pidfd_open(self.pid)
    except (AttributeError, OSError):
      self.pidfd = None
    try:
      hello = self.conn.poll(_START_TIMEOUT_S) and json.loads(self.conn.recv_bytes(1 << 16))
    except (EOFError, OSError, ValueError):
      hello = None
    if not (isinstance(hello, dict) and hello.get("ready")):
      self.retire()
      why = hello.get("reason") if isinstance(hello, dict) else None
      raise RuntimeError(why or f"grading process {self.pid} did not start")

  def _ask(self, fn_blob: bytes, payload: Optional[bytes], timeout_s: float) -> Optional[tuple[float, dict]]:
    """The worker's (reward, info), or None at the deadline."""
    end = time.monotonic() + timeout_s
    try:
      self.conn.send_bytes(pickle.dumps((fn_blob, payload, timeout_s)))
      if self.conn.poll(timeout_s):
        self.conn.recv_bytes(16)  # the worker took the job
    except (EOFError, OSError):
      raise _Unsent() from None  # it died before (a kill from outside, or its fork server's death)
    if not self.conn.poll(max(0.0, end - time.monotonic())):
      return None
    try:
      return decode(self.conn.recv_bytes(MAX_MESSAGE + (1 << 16)))
    except (ValueError, KeyError, TypeError, RecursionError):
      raise _Malformed() from None

  def run(self, fn_blob: bytes, payload: bytes,
          timeout_s: float) -> tuple[Optional[tuple[float, dict]], bool]:
    """(result, whether this worker can take another job); (None, False) when the job did not reach it."""
    try:
      if not self.alive():
        raise _Unsent()
      if fn_blob not in self.loaded:
        # Unpickling a function by reference imports its module (a script importing jax takes seconds):
        # done once per worker, before the grading's own deadline starts.
        loaded = self._ask(fn_blob, None, max(_LOAD_TIMEOUT_S, timeout_s))
        if loaded is None:
          return (0.0, {"reason": f"loading the reward function took over {_LOAD_TIMEOUT_S:.0f}s",
                        "timeout": True}), False
        if not loaded[1].get("loaded"):
          return loaded, True  # the function does not load here: its error, for every item
        self.loaded.add(fn_blob)
      result = self._ask(fn_blob, payload, timeout_s)
      if result is None:
        return timeout(timeout_s), False
      return result, not result[1].get("memory_cap", False)
    except _Unsent:
      return None, False
    except _Malformed:
      return error("the grading process sent a malformed result"), False
    except (EOFError, OSError):
      return error("the grading process died (killed, or a crash in native code)"), False

  def alive(self) -> bool:
    """Whether the worker can take a job: not retired, not dead, and its fork server not gone (a job killed
    it: the worker's PR_SET_PDEATHSIG is on its way)."""
    if self.server.proc.poll() is not None:
      return False
    with self._lock:
      if self._retired:
        return False
      if self.pidfd is None:
        return os.path.exists(f"/proc/{self.pid}")
      return not select.select([self.pidfd], [], [], 0)[0]  # a pidfd turns readable when its process exits

  def _signal(self, sig) -> bool:
    """Sends `sig` to the worker (never to a recycled pid where a pidfd can say); False if it is gone."""
    with self._lock:
      try:
        if self.pidfd is not None:
          signal.pidfd_send_signal(self.pidfd, sig)
        elif not self._retired:
          os.kill(self.pid, sig)
        else:
          return False
        return True
      except OSError:
        return False

  def kill(self) -> None:
    """SIGKILLs the worker's whole tree (from any thread; idempotent). The pipe is closed by retire()."""
    if self._signal(signal.SIGSTOP):  # stopped: it neither forks nor reaps while its tree is killed
      proctree.kill_tree(self.pid, include_root=False)
    self._signal(signal.SIGKILL)
    try:  # its group: what a job left, after the worker itself died
      os.killpg(self.pid, signal.SIGKILL)
    except OSError:
      pass

  def retire(self) -> None:
    """Kills the worker's tree, closes this end of its pipe, has the fork server kill what was re-parented
    to it, and removes the job directories the killed jobs left (by the thread that uses the pipe)."""
    self.kill()
    self.conn.close()
    with self._lock:
      fd, self.pidfd, self._retired = self.pidfd, None, True
    if fd is not None:
      select.select([fd], [], [], 5.0)  # dead, and its children re-parented, before the sweep
      os.close(fd)
    self.server.sweep()
    sandbox.remove_stale_jobs()
