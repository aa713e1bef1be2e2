"""Versioned weights moved trainer → sampler by device-to-device resharding, optionally in buckets.

The target layout is read from the sampler's own shardings (a pytree of `Sharding`s matching the
parameter tree), as Tunix's reshard.py does. A push casts to the sampler dtype *on the trainer mesh*
first (a jitted cast there, so fewer bytes cross), then moves the result onto the target shardings.
Two transports:
- 'device' (accelerators): `jax.device_put` onto the target shardings; `jit(..., out_shardings=<other
  mesh>)` fails across disjoint meshes.
- 'host' (CPU devices, whose memory *is* host memory): each block of each distinct target shard is
  copied once, by a thread pool, from zero-copy views of the source shards into a 64-byte-aligned
  buffer that the sampler's devices adopt without a copy (data-parallel replicas share it), and the
  cast runs per leaf so the copies of one leaf overlap the cast of the next. `device_put` across meshes
  with a layout change instead gathers the array into one host array, then copies every device's
  shard out of it (replicas included). XLA copies an adopted buffer before writing into it, so
  donating these arrays later is safe.
Buckets (one per layer of the stacked 'layers' axis, or packed to a byte budget) let a sync
interleave with decoding: `push_iter` yields each bucket after dispatching it, the sampler may swap
buckets into its live weights between decode chunks (`apply_bucket`), and the complete new version
is published when the iterator is exhausted. Works for any pytree of arrays.
"""

from __future__ import annotations

import collections
from concurrent import futures
import dataclasses
import functools
import os
import threading
import time
from typing import Any, Iterator, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MODES = ("whole", "per_layer", "bytes")
TRANSPORTS = ("auto", "device", "host")
# Traces of the source-side programs ('extract': slice/cast of the device transport, 'cast': per-leaf
# cast of the host transport): a sync must not retrace per layer or per push.
TRACE_COUNTS: collections.Counter = collections.Counter()
_ALIGN = 64  # XLA:CPU adopts a host buffer without copying only when it is this aligned
_SPLIT_BYTES = 4 << 20  # copy tasks of about this size keep every pool thread busy


@dataclasses.dataclass(frozen=True)
class SyncStats:
  """One sync: wall seconds (inputs ready → outputs ready), bytes delivered in the sampler dtype."""
  version: int
  seconds: float
  bytes: int
  source_bytes: int
  gb_per_s: float
  n_buckets: int
  mode: str
  transport: str = "device"

  def as_dict(self) -> dict[str, float]:
    """Flat metrics for a logger (`sync/seconds`, `sync/gb_per_s`, ...)."""
    return {f"sync/{k}": float(v) for k, v in dataclasses.asdict(self).items() if k not in ("mode", "transport")}


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Arrays already on the sampler mesh. `units[k] = (leaf index, layer or None)` for `arrays[k]`:
  a layer slice `[...]` of a stacked `[L, ...]` leaf, or a whole leaf when layer is None."""
  index: int
  version: int
  units: tuple[tuple[int, int | None], ...]
  arrays: tuple[jax.Array, ...]
  nbytes: int


def _uint_view(x):
  # XLA:CPU upcasts bf16 around dynamic-update-slice, which defeats the in-place update of a donated
  # buffer (a full copy per layer); an integer view of the same width keeps it in place.
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
  return x


@functools.partial(jax.jit, static_argnames=("dtypes", "stacked"))
def _extract(xs, idx, dtypes, stacked):
  """Source mesh: take layer `i` of stacked leaves and cast to the sampler dtype."""
  TRACE_COUNTS["extract"] += 1
  out = []
  for x, i, dt, s in zip(xs, idx, dtypes, stacked):
    y = jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False) if s else x
    out.append(y.astype(dt))
  return tuple(out)


def _insert_fn(fulls, pieces, idx):
  """Sampler mesh: write layer slices `pieces[j][m]` at `idx[j][m]` into donated stacked `fulls[j]`."""
  out = []
  for f, ps, ids in zip(fulls, pieces, idx):
    u = _uint_view(f)
    for p, i in zip(ps, ids):
      u = jax.lax.dynamic_update_index_in_dim(u, _uint_view(p), i, 0)
    out.append(jax.lax.bitcast_convert_type(u, f.dtype) if u.dtype != f.dtype else u)
  return tuple(out)


@functools.lru_cache(maxsize=64)
def _inserter(shardings: tuple, donate: bool):
  # Explicit out_shardings: an inferred one can drop trailing Nones from the spec, and a spec that
  # differs from the target's would recompile every sampler jit that sees these weights.
  return jax.jit(_insert_fn, donate_argnums=0 if donate else (), out_shardings=shardings)


def _insert_units(leaves: list, units, arrays, donate: bool) -> None:
  """Write bucket arrays into `leaves` (a flat list, updated): whole leaves replaced, slices inserted."""
  groups: dict[int, list[tuple[jax.Array, int]]] = {}
  for (leaf, layer), arr in zip(units, arrays):
    if layer is None:
      leaves[leaf] = arr
    else:
      groups.setdefault(leaf, []).append((arr, layer))
  if not groups:
    return
  keys = sorted(groups)
  fn = _inserter(tuple(leaves[k].sharding for k in keys), donate)
  new = fn(tuple(leaves[k] for k in keys), tuple(tuple(a for a, _ in groups[k]) for k in keys),
           tuple(tuple(np.int32(l) for _, l in groups[k]) for k in keys))
  for k, a in zip(keys, new):
    leaves[k] = a


@functools.lru_cache(maxsize=16)
def _allocator(specs: tuple, shardings: tuple):
  """Cached jitted zeros for the stacked staging buffers (a fresh jit per push would recompile)."""
  return jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype in specs), out_shardings=shardings)


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


# -- host transport (CPU devices) ------------------------------------------------------------------------


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
  """One distinct target shard: its global bounds, the devices holding it, and the source blocks that
  fill it as (source device, global bounds of the overlap)."""
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


def _adopt(shape, sharding, per_device: Sequence[tuple[jax.Device, np.ndarray]]) -> jax.Array:
  """A global array whose per-device buffers are the given aligned host arrays, adopted without a copy."""
  bufs = jax.device_put([a for _, a in per_device], [d for d, _ in per_device])
  return jax.make_array_from_single_device_arrays(shape, sharding, bufs)


class _HostLeaf:
  """One leaf's staging for the host transport: source views, destination chunks, layer-slice arrays."""

  def __init__(self, src: jax.Array, target: jax.sharding.Sharding):
    self.src, self.target = src, target
    self.chunks, self.src_bounds = _layout(src.shape, src.sharding, target)
    self.bufs = [_aligned_empty(tuple(b - a for a, b in c.bounds), src.dtype) for c in self.chunks]
    self._views: dict[jax.Device, np.ndarray] | None = None

  def copy_tasks(self, layer: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Block copies that fill the whole leaf (layer None) or layer `layer` of its leading axis."""
    if self._views is None:  # np.asarray waits for this leaf's cast only; zero-copy on CPU
      self._views = {s.device: np.asarray(s.data) for s in self.src.addressable_shards
                     if s.device in self.src_bounds}
    tasks = []
    for chunk, buf in zip(self.chunks, self.bufs):
      for sdev, ov in chunk.pieces:
        if layer is not None:
          if not ov[0][0] <= layer < ov[0][1]:
            continue
          ov = ((layer, layer + 1),) + ov[1:]
        # `+ (...,)`: a 0-d index must still give a view, not a scalar.
        dst = buf[tuple(slice(lo - c0, hi - c0) for (lo, hi), (c0, _) in zip(ov, chunk.bounds)) + (...,)]
        src = self._views[sdev][tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in
                                      zip(ov, self.src_bounds[sdev])) + (...,)]
        tasks += _split(dst, src)
    return tasks

  def array(self, layer: int | None) -> jax.Array:
    """The sampler array of the whole leaf, or of one layer of it (a zero-copy view into the same buffer)."""
    sh = self.target
    if layer is None:
      return _adopt(self.src.shape, sh, [(d, b) for c, b in zip(self.chunks, self.bufs) for d in c.devices])
    sh = NamedSharding(sh.mesh, P(*sh.spec[1:]), memory_kind=sh.memory_kind)
    return _adopt(self.src.shape[1:], sh, [(d, b[layer - c.bounds[0][0]])
                                          for c, b in zip(self.chunks, self.bufs) for d in c.devices])

  def release(self) -> None:
    self.src, self._views = None, None  # drop the views: the trainer may donate its buffers next


def apply_bucket(sampler_params: Any, bucket: Bucket, donate: bool = False) -> Any:
  """Swap one bucket into a live sampler parameter tree (in-flight update between decode chunks).

  Returns a new tree whose leaves named by `bucket.units` hold the bucket's values: whole leaves are
  replaced, layer slices are written into the stacked `[L, ...]` leaf. With `donate`, the old stacked
  buffers are updated in place and must not be used afterwards.
  """
  leaves, treedef = jax.tree.flatten(sampler_params)
  _insert_units(leaves, bucket.units, bucket.arrays, donate)
  return jax.tree.unflatten(treedef, leaves)


class ParameterServer:
  """Versioned sampler-side weights, filled from the trainer by device-to-device resharding.

  `sampler_shardings`: pytree of target shardings, same structure as the params. `sampler_dtype`:
  floating leaves are cast to it on the trainer mesh before moving (None keeps dtypes). `mode`:
  'whole' (one transfer), 'per_layer' (one bucket per index of the stacked `layer_key` axis plus one
  for the other leaves) or 'bytes' (layer slices and whole leaves packed up to `bucket_bytes`; a
  single leaf larger than the budget travels alone). Default: 'bytes' if `bucket_bytes` else 'whole'.
  `transport`: 'device', 'host' (meant for CPU devices, see the module docstring) or 'auto' (host when
  every source and target device is a local CPU device).
  """

  def __init__(self, sampler_shardings: Any, sampler_dtype: Any = None, bucket_bytes: int | None = None,
               mode: str | None = None, layer_key: str = "layers", transport: str = "auto"):
    mode = mode or ("bytes" if bucket_bytes else "whole")
    if mode not in MODES:
      raise ValueError(f"ParameterServer mode={mode!r}; expected one of {MODES}")
    if transport not in TRANSPORTS:
      raise ValueError(f"ParameterServer transport={transport!r}; expected one of {TRANSPORTS}")
    if mode == "bytes" and not (bucket_bytes and bucket_bytes > 0):
      raise ValueError(f"mode='bytes' needs a positive bucket_bytes, got {bucket_bytes}")
    self._shardings, self._treedef = jax.tree.flatten(sampler_shardings)
    self._paths = [_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(sampler_shardings)[0]]
    self.dtype = None if sampler_dtype is None else jnp.dtype(sampler_dtype)
    self.mode, self.bucket_bytes, self.layer_key, self.transport = mode, bucket_bytes, layer_key, transport
    self._params, self._version = None, -1
    self.last_stats: SyncStats | None = None

  @property
  def version(self) -> int:
    return self._version

  def pull(self) -> tuple[Any, int]:
    """(params on the sampler shardings, version) of the newest complete push."""
    if self._params is None:
      raise ValueError("ParameterServer.pull: no weights have been pushed yet")
    return self._params, self._version

  def push(self, trainer_params: Any, version: int) -> SyncStats:
    """Move `trainer_params` to the sampler shardings as `version`, all buckets; returns stats."""
    for _ in self.push_iter(trainer_params, version):
      pass
    return self.last_stats

  def _leaves(self, trainer_params: Any) -> list[jax.Array]:
    leaves, treedef = jax.tree.flatten(trainer_params)
    if treedef != self._treedef:
      got = {_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(trainer_params)[0]}
      diff = sorted(got ^ set(self._paths)) or ["(same leaf names, different container types)"]
      raise ValueError(f"pushed params do not match the sampler shardings tree; differing leaves: {diff[:5]}")
    for leaf, path in zip(leaves, self._paths):
      if not isinstance(leaf, jax.Array):
        raise ValueError(f"pushed leaf {path} is {type(leaf).__name__}, expected a jax.Array on the trainer mesh")
    return leaves

  def _is_stacked(self, k: int, leaf: jax.Array) -> bool:
    sh = self._shardings[k]
    return (self.mode != "whole" and f"/{self.layer_key}/" in f"/{self._paths[k]}/" and leaf.ndim >= 1
            and isinstance(sh, NamedSharding) and (len(sh.spec) == 0 or sh.spec[0] is None))

  def _plan(self, leaves: Sequence[jax.Array]) -> list[list[tuple[int, int | None]]]:
    """Buckets as lists of units (leaf index, layer or None)."""
    if self.mode == "whole":
      return [[(k, None) for k in range(len(leaves))]]
    stacked = [k for k, x in enumerate(leaves) if self._is_stacked(k, x)]
    rest = [(k, None) for k in range(len(leaves)) if k not in stacked]
    n_layers = max((leaves[k].shape[0] for k in stacked), default=0)
    by_layer = [[(k, l) for k in stacked if l < leaves[k].shape[0]] for l in range(n_layers)]
    if self.mode == "per_layer":
      return [b for b in by_layer + [rest] if b]
    buckets, cur, size = [], [], 0
    for unit in [u for b in by_layer for u in b] + rest:
      x = leaves[unit[0]]
      n = x.size // (x.shape[0] if unit[1] is not None else 1) * self._out_dtype(x).itemsize
      if cur and size + n > self.bucket_bytes:
        buckets.append(cur)
        cur, size = [], 0
      cur.append(unit)
      size += n
    return buckets + ([cur] if cur else [])

  def _out_dtype(self, x) -> np.dtype:
    if self.dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
      return self.dtype
    return x.dtype

  def push_iter(self, trainer_params: Any, version: int) -> Iterator[Bucket]:
    """Generator of buckets, each already dispatched to the sampler mesh; publishes `version` at the end.

    Nothing blocks between buckets, so transfers overlap with whatever the caller runs in between
    (decode chunks); the end of the generator waits for all transfers, then sets `last_stats`.
    Bad input (stale version, mismatching tree) raises here, not at the first `next`. An abandoned
    iterator publishes nothing. Sampler memory peaks at two versions (published + staging).
    """
    if version <= self._version:
      raise ValueError(f"push version {version} is not newer than the current version {self._version}")
    return self._transfer(self._leaves(trainer_params), version)

  def _use_host(self, leaves: Sequence[jax.Array]) -> bool:
    if self.transport != "auto":
      return self.transport == "host"
    cpu_local = lambda sh: sh.is_fully_addressable and all(d.platform == "cpu" for d in sh.device_set)
    return all(cpu_local(x.sharding) for x in leaves) and all(cpu_local(sh) for sh in self._shardings)

  def _transfer(self, leaves: list[jax.Array], version: int) -> Iterator[Bucket]:
    jax.block_until_ready(leaves)  # time the sync, not the train step that produced the weights
    t0 = time.perf_counter()
    buckets = self._plan(leaves)
    out: list[Any] = [None] * len(leaves)
    transport = "host" if self._use_host(leaves) else "device"
    moved = (self._host_buckets if transport == "host" else self._device_buckets)(leaves, buckets, out)
    total = 0
    for b_index, (units, arrays) in enumerate(moved):
      nbytes = sum(a.nbytes for a in arrays)
      total += nbytes
      yield Bucket(b_index, version, tuple(units), arrays, nbytes)
    params = jax.tree.unflatten(self._treedef, out)
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    self._params, self._version = params, version
    src = sum(x.nbytes for x in leaves)
    self.last_stats = SyncStats(version, dt, total, src, total / dt / 1e9, len(buckets), self.mode, transport)
    logging.info("param sync v%d: %.3fs, %.1f MB, %.2f GB/s, %d buckets (%s, %s)", version, dt, total / 1e6,
                 self.last_stats.gb_per_s, len(buckets), self.mode, transport)

  def _host_buckets(self, leaves: list[jax.Array], buckets, out: list) -> Iterator[tuple[list, tuple]]:
    """Host transport: per bucket, copy its blocks into the sampler's buffers, then adopt them."""
    # Every cast is dispatched up front (asynchronously): the copies of one leaf overlap the casts of the next.
    srcs = [_cast(x, dtype=self._out_dtype(x)) if x.dtype != self._out_dtype(x) else x for x in leaves]
    staged: dict[int, _HostLeaf] = {}
    pool = _pool()
    for units in buckets:
      jobs = []
      for k, layer in units:
        if k not in staged:
          staged[k] = _HostLeaf(srcs[k], self._shardings[k])
        jobs += [pool.submit(np.copyto, d, s) for d, s in staged[k].copy_tasks(layer)]
      for job in jobs:
        job.result()
      arrays = tuple(staged[k].array(layer) for k, layer in units)
      for (k, layer), a in zip(units, arrays):
        if layer is None:
          out[k] = a
      yield units, arrays
    for k, leaf in staged.items():
      if out[k] is None:  # a stacked leaf, filled layer by layer: adopt the whole buffer at the end
        out[k] = leaf.array(None)
      leaf.release()

  def _device_buckets(self, leaves: list[jax.Array], buckets, out: list) -> Iterator[tuple[list, tuple]]:
    """Device transport: per bucket, slice/cast on the trainer mesh, `device_put`, insert layer slices."""
    stacked = sorted({k for b in buckets for k, l in b if l is not None})
    if stacked:
      alloc = _allocator(tuple((leaves[k].shape, self._out_dtype(leaves[k])) for k in stacked),
                         tuple(self._shardings[k] for k in stacked))
      for k, buf in zip(stacked, alloc()):
        out[k] = buf
    for units in buckets:
      xs = tuple(leaves[k] for k, _ in units)
      is_st = tuple(l is not None for _, l in units)
      dts = tuple(self._out_dtype(x) for x in xs)
      if any(x.dtype != dt for x, dt in zip(xs, dts)) or any(is_st):
        xs = _extract(xs, tuple(np.int32(l or 0) for _, l in units), dts, is_st)
      targets = tuple(NamedSharding(self._shardings[k].mesh, P(*self._shardings[k].spec[1:])) if l is not None
                      else self._shardings[k] for k, l in units)
      # Never alias: the trainer donates its parameters to the next step, and on a colocated
      # (same-sharding) push device_put would otherwise hand the sampler those very buffers.
      arrays = tuple(jax.device_put(xs, targets, may_alias=False))
      _insert_units(out, units, arrays, donate=True)
      yield units, arrays
