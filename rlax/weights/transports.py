"""How pushed weights travel from the trainer's shardings to the sampler's.

`DevicePutTransport`: one controller addresses both submeshes, so a push is `reshard`: a cast on the trainer
mesh and a device-to-device move onto the sampler shardings, never aliasing the trainer's donated buffers. `CrossProcessTransport`: the roles live in different processes joined by
`jax.distributed`, so a push is `CrossMeshPush`'s collective program, run by both processes in the same
order; the version number travels over the coordination service's key-value store.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol

from rlax.multihost import Channel, CrossMeshPush
from rlax.weights.reshard import reshard


class Transport(Protocol):
  """send: trainer side → (params on the sampler shardings if this process holds them, else None; stats).
  receive: sampler side of a multi-process job → (params, version), or None once the trainer ended."""

  def send(self, trainer_params: Any, version: int) -> tuple[Optional[Any], dict[str, float]]: ...

  def receive(self) -> Optional[tuple[Any, int]]: ...

  def close(self) -> None: ...


class DevicePutTransport:
  """Single controller: a stateless `reshard` onto the sampler's shardings and dtype at every send."""

  def __init__(self, sampler_shardings: Any, dtype: Any, transport: str = "auto"):
    self.shardings, self.dtype, self.transport = sampler_shardings, dtype, transport

  def send(self, trainer_params: Any, version: int) -> tuple[Any, dict[str, float]]:
    del version  # the service owns versions
    params, stats = reshard(trainer_params, self.shardings, self.dtype, transport=self.transport)
    return params, stats.as_dict()

  def receive(self):
    raise RuntimeError("DevicePutTransport delivers on send; there is nothing to receive")

  def close(self) -> None:
    pass


class CrossProcessTransport:
  """Multi-process: `CrossMeshPush` between the trainer process's and the sampler process's meshes.

  `shapes`: the parameter tree of ShapeDtypeStruct (every process passes it, so the collective has the
  same signature everywhere). Pushes are numbered; push n's version is published under `weights/n`
  before the collective, and `close()` (trainer side) publishes 'end' so the sampler's `serve` returns.
  """

  def __init__(self, trainer_mesh, sampler_mesh, sampler_shardings: Any, dtype: Any, shapes: Any, channel: Channel):
    self.push = CrossMeshPush(trainer_mesh, sampler_mesh, sampler_shardings, dtype=dtype, name="weights")
    self.shapes, self.channel = shapes, channel
    self._sent = self._received = 0

  def send(self, trainer_params: Any, version: int) -> tuple[Optional[Any], dict[str, float]]:
    t0 = time.perf_counter()
    self.channel.set(f"weights/{self._sent}", str(version))
    self._sent += 1
    out = self.push(trainer_params, shapes=self.shapes)
    return out, {"sync_s": time.perf_counter() - t0}

  def receive(self) -> Optional[tuple[Any, int]]:
    msg = self.channel.get(f"weights/{self._received}")
    self._received += 1
    if msg == "end":
      return None
    return self.push(None, shapes=self.shapes), int(msg)

  def close(self) -> None:
    self.channel.set(f"weights/{self._sent}", "end")
