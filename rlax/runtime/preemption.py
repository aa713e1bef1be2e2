"""Preemption notices: SIGTERM (and Ctrl-C) ask the loop to checkpoint at the next step boundary and return.

If the checkpoint is not written within the grace period the process exits anyway, as the scheduler
would kill it.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

from absl import logging


class Preemption:
  """A stop request with a grace timer; `install()` routes SIGTERM and SIGINT to `request()`."""

  def __init__(self, grace_seconds: float):
    self.grace_seconds = grace_seconds
    self._event = threading.Event()
    self._timer: Optional[threading.Timer] = None
    self._previous: dict = {}

  @property
  def requested(self) -> bool:
    return self._event.is_set()

  def install(self) -> None:
    """Handles SIGTERM and SIGINT (signals can only be handled on the main thread: elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self.request)

  def request(self, *_) -> None:
    """Checkpoint at the next safe point and return; force exit after the grace period."""
    if self._event.is_set():
      return
    logging.warning("preemption notice: checkpointing at the next step boundary (grace %.0fs)", self.grace_seconds)
    self._event.set()

    def overdue():  # exit 1: the work since the last checkpoint is lost, which is no success
      logging.error("grace period of %.0fs exceeded before the checkpoint finished; exiting without it (exit 1)",
                    self.grace_seconds)
      os._exit(1)
    self._timer = threading.Timer(self.grace_seconds, overdue)
    self._timer.daemon = True
    self._timer.start()

  def cancel(self) -> None:
    """The run finished: no forced exit, and the previous signal handlers are back."""
    if self._timer is not None:
      self._timer.cancel()
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
