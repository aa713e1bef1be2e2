"""Trainer weights → the sampler's shardings and dtype: the stateless device-to-device reshard under the
single-controller transport (the parameter server's move).

The target layout is read from the sampler's own shardings (a pytree of `Sharding`s matching the parameter
tree), as Tunix's reshard.py does. Floating leaves are cast to the sampler dtype *on the trainer mesh* first
(fewer bytes cross), then moved:
- 'device' (accelerators): `jax.device_put` onto the target shardings, never aliasing the trainer's buffers
  (the trainer donates its parameters to its next step); `jit(..., out_shardings=<other mesh>)` fails across
  disjoint meshes.
- 'host' (CPU devices, whose memory *is* host memory): each block of each distinct target shard is copied once,
  by a thread pool, from zero-copy views of the source shards into a 64-byte-aligned buffer that the sampler's
  devices adopt without a copy (data-parallel replicas share it), and the cast runs per leaf so the copies of one
  leaf overlap the cast of the next. `device_put` across meshes with a layout change instead gathers the array
  into one host array, then copies every device's shard out of it (replicas included). XLA copies an adopted
  buffer before writing into it, so donating these arrays later is safe.
- 'auto': host when every source and target device is a local CPU device, else device.
"""

from __future__ import annotations

import collections
from concurrent import futures
import dataclasses
import functools
import os
import threading
import time
from typing import Any, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

TRANSPORTS = ("auto", "device", "host")
# Traces of the source-side cast: a sync must not retrace per push.
TRACE_COUNTS: collections.Counter = collections.Counter()
_ALIGN = 64  # XLA:CPU adopts a host buffer without copying only when it is this aligned
_SPLIT_BYTES = 4 << 20  # copy tasks of about this size keep every pool thread busy


@dataclasses.dataclass(frozen=True)
class SyncStats:
  """One reshard: wall seconds (inputs ready → outputs ready), bytes delivered in the sampler dtype."""
  seconds: float
  bytes: int
  source_bytes: int
  gb_per_s: float
  transport: str

  def as_dict(self) -> dict[str, float]:
    """Flat metrics for a logger: sync_s, sync_bytes, sync_gb_per_s."""
    return {"sync_s": self.seconds, "sync_bytes": float(self.bytes), "sync_gb_per_s": self.gb_per_s}


@functools.partial(jax.jit, static_argnames=("dtype",))
def _cast(x, dtype):
  """Source mesh: one leaf to the sampler dtype (one program per leaf, so copies start as each lands)."""
  TRACE_COUNTS["cast"] += 1
  return x.astype(dtype)


_POOL: futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> futures.ThreadPoolExecutor:
  global _POOL
  with _POOL_LOCK:
    if _POOL is None:
      _POOL = futures.ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 1)), thread_name_prefix="param_sync")
    return _POOL


def _aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
  n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
  raw = np.empty(n + _ALIGN, np.uint8)
  off = -raw.ctypes.data % _ALIGN
  return raw[off:off + n].view(dtype).reshape(shape)


def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


@dataclasses.dataclass(frozen=True)
class _Chunk:
  """One distinct target shard: its global bounds, the devices holding it, and the source blocks that fill it
  as (source device, global bounds of the overlap)."""
  bounds: tuple[tuple[int, int], ...]
  devices: tuple[jax.Device, ...]
  pieces: tuple[tuple[jax.Device, tuple[tuple[int, int], ...]], ...]


@functools.lru_cache(maxsize=1024)
def _layout(shape: tuple[int, ...], src: jax.sharding.Sharding, dst: jax.sharding.Sharding) -> tuple:
  """(target chunks, source shard bounds by device) for moving a `shape` array from `src` to `dst`."""
  src_bounds: dict[tuple, jax.Device] = {}
  for dev, idx in src.addressable_devices_indices_map(shape).items():
    src_bounds.setdefault(_bounds(idx, shape), dev)  # replicas hold the same block: read one
  chunks: dict[tuple, list[jax.Device]] = {}
  for dev, idx in dst.addressable_devices_indices_map(shape).items():
    chunks.setdefault(_bounds(idx, shape), []).append(dev)
  out = []
  for cb, devs in chunks.items():
    pieces = []
    for sb, sdev in src_bounds.items():
      ov = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(cb, sb))
      if all(lo < hi for lo, hi in ov):
        pieces.append((sdev, ov))
    out.append(_Chunk(cb, tuple(devs), tuple(pieces)))
  return tuple(out), {d: b for b, d in src_bounds.items()}


def _split(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
  """Split one block copy along its first axis longer than 1 into tasks of about `_SPLIT_BYTES`."""
  parts = dst.nbytes // _SPLIT_BYTES
  ax = next((a for a, n in enumerate(dst.shape) if n > 1), None)
  if parts < 2 or ax is None:
    return [(dst, src)]
  n = dst.shape[ax]
  parts = min(parts, n)
  cut = lambda x, i: x[(slice(None),) * ax + (slice(i * n // parts, (i + 1) * n // parts),)]
  return [(cut(dst, i), cut(src, i)) for i in range(parts)]


def _host_leaf(src: jax.Array, target: jax.sharding.Sharding) -> tuple[list, Any]:
  """(copy tasks, adopt) for one leaf: tasks fill aligned buffers from zero-copy views of the source shards;
  adopt() then makes the sampler's array over them without a copy."""
  chunks, src_bounds = _layout(src.shape, src.sharding, target)
  bufs = [_aligned_empty(tuple(b - a for a, b in c.bounds), src.dtype) for c in chunks]
  views = {s.device: np.asarray(s.data) for s in src.addressable_shards if s.device in src_bounds}  # zero-copy
  tasks = []
  for chunk, buf in zip(chunks, bufs):
    for sdev, ov in chunk.pieces:
      # `+ (...,)`: a 0-d index must still give a view, not a scalar.
      dst = buf[tuple(slice(lo - c0, hi - c0) for (lo, hi), (c0, _) in zip(ov, chunk.bounds)) + (...,)]
      s = views[sdev][tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(ov, src_bounds[sdev])) + (...,)]
      tasks += _split(dst, s)

  def adopt() -> jax.Array:
    per_device = [(d, b) for c, b in zip(chunks, bufs) for d in c.devices]
    arrays = jax.device_put([a for _, a in per_device], [d for d, _ in per_device])
    return jax.make_array_from_single_device_arrays(src.shape, target, arrays)

  return tasks, adopt


def _use_host(leaves: Sequence[jax.Array], shardings: Sequence[Any], transport: str) -> bool:
  if transport != "auto":
    return transport == "host"
  cpu_local = lambda sh: sh.is_fully_addressable and all(d.platform == "cpu" for d in sh.device_set)
  return all(cpu_local(x.sharding) for x in leaves) and all(cpu_local(sh) for sh in shardings)


def _out_dtype(x, dtype) -> np.dtype:
  return jnp.dtype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype


def reshard(params: Any, shardings: Any, dtype: Any = None, *, transport: str = "auto") -> tuple[Any, SyncStats]:
  """params (jax Arrays on the trainer mesh) → (the same tree on `shardings`, floating leaves in `dtype`; stats).

  Raises one ValueError naming the differing leaves when the trees do not match.
  """
  if transport not in TRANSPORTS:
    raise ValueError(f"reshard transport={transport!r}; expected one of {TRANSPORTS}")
  leaves, treedef = jax.tree.flatten(params)
  targets, target_def = jax.tree.flatten(shardings)
  if treedef != target_def:
    path = lambda t: {"/".join(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]}
    diff = sorted(path(params) ^ path(shardings)) or ["(same leaf names, different container types)"]
    raise ValueError(f"pushed params do not match the sampler shardings tree; differing leaves: {diff[:5]}")
  for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not isinstance(leaf, jax.Array):
      raise ValueError(f"pushed leaf {jax.tree_util.keystr(p)} is {type(leaf).__name__}, expected a jax.Array")
  jax.block_until_ready(leaves)  # time the sync, not the train step that produced the weights
  t0 = time.perf_counter()
  use_host = _use_host(leaves, targets, transport)
  # Every cast is dispatched up front (asynchronously): the copies of one leaf overlap the casts of the next.
  srcs = [_cast(x, dtype=_out_dtype(x, dtype)) if x.dtype != _out_dtype(x, dtype) else x for x in leaves]
  if use_host:
    pool, jobs, adopts = _pool(), [], []
    for x, sh in zip(srcs, targets):
      tasks, adopt = _host_leaf(x, sh)  # waits for this leaf's cast only
      jobs += [pool.submit(np.copyto, d, s) for d, s in tasks]
      adopts.append(adopt)
    for job in jobs:
      job.result()
    out = [adopt() for adopt in adopts]
  else:
    out = list(jax.device_put(srcs, targets, may_alias=False))
  moved = jax.tree.unflatten(treedef, out)
  jax.block_until_ready(moved)
  dt = time.perf_counter() - t0
  nbytes = sum(a.nbytes for a in out)
  stats = SyncStats(dt, nbytes, sum(x.nbytes for x in leaves), nbytes / dt / 1e9, "host" if use_host else "device")
  logging.vlog(1, "param sync: %.3fs, %.1f MB, %.2f GB/s (%s)", dt, nbytes / 1e6, stats.gb_per_s, stats.transport)
  return moved, stats
