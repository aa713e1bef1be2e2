"""Grading processes for the verifier pool: the fork server, a worker's loop, and the controller's
handle on one worker (see `rlax.rewards.pool` for why graders run in processes)."""

from __future__ import annotations

import collections
import ctypes
from multiprocessing import connection
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
from typing import Optional

import cloudpickle

_START_TIMEOUT_S = 300.0  # the fork server's first start imports rlax.rewards (seconds on a busy host)
_LOAD_TIMEOUT_S = 120.0  # unpickling a reward function (importing its module) in a fresh worker
_FN_CACHE = 64  # pickled reward functions kept per worker (they are reused batch after batch)


def timeout(seconds: float) -> tuple[float, dict]:
  """The (reward, info) of a grading stopped at its deadline: reward 0, `timeout: True`."""
  return 0.0, {"reason": f"timeout after {seconds:.1f}s", "timeout": True}


def error(e: BaseException | str) -> tuple[float, dict]:
  """The (reward, info) of a grading that failed: reward 0, the reason, `error: True`."""
  text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
  return 0.0, {"reason": f"grader error: {text}"[:1000], "error": True}


def _die_with_parent() -> None:
  try:  # PR_SET_PDEATHSIG = 1: SIGKILL when the fork server (our parent) exits
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
  except (OSError, AttributeError):
    pass


def _cap_memory(memory_mb: int) -> None:
  """RLIMIT_AS = this process's current size + memory_mb: the fork server's imports are not counted."""
  with open("/proc/self/statm") as f:
    size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  cap = size + (memory_mb << 20)
  hard = resource.getrlimit(resource.RLIMIT_AS)[1]
  resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))


def _plain_info(info: dict) -> dict:
  """`info` if it pickles, else with values that do not replaced by their repr."""
  try:
    pickle.dumps(info)
    return info
  except Exception:  # pylint: disable=broad-except
    return {str(k): v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
            for k, v in info.items()}


def _worker_main(conn: connection.Connection, memory_mb: int) -> None:
  """A worker process: grades (pickled fn, pickled (completion, record)) messages one at a time."""
  _die_with_parent()
  _cap_memory(memory_mb)
  fns: collections.OrderedDict = collections.OrderedDict()
  conn.send_bytes(b"ready")
  while True:
    try:
      fn_blob, payload = pickle.loads(conn.recv_bytes())
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
        out = (float(reward), _plain_info(dict(info)))
    except MemoryError:
      out, fatal = error(f"MemoryError: the grader exceeded its {memory_mb} MB memory cap"), True
      out[1]["memory_cap"] = True
    except BaseException as e:  # pylint: disable=broad-except
      out = error(e)
    conn.send_bytes(pickle.dumps(out))
    if fatal:
      return  # after a MemoryError the interpreter's state is suspect: a fresh worker replaces us


def serve_forks(ctl_fd: int) -> None:
  """The fork server's loop (`python -c`): one forked worker per request, until the controller's
  end of the control socket closes (it exited, or was killed)."""
  ctl = socket.socket(fileno=ctl_fd)
  try:  # math-verify builds its parsers on first use (~0.5 s): once here, not in every worker
    from rlax.data.records import Record  # pylint: disable=g-import-not-at-top
    from rlax.rewards import math as math_rewards  # pylint: disable=g-import-not-at-top
    math_rewards.math_reward(r"\boxed{\frac{1}{2}}", Record(id="warm-up", prompt="", answer="0.5"))
  except Exception:  # pylint: disable=broad-except
    pass
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the controller decides
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps dead workers: no zombies
  while True:
    try:
      msg, fds, _, _ = socket.recv_fds(ctl, 16, 1)
    except OSError:  # reset: the controller died
      msg = b""
    if not msg:
      os._exit(0)
    pid = os.fork()
    if pid == 0:
      ctl.close()
      signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the code sandbox waits for its children
      try:
        _worker_main(connection.Connection(fds[0]), int.from_bytes(msg[1:9], "little"))
      finally:
        os._exit(0)
    os.close(fds[0])
    ctl.sendall(pid.to_bytes(8, "little"))


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
        pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    mine.settimeout(_START_TIMEOUT_S)
    self.sock, self.lock = mine, threading.Lock()

  def fork(self, memory_mb: int) -> tuple[int, connection.Connection]:
    """(pid, the controller's end of its pipe) of a new worker."""
    mine, theirs = socket.socketpair()
    try:
      with self.lock:
        socket.send_fds(self.sock, [b"f" + memory_mb.to_bytes(8, "little")], [theirs.fileno()])
        reply = b""
        while len(reply) < 8:
          chunk = self.sock.recv(8 - len(reply))
          if not chunk:
            raise EOFError("the grading fork server exited")
          reply += chunk
    finally:
      theirs.close()
    return int.from_bytes(reply, "little"), connection.Connection(mine.detach())


  def close(self) -> None:
    self.sock.close()  # the server exits at EOF; its workers follow (PR_SET_PDEATHSIG)
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


_server: Optional[_ForkServer] = None
_server_users = 0  # open pools: the server outlives none of them, so a closed pool leaves no process
_server_lock = threading.Lock()


def _fork_worker(memory_mb: int) -> tuple[int, connection.Connection]:
  """Forks a worker from the shared fork server, (re)starting the server if needed."""
  global _server
  with _server_lock:
    if _server is None or _server.proc.poll() is not None:
      _server = _ForkServer()
    server = _server
  return server.fork(memory_mb)


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


class Worker:
  """One worker process and the controller's end of its pipe."""

  def __init__(self, memory_mb: int):
    self.pid, self.conn = _fork_worker(memory_mb)
    self.loaded: set[bytes] = set()  # reward functions this worker has unpickled
    try:  # the worker is alive (it has not said ready), so this pid is still its own
      self.pidfd = os.pidfd_open(self.pid)
    except (AttributeError, OSError):
      self.pidfd = None
    try:
      ready = self.conn.poll(_START_TIMEOUT_S) and self.conn.recv_bytes() == b"ready"
    except (EOFError, OSError):
      ready = False
    if not ready:
      self.retire()
      raise RuntimeError(f"grading process {self.pid} did not start")

  def run(self, fn_blob: bytes, payload: bytes, timeout_s: float) -> tuple[tuple[float, dict], bool]:
    """(result, whether this worker can take another job)."""
    try:
      if fn_blob not in self.loaded:
        # Unpickling a function by reference imports its module (a script importing jax takes seconds):
        # done once per worker, before the grading's own deadline starts.
        self.conn.send_bytes(pickle.dumps((fn_blob, None)))
        if not self.conn.poll(max(_LOAD_TIMEOUT_S, timeout_s)):
          return (0.0, {"reason": f"loading the reward function took over {_LOAD_TIMEOUT_S:.0f}s",
                        "timeout": True}), False
        loaded = pickle.loads(self.conn.recv_bytes())
        if not loaded[1].get("loaded"):
          return loaded, True  # the function does not load here: its error, for every item
        self.loaded.add(fn_blob)
      self.conn.send_bytes(pickle.dumps((fn_blob, payload)))
      if not self.conn.poll(timeout_s):
        return timeout(timeout_s), False
      result = pickle.loads(self.conn.recv_bytes())
      return result, not result[1].get("memory_cap", False)
    except (EOFError, OSError):
      return error("the grading process died (killed by the OS, or a crash in native code)"), False

  def kill(self) -> None:
    """SIGKILL (from any thread; idempotent). The pipe is closed by the thread that uses it."""
    fd = self.pidfd
    try:
      if fd is not None:  # never a recycled pid: the fork server reaps workers at once
        signal.pidfd_send_signal(fd, signal.SIGKILL)
      else:
        os.kill(self.pid, signal.SIGKILL)
    except OSError:  # gone already, or close() racing with retire() over the pidfd
      pass

  def retire(self) -> None:
    """Kills the process and closes this end of its pipe (by the thread that uses the pipe)."""
    self.kill()
    self.conn.close()
    if self.pidfd is not None:
      os.close(self.pidfd)
      self.pidfd = None
