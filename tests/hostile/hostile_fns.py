"""Hostile reward functions and tools for test_hostile_pool.py: module-level, so they reach the grading
processes by reference, as a user's would. Each reward function has the pool's signature (completion, record)
and each tool a typed one (rlax.envs.tools.Tool.from_function)."""

import os
import signal
import subprocess
import threading
import time

import numpy as np


def ok(completion, record):
  """The honest grader the pool must still run right after each hostile one."""
  return float(completion == "right"), {"graded": completion}


def sleep_long(completion, record):
  time.sleep(1000)
  return 1.0, {}


def lock_twice(completion, record):
  lock = threading.Lock()
  lock.acquire()
  lock.acquire()
  return 1.0, {}


def read_empty_pipe(completion, record):
  r, _ = os.pipe()
  os.read(r, 1)
  return 1.0, {}


def _sleeper(new_session: bool = False) -> int:
  return subprocess.Popen(["sleep", "1000"], start_new_session=new_session, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid


def background_child(completion, record):
  """Starts a child and returns at once, leaving it running."""
  return 1.0, {"child": _sleeper()}


def double_fork(completion, record):
  """A grandchild in a session of its own, orphaned at once: the classic daemon escape."""
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.setsid()
    if os.fork() == 0:
      os.write(w, str(os.getpid()).encode())
      time.sleep(1000)
    os._exit(0)
  os.waitpid(pid, 0)
  return 1.0, {"grandchild": int(os.read(r, 32))}


def children_then_block(completion, record):
  """Children in the worker's group and in a session of their own, then a block until killed."""
  _sleeper(), _sleeper(new_session=True)
  time.sleep(1000)
  return 1.0, {}


def killpg_zero(completion, record):
  os.killpg(0, signal.SIGTERM)
  time.sleep(5)
  return 1.0, {}


def kill_zero(completion, record):
  os.kill(0, signal.SIGTERM)
  time.sleep(5)
  return 1.0, {}


def kill_parent(completion, record):
  os.kill(os.getppid(), signal.SIGKILL)  # the fork server
  time.sleep(5)
  return 1.0, {}


def memory_bomb(completion, record):
  blocks = []
  while True:
    blocks.append(bytearray(64 << 20))


def huge_info(completion, record):
  return 1.0, {"text": "x" * (40 << 20)}


class _Odd:
  def __repr__(self):
    raise RuntimeError("no repr")


def odd_info(completion, record):
  return 0.5, {"set": {1}, "bytes": b"\x00", "obj": object(), "odd": _Odd(), 3: "int key", "nested": [(1, 2.5)],
               "big": 10 ** 5000, "np": np.float64(0.25)}


def bad_reward(completion, record):
  class Hostile(float):
    def __float__(self):
      raise RuntimeError("no float")
  return Hostile(1.0), {}


# -- tools ------------------------------------------------------------------------------------------------
def echo(text: str) -> str:
  """Returns its argument."""
  return text


def nap(seconds: float) -> str:
  """Sleeps."""
  time.sleep(seconds)
  return "rested"


def spawn(n: int) -> str:
  """Starts n background processes (one double-forked away) and returns."""
  for _ in range(n):
    _sleeper()
  double_fork("", None)
  return "started"


def flood(mb: int) -> str:
  """mb megabytes of text."""
  return "y" * (mb << 20)


def opaque(n: int) -> object:
  """Returns an object that is not JSON."""
  return {frozenset({n}): object()}


def group_kill(n: int) -> str:
  """Signals its own process group."""
  os.killpg(0, signal.SIGTERM)
  return "survived"


def hidden_code(completion, record):
  """A code reward whose sandbox limits the pool cannot see (they are made inside the call)."""
  from rlax import rewards  # pylint: disable=g-import-not-at-top
  return rewards.code_reward(completion, record, limits=rewards.SandboxLimits(wall_s=30.0))
