"""The bounded rollout queue between the sampler fleet and the trainer, with a staleness bound.

Every rollout carries the weight version that produced it (for an in-flight
weight swap: the oldest version among its tokens). The trainer at policy
version `s` accepts a rollout of version `v` only if `s - v <= max_staleness`;
older ones are dropped or kept for importance weighting, as configured.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Optional

from rlax.weights.service import Closed


@dataclasses.dataclass
class Rollout:
  """One step's worth of generated, graded samples. `index` is the batch's step number."""
  index: int
  version: int                 # oldest weight version among its tokens
  data: Any                    # the packed RolloutBatch (numpy, on the host)
  stats: dict = dataclasses.field(default_factory=dict)
  data_state: dict = dataclasses.field(default_factory=dict)  # data iterator position after this batch


class RolloutQueue:
  """Thread-safe bounded FIFO. `put` blocks when full; `get` blocks when empty."""

  def __init__(self, maxsize: int, max_staleness: int, stale_policy: str = "drop"):
    if maxsize < 1:
      raise ValueError(f"queue_size must be >= 1, got {maxsize}")
    if max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if stale_policy not in ("drop", "importance_weight"):
      raise ValueError(f"stale_policy must be 'drop' or 'importance_weight', got {stale_policy!r}")
    self.maxsize, self.max_staleness, self.stale_policy = maxsize, max_staleness, stale_policy
    self._items: collections.deque[Rollout] = collections.deque()
    self._cv = threading.Condition()
    self._closed = False
    self.dropped = 0
    self.staleness_hist: collections.Counter[int] = collections.Counter()

  def put(self, item: Rollout, timeout: Optional[float] = None) -> float:
    """Enqueues; returns seconds spent waiting for room."""
    t0 = time.perf_counter()
    with self._cv:
      if not self._cv.wait_for(lambda: self._closed or len(self._items) < self.maxsize, timeout):
        raise TimeoutError("rollout queue stayed full")
      if self._closed:
        raise Closed()
      self._items.append(item)
      self._cv.notify_all()
    return time.perf_counter() - t0

  def get(self, policy_version: int, timeout: Optional[float] = None) -> tuple[Rollout, float]:
    """Next rollout usable at `policy_version` (too-stale ones dropped per policy), and the wait in s."""
    t0 = time.perf_counter()
    with self._cv:
      while True:
        if not self._cv.wait_for(lambda: self._closed or self._items, timeout):
          raise TimeoutError("no rollout arrived")
        if not self._items:
          raise Closed()
        item = self._items.popleft()
        self._cv.notify_all()
        staleness = policy_version - item.version
        if staleness > self.max_staleness and self.stale_policy == "drop":
          self.dropped += 1
          continue
        self.staleness_hist[staleness] += 1
        return item, time.perf_counter() - t0

  def peek(self, n: int, timeout: Optional[float] = None) -> list[Rollout]:
    """The first `n` queued rollouts (waiting until there are n), without removing them."""
    if n > self.maxsize:
      raise ValueError(f"cannot wait for {n} rollouts in a queue of size {self.maxsize}")
    with self._cv:
      if not self._cv.wait_for(lambda: self._closed or len(self._items) >= n, timeout):
        raise TimeoutError(f"fewer than {n} rollouts arrived")
      if len(self._items) < n:
        raise Closed()
      return list(self._items)[:n]

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()

  def __len__(self) -> int:
    with self._cv:
      return len(self._items)
