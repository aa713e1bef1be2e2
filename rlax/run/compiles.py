"""Compiles in this process, counted from JAX's own compile events (a persistent-cache hit counts too: it is
still a program the run did not have), so every metrics row can say how many happened since the last, and the
log which programs they were."""

from __future__ import annotations

import collections
import threading
import time

import jax

from rlax import allocator

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_totals = [0, 0.0]  # compiles, seconds
_names: collections.deque = collections.deque(maxlen=256)  # (compile number, "program on thread"), the newest
_release = {"gap_s": None, "last": 0.0}  # `release_after_compiles`: off (None) or the least seconds between two


def release_after_compiles(min_gap_s: float | None = 10.0) -> None:
  """From now on, hands the heap's free pages back to the OS after the first compile of each `min_gap_s`
  window (`allocator.release_free_memory`; None: never). Compiling frees most of what it allocates, but
  glibc's arenas keep it: the calculator run's warm-up (65 programs over 6 minutes) climbed to 15.5 GB, of
  which the one release after the warm-up returned 8.8 GB. Called by launch.main (tests skip the releases)."""
  _release["gap_s"] = min_gap_s


def _listen(event: str, duration: float, fun_name: str = "?", **_) -> None:
  if event == _EVENT:
    with _lock:
      _totals[0] += 1
      _totals[1] += duration
      _names.append((_totals[0], f"{fun_name} on {threading.current_thread().name}"))
      gap, now = _release["gap_s"], time.monotonic()
      release = gap is not None and now - _release["last"] >= gap
      if release:
        _release["last"] = now
    if release:
      allocator.release_free_memory()


jax.monitoring.register_event_duration_secs_listener(_listen)


class CompileCounter:
  """`delta()` -> (compiles, seconds) since the previous call (or since construction)."""

  def __init__(self):
    self._mark = self._last = self.total()

  @staticmethod
  def total() -> tuple[int, float]:
    with _lock:
      return _totals[0], _totals[1]

  def delta(self) -> tuple[int, float]:
    now = self.total()
    out = now[0] - self._mark[0], now[1] - self._mark[1]
    self._last, self._mark = self._mark, now
    return out

  def names(self) -> list[str]:
    """The programs the last `delta()` counted (its newest 256): which ones, on which thread."""
    with _lock:
      return [name for n, name in _names if self._last[0] < n <= self._mark[0]]


class Background:
  """`fn()` on a thread; `wait()` joins it and raises what it raised (nothing when never started)."""

  def __init__(self, fn=None, name: str = "background"):
    self._error: BaseException | None = None
    self._thread = None
    if fn is not None:
      def body():
        try:
          fn()
        except BaseException as e:  # re-raised in the waiting thread
          self._error = e
      self._thread = threading.Thread(target=body, daemon=True, name=name)
      self._thread.start()

  def join(self) -> None:
    """Waits for `fn` to end; what it raised stays for `wait`."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def wait(self) -> None:
    self.join()
    if self._error is not None:
      raise self._error
