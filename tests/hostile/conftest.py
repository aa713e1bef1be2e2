"""Host-cleanliness checks for the hostile-input tests: every case runs under `clean_host`, which fails the
case if it left a process anywhere in the process table, a file outside its job directory, or delivered a
signal to the test process.

Processes: the test process is made a child subreaper, so anything a job double-forks or `setsid`s away is
re-parented to it rather than to init; after the case, every process in the whole table that did not exist
before it is checked: one descended from the test process, or one re-parented to init whose command line
names the sandbox, a jail or a job directory, is a leak (waited for briefly: SIGKILLed trees take a moment to
be reaped). Jobs of a test running in parallel in another worker have a live parent and are not counted.
"""

from __future__ import annotations

import ctypes
import os
import signal
import tempfile
import time

import psutil
import pytest

_WATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
            signal.SIGALRM, signal.SIGWINCH, signal.SIGCONT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
_MARKERS = ("rlax_sbx_", "bwrap", "nsjail", "_sandbox_runner", "serve_forks", "rlax_hostile")


def _table() -> dict[int, float]:
  out = {}
  for p in psutil.process_iter(["create_time"]):
    out[p.pid] = p.info["create_time"]
  return out


def _descends_from(pid: int, root: int) -> bool:
  try:
    p = psutil.Process(pid)
    while p is not None and p.pid > 1:
      if p.pid == root:
        return True
      p = p.parent()
  except psutil.Error:
    return False
  return False


def _suspicious(pid: int, me: int) -> bool:
  try:
    p = psutil.Process(pid)
    if p.status() == psutil.STATUS_ZOMBIE and p.ppid() == me:
      os.waitpid(pid, os.WNOHANG)  # a zombie child of ours is reaped, not leaked
      return False
    if _descends_from(pid, me):
      return True
    if p.ppid() != 1:  # a live parent of its own: another test worker's job, not an escapee
      return False
    cmd = " ".join(p.cmdline())
  except (psutil.Error, ChildProcessError):
    return False
  return any(m in cmd for m in _MARKERS)


def leaked_processes(before: dict[int, float], wait_s: float = 10.0) -> list[str]:
  """New processes (over the whole table) that belong to this test process's work; polled up to `wait_s`."""
  me = os.getpid()
  deadline = time.monotonic() + wait_s
  while True:
    now = _table()
    new = [pid for pid, t in now.items() if before.get(pid) != t and pid != me]
    bad = [pid for pid in new if _suspicious(pid, me)]
    if not bad or time.monotonic() > deadline:
      break
    time.sleep(0.1)
  out = []
  for pid in bad:
    try:
      p = psutil.Process(pid)
      out.append(f"{pid} {p.status()} {' '.join(p.cmdline())[:200]}")
    except psutil.Error:
      continue
  return out


class HostState:
  """What a case may inspect: `tmp` (the TMPDIR every job directory goes under), the signals received."""

  def __init__(self, tmp: str):
    self.tmp = tmp
    self.signals: list[int] = []


@pytest.fixture
def clean_host(tmp_path, monkeypatch):
  """Runs a case with TMPDIR pointed at an empty directory and the signal handlers recording; asserts after
  it that no process, file (in that TMPDIR) or signal is left over."""
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  monkeypatch.setenv("TMPDIR", str(tmp))
  monkeypatch.setattr(tempfile, "tempdir", str(tmp))
  state = HostState(str(tmp))
  old = {s: signal.signal(s, lambda n, f: state.signals.append(n)) for s in _WATCHED}
  ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of our jobs come back to us
  before = _table()
  try:
    yield state
  finally:
    leaks = leaked_processes(before)
    ctypes.CDLL(None).prctl(36, 0)
    for line in leaks:  # kill what leaked so one failure does not poison the next case
      try:
        os.kill(int(line.split()[0]), signal.SIGKILL)
      except OSError:
        pass
    for s, h in old.items():
      signal.signal(s, h)
    left = sorted(os.listdir(tmp))
  assert not leaks, f"processes left behind: {leaks}"
  assert not left, f"files left in TMPDIR: {left}"
  assert not state.signals, f"signals delivered to the test process: {state.signals}"
