"""The one owner of weight versions: atomic publish, one wait, and the trainer-side history a rebuilt sampler
needs.

The trainer calls `push(params, version)`; the transport moves the weights onto the sampler's shardings and,
in a process that holds sampler devices, the service publishes them. Samplers read `latest()`, `wait_for(v)`
(block until version >= v; in deterministic mode exactly v, which is why the service keeps the last `keep`
versions). With `history` > 0 the service also keeps
trainer-side copies of the last `history` pushed versions: after a sampler slice is lost, the new service
(`adopt_history`) can push exactly the versions its batches need again (`replay`). In a multi-process job the
sampler process runs `serve()`, which receives every push from the trainer process and publishes it.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Optional

import jax


class Closed(Exception):
  """The service (or a queue) was closed while a caller waited (shutdown, preemption)."""


class WeightsService:
  """Versioned sampler-side weights over a `Transport` (None: publish-only, e.g. a standalone sampler)."""

  def __init__(self, transport: Any = None, keep: int = 1, history: int = 0):
    if keep < 1 or history < 0:
      raise ValueError(f"WeightsService keep={keep} must be >= 1 and history={history} >= 0")
    self.transport, self.keep, self.history = transport, keep, history
    self._versions: collections.OrderedDict[int, Any] = collections.OrderedDict()
    self._history: collections.OrderedDict[int, Any] = collections.OrderedDict()
    self._cv = threading.Condition()
    self._closed = False
    self.pushed = -1  # the newest version this process pushed (trainer side)

  # -- trainer side ----------------------------------------------------------------------------------------
  def push(self, trainer_params: Any, version: int) -> dict[str, float]:
    """Sends `version` through the transport; publishes it here when this process holds sampler devices."""
    if version <= self.pushed:
      raise ValueError(f"push version {version} is not newer than the last pushed version {self.pushed}")
    if self.history:
      self._history[version] = jax.tree.map(lambda x: x.copy(), trainer_params)  # the trainer donates its state
      while len(self._history) > self.history:
        self._history.popitem(last=False)
    got, stats = self.transport.send(trainer_params, version)  # stats: sync_s and what the transport measured
    self.pushed = version
    if got is not None:
      self._publish(got, version)
    return stats

  def end(self) -> None:
    """Trainer side: no more pushes (a sampler process's `serve` returns)."""
    self.transport.close()

  @property
  def kept(self) -> dict[int, Any]:
    """The trainer-side copies kept (version → params), oldest first."""
    return dict(self._history)

  def adopt_history(self, other: "WeightsService") -> None:
    """Takes over another service's trainer-side copies (a rebuilt service replays them)."""
    self._history = collections.OrderedDict(other.kept)

  def forget_history(self) -> None:
    """The trainer restored a checkpoint: the kept versions belong to a discarded future."""
    self._history.clear()

  def replay(self, first: int, step: int, params: Any, staleness: int, exact: bool) -> list[tuple[Any, int]]:
    """(params, version) to push into a fresh service so that batch `first` gets its version: with `exact`
    (deterministic mode) every kept version from first - staleness up to the trainer's `step` (its params),
    else just the newest."""
    need = max(0, first - staleness)
    if not exact or need >= step:
      return [(params, step)]
    missing = [v for v in range(need, step) if v not in self._history]
    if missing:
      raise RuntimeError(f"deterministic failover needs weight versions {missing} to regenerate batch {first}, "
                         f"but only versions {sorted(self._history)} are kept")
    return [(self._history[v], v) for v in range(need, step)] + [(params, step)]

  # -- sampler side ----------------------------------------------------------------------------------------
  def publish(self, params: Any, version: int) -> None:
    """Makes `version` the newest: check and insert in one step under the lock, so readers see old or new,
    never a mix, and concurrent publishers cannot insert out of order."""
    with self._cv:
      if self._versions and version <= next(reversed(self._versions)):
        raise ValueError(f"weights version {version} is not newer than the newest published, "
                         f"{next(reversed(self._versions))}")
      self._publish(params, version)

  def _publish(self, params: Any, version: int) -> None:
    with self._cv:  # re-entrant: publish holds it already
      self._versions[version] = params
      while len(self._versions) > self.keep:
        self._versions.popitem(last=False)
      self._cv.notify_all()

  @property
  def version(self) -> int:
    with self._cv:
      return next(reversed(self._versions)) if self._versions else -1

  def latest(self) -> tuple[Any, int]:
    """(params, version) of the newest published version."""
    with self._cv:
      if not self._versions:
        raise ValueError("WeightsService: no weights have been published yet")
      v = next(reversed(self._versions))
      return self._versions[v], v

  def wait_for(self, version: int, *, exact: bool = False, timeout: Optional[float] = None
               ) -> tuple[Any, int, float]:
    """Blocks until a version >= `version` is published → (params, version, seconds waited).

    `exact`: return exactly `version` (it must still be kept). Raises Closed after `close()`.
    """
    t0 = time.perf_counter()
    with self._cv:
      ok = self._cv.wait_for(lambda: self._closed or (self._versions and next(reversed(self._versions)) >= version),
                             timeout)
      if self._closed:
        raise Closed()
      if not ok:
        raise TimeoutError(f"weights version {version} did not arrive within {timeout}s")
      if exact:
        if version not in self._versions:
          raise RuntimeError(f"weights version {version} is no longer kept (have {list(self._versions)}); "
                             "the deterministic schedule needs keep >= max_staleness + 1")
        v = version
      else:
        v = next(reversed(self._versions))
      return self._versions[v], v, time.perf_counter() - t0

  def serve(self) -> None:
    """Multi-process sampler side: publish every version the trainer process pushes, until it ends."""
    try:
      while True:
        got = self.transport.receive()
        if got is None:
          break
        self._publish(*got)
    finally:
      self.close()

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()
