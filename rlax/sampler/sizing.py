"""How much memory a sampler needs and how many decode slots fit: the one place that decides it.

The engine checks its own footprint with `sampler_memory`, `builders` sizes `rollout.slots=-1` with
`slots_that_fit`, the start-up memory estimate (`rlax.memory`) and the planner call the same functions, and
`device_budget` is every role's per-device budget. Bytes are per device, from the layouts' own shapes and
shardings (`rlax.sampler.layouts`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rlax import models
from rlax.models import moe
from rlax.models import sharding as shd
from rlax.sampler import params as params_lib


def device_budget(device, *, free: bool = False) -> int:
  """Bytes one device may use: the accelerator's `memory_stats()["bytes_limit"]` (free=True: minus what is in
  use); a CPU device's even share of the host's RAM (fake CPU devices all live in one RAM)."""
  try:
    stats = device.memory_stats()
  except Exception:  # CPU devices and some backends do not implement it
    stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - (int(stats.get("bytes_in_use", 0)) if free else 0)
  if device.platform == "cpu":
    import psutil  # pylint: disable=g-import-not-at-top
    return psutil.virtual_memory().total // max(1, len(jax.local_devices(backend="cpu")))
  raise ValueError(f"device {device} reports no memory_stats()['bytes_limit']; pass the budget explicitly")


def tree_bytes(shapes: Any, shardings: Any = None, itemsize: int = 0) -> int:
  """Per-device bytes of a tree of shapes (arrays or ShapeDtypeStructs) on a tree of shardings (None: each
  leaf's own sharding, whole arrays where it has none); itemsize: bytes per element instead of the dtype's.
  The one per-shard byte count (rlax.memory, rlax.planning_sync, the sampler's sizing)."""
  leaves = jax.tree.leaves(shapes)
  shards = [getattr(x, "sharding", None) for x in leaves] if shardings is None else jax.tree.leaves(shardings)
  return sum(int(np.prod(sh.shard_shape(x.shape) if sh is not None else x.shape, dtype=np.int64))
             * (itemsize or jnp.dtype(x.dtype).itemsize) for x, sh in zip(leaves, shards))


def kv_bytes(cfg: models.ModelConfig, layout, slots: int, mesh=None) -> int:
  """Per-device bytes of `layout`'s cache for `slots` slots (on `mesh`'s shardings when given)."""
  shapes = jax.eval_shape(lambda: layout.init(cfg, slots))
  return tree_bytes(shapes, layout.shardings(cfg, mesh, slots) if mesh is not None else None)


def route_bytes(cfg: models.ModelConfig, slots: int, length: int, mesh=None) -> int:
  """Per-device bytes of the routes the slots record (rlax.sampler.slots.SlotState.routes: [slots, length, L, k]
  uint8, rows over the row shards) when the model replays them, else 0."""
  shape = moe.replayed_routes(cfg)
  if shape is None:
    return 0
  x = jax.ShapeDtypeStruct((slots, length, *shape), moe.ROUTE_DTYPE)
  return tree_bytes(x, None if mesh is None else shd.batch_sharding(mesh, slots, 4))


def recompute_bytes(cfg: models.ModelConfig, slots: int, length: int, mesh=None) -> int:
  """Per-device bytes of the keys and values a recompute (or a prefill of `slots` rows) holds before the layout
  takes them: [L, slots, length, K, Dh] twice, rows over the batch axes, KV heads over 'tensor'."""
  shape = (cfg.n_layers, slots, length, cfg.n_kv_heads, cfg.head_dim)
  sh = None
  if mesh is not None:
    spec = models.spec_for((None, "batch", None, "act_kv_heads", None), shape, dict(mesh.shape))
    sh = jax.sharding.NamedSharding(mesh, spec)
  return 2 * tree_bytes(jax.ShapeDtypeStruct(shape, cfg.jnp_dtype), sh)


def weight_bytes(cfg: models.ModelConfig, mesh=None) -> int:
  """Per-device bytes of the weights as the sampler holds them (compute dtype, its shardings)."""
  return tree_bytes(params_lib.abstract(cfg, mesh), None if mesh is None else
                     jax.tree.map(lambda x: x.sharding, params_lib.abstract(cfg, mesh)))


def sampler_memory(cfg: models.ModelConfig, layout, slots: int, length: int, mesh=None) -> dict[str, int]:
  """Per-device bytes by item: the KV cache (with a MoE's recorded routes), the recompute transient (as big as a
  dense cache of every slot's whole sequence), one version of the weights."""
  return dict(cache=kv_bytes(cfg, layout, slots, mesh) + route_bytes(cfg, slots, length, mesh),
              transient=recompute_bytes(cfg, slots, length, mesh), params=weight_bytes(cfg, mesh))


def check(memory: dict[str, int], budget: int, slots: int, length: int) -> None:
  """One ValueError naming the sizes when `memory` exceeds the per-device budget."""
  need = sum(memory.values())
  if need > budget:
    raise ValueError(
        f"sampler needs {need:,} bytes per device (KV cache {memory['cache']:,} for {slots} slots x {length} "
        f"tokens, recompute transient {memory['transient']:,}, params {memory['params']:,}) but the memory budget "
        f"is {budget:,} bytes per device; lower rollout.slots or rollout.max_new_tokens")


def slots_that_fit(cfg: models.ModelConfig, layout, length: int, *, unit: int, cap: int, budget: int,
                   mesh=None) -> int:
  """The most slots (a multiple of `unit`, at most `cap`) whose cache, recompute transient and weights fit
  `budget` bytes per device. Raises one ValueError naming the sizes when not even `unit` slots fit."""
  one = sampler_memory(cfg, layout, unit, length, mesh)
  per_unit = one["cache"] + one["transient"]  # both scale with the slots
  n = (budget - one["params"]) // max(1, per_unit)
  if n < 1:
    raise ValueError(
        f"sampler: one group of {unit} slots x {length} tokens needs {per_unit + one['params']:,} bytes per device "
        f"(KV cache and recompute {per_unit:,}, params {one['params']:,}) but the budget is {budget:,}; shorten "
        "rollout.max_new_tokens or add devices")
  return int(min(n * unit, max(unit, cap // unit * unit)))


def row_unit(mesh, samples: int, eval_samples: int, slots: int) -> int:
  """Slots come in whole groups of both group sizes and whole shards of the mesh's rows."""
  import math  # pylint: disable=g-import-not-at-top
  return math.lcm(samples, eval_samples, shd.row_shards(mesh, slots) if mesh is not None else 1)


def budget_or_default(budget: Optional[int], devices) -> int:
  return int(budget) if budget is not None else device_budget(devices[0])
