"""How pushed weights travel from the trainer's shardings to the sampler's.

`DevicePutTransport`: one controller addresses both submeshes, so a push is `reshard`: a cast on the trainer
mesh and a device-to-device move onto the sampler shardings, never aliasing the trainer's donated buffers. `CrossProcessTransport`: the roles live in different processes joined by
`jax.distributed`, so a push is `CrossMeshPush`'s collective program, run by both processes in the same
order; the version number travels over the coordination service's key-value store.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol

import jax

from rlax.models import lora as lora_lib
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


class AdapterTransport:
  """LoRA: a push carries the adapters only (`adapters`: a transport for the adapter tree, f32); the sampler
  side merges each version into its pristine copy of the base (`base`: a transport for the full tree, sent
  once, from `base_source()`, the trainer's frozen base), W + A @ B * scale in one jitted compute (in f32,
  rounded once to `dtype`)."""

  def __init__(self, adapters: Any, base: Any, base_source, lora, dtype: Any):
    self.adapters, self.base, self.base_source, self.lora = adapters, base, base_source, lora
    self._pristine = None
    out = getattr(base, "shardings", None)  # merged weights on the sampler's own parameter shardings
    self._merge = jax.jit(lambda b, a: lora_lib.merge_to(b, a, lora, dtype),
                          **({} if out is None else dict(out_shardings=out)))

  def send(self, trainer_params: Any, version: int) -> tuple[Optional[Any], dict[str, float]]:
    t0 = time.perf_counter()
    stats = {}
    if self._pristine is None:  # the base crosses once, in the base transport's dtype
      self._pristine, base_stats = self.base.send(self.base_source(), version)
      stats.update({f"base_{k}": v for k, v in base_stats.items()})
    got, ad = self.adapters.send(trainer_params, version)
    stats.update(ad)
    if got is not None:
      got = self._merge(self._pristine, got)
      stats["merge_s"] = time.perf_counter() - t0 - stats.get("sync_s", 0.0) - stats.get("base_sync_s", 0.0)
    return got, stats

  def receive(self):
    raise RuntimeError("AdapterTransport delivers on send; there is nothing to receive")

  def close(self) -> None:
    self.adapters.close()
    self.base.close()
