"""Process trees: find and kill everything a job started, wherever it double-forked or `setsid`'d to.

Used by the verifier processes (rlax.rewards.processes: a worker, a child subreaper, cleans up after every
job; the fork server sweeps what killed workers left) and by the code sandbox (a job's tree dies with it).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import time
from typing import Optional

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def prctl(option: int, value: int) -> None:
  try:
    ctypes.CDLL(None, use_errno=True).prctl(option, value)
  except (OSError, AttributeError):
    pass


def stat(pid) -> Optional[tuple[int, str, int]]:
  """(parent pid, state, start time) of process `pid`, or None when it is gone."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[1]), fields[0].decode(), int(fields[19])
  except (OSError, ValueError, IndexError):
    return None


def table() -> dict[int, tuple[int, str, int]]:
  """`_stat` of every process (/proc lists no children on every kernel, so parents are read)."""
  stats = {int(entry): stat(entry) for entry in os.listdir("/proc") if entry.isdigit()}
  return {pid: st for pid, st in stats.items() if st}


def descendants(pid: int) -> list[int]:
  """The live (not zombie) descendants of `pid`."""
  procs, kids = table(), collections.defaultdict(list)
  for p, (parent, _, _) in procs.items():
    kids[parent].append(p)
  out, todo = [], [pid]
  while todo:
    for c in kids.get(todo.pop(), ()):
      todo.append(c)
      if procs[c][1] not in "ZX":
        out.append(c)
  return out


def signal_all(pids, sig) -> None:
  for p in pids:
    try:
      os.kill(p, sig)
    except OSError:
      pass


def kill_tree(pid: int, include_root: bool = True, budget_s: float = 5.0) -> None:
  """SIGKILLs every descendant of `pid` (and `pid` with its process group, with include_root) until none is
  left. Each round stops the tree before it kills it: a stopped process cannot fork away meanwhile."""
  end = time.monotonic() + budget_s
  root = [pid] if include_root else []
  while True:
    tree = descendants(pid) + root
    if not tree:
      return
    signal_all(tree, signal.SIGSTOP)
    signal_all(descendants(pid) + tree, signal.SIGKILL)  # again: what forked before its parent stopped
    if include_root:
      try:
        os.killpg(pid, signal.SIGKILL)
      except OSError:
        pass
    root = []
    if time.monotonic() > end:
      return
    time.sleep(0.002)


def clean_up_children() -> None:
  """Kills what a job left running (it may have double-forked: this subreaper is still its ancestor)."""
  try:
    os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
  except ChildProcessError:
    return  # no child at all, so no descendant: the common case, one system call
  kill_tree(os.getpid(), include_root=False)
  while True:  # reap the killed
    try:
      if os.waitpid(-1, os.WNOHANG)[0] == 0:
        return
    except ChildProcessError:
      return


def sweep(workers: dict[int, Optional[int]], budget_s: float = 5.0) -> int:
  """Kills every child of this fork server that is not a live worker, with its tree: what the jobs of a
  worker killed from outside left (re-parented here, a subreaper). Returns how many, once each is dead (a
  zombie) or `budget_s` ran out: a SIGKILLed process on a loaded host takes a while to exit, and the caller
  reports the job ended only after this."""
  me, n, end = os.getpid(), 0, time.monotonic() + budget_s
  seen: set[int] = set()
  while True:
    procs = table()
    for pid in [p for p in workers if p not in procs]:
      del workers[pid]
    strays = [p for p, (parent, state, start) in procs.items()
              if parent == me and state not in "ZX" and workers.get(p, -1) != start]
    if not strays or time.monotonic() > end:
      break
    n += len(set(strays) - seen)
    seen.update(strays)
    for p in strays:
      kill_tree(p)
    time.sleep(0.002)
  return n
