"""Versioned weights moved trainer → sampler by device-to-device resharding, optionally in buckets.

The target layout is read from the sampler's own shardings (a pytree of `Sharding`s matching the
parameter tree), as Tunix's reshard.py does. A push casts to the sampler dtype *on the trainer mesh*
first (a jitted cast there, so fewer bytes cross), then `jax.device_put`s onto the target shardings:
`jit(..., out_shardings=<other mesh>)` fails across disjoint meshes, and nothing goes through host
memory. Buckets (one per layer of the stacked 'layers' axis, or packed to a byte budget) let a sync
interleave with decoding: `push_iter` yields each bucket after dispatching it, the sampler may swap
buckets into its live weights between decode chunks (`apply_bucket`), and the complete new version
is published when the iterator is exhausted. Works for any pytree of arrays.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Iterator, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MODES = ("whole", "per_layer", "bytes")
# Traces of the source-side slice/cast program: a per-layer sync must not retrace per layer.
TRACE_COUNTS: collections.Counter = collections.Counter()


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

  def as_dict(self) -> dict[str, float]:
    """Flat metrics for a logger (`sync/seconds`, `sync/gb_per_s`, ...)."""
    return {f"sync/{k}": float(v) for k, v in dataclasses.asdict(self).items() if k != "mode"}


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
  """

  def __init__(self, sampler_shardings: Any, sampler_dtype: Any = None, bucket_bytes: int | None = None,
               mode: str | None = None, layer_key: str = "layers"):
    mode = mode or ("bytes" if bucket_bytes else "whole")
    if mode not in MODES:
      raise ValueError(f"ParameterServer mode={mode!r}; expected one of {MODES}")
    if mode == "bytes" and not (bucket_bytes and bucket_bytes > 0):
      raise ValueError(f"mode='bytes' needs a positive bucket_bytes, got {bucket_bytes}")
    self._shardings, self._treedef = jax.tree.flatten(sampler_shardings)
    self._paths = [_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(sampler_shardings)[0]]
    self.dtype = None if sampler_dtype is None else jnp.dtype(sampler_dtype)
    self.mode, self.bucket_bytes, self.layer_key = mode, bucket_bytes, layer_key
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

  def _transfer(self, leaves: list[jax.Array], version: int) -> Iterator[Bucket]:
    jax.block_until_ready(leaves)  # time the sync, not the train step that produced the weights
    t0 = time.perf_counter()
    buckets = self._plan(leaves)
    out: list[Any] = [None] * len(leaves)
    stacked = sorted({k for b in buckets for k, l in b if l is not None})
    if stacked:
      alloc = _allocator(tuple((leaves[k].shape, self._out_dtype(leaves[k])) for k in stacked),
                         tuple(self._shardings[k] for k in stacked))
      for k, buf in zip(stacked, alloc()):
        out[k] = buf
    total = 0
    for b_index, units in enumerate(buckets):
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
      nbytes = sum(a.nbytes for a in arrays)
      total += nbytes
      _insert_units(out, units, arrays, donate=True)
      yield Bucket(b_index, version, tuple(units), arrays, nbytes)
    params = jax.tree.unflatten(self._treedef, out)
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    self._params, self._version = params, version
    src = sum(x.nbytes for x in leaves)
    self.last_stats = SyncStats(version, dt, total, src, total / dt / 1e9, len(buckets), self.mode)
    logging.info("param sync v%d: %.3fs, %.1f MB, %.2f GB/s, %d buckets (%s)", version, dt, total / 1e6,
                 self.last_stats.gb_per_s, len(buckets), self.mode)
