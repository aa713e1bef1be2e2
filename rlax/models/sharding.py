"""Logical axis names → mesh axes: the one rules table for parameters and activations.

Every parameter and key activation carries logical names ('embed', 'heads', ...).
`RULES` maps each to mesh axes of a mesh with axes ('data', 'fsdp', 'tensor').
A mesh axis is dropped from a dimension when it does not divide it (e.g. 2 KV
heads on a 4-way tensor axis), so small models still run on big meshes.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Grouped as in MaxText: batch-like, weight dims, activation dims.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # batch-like
    ("batch", ("data", "fsdp")),
    # weights
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("experts", ("fsdp",)),  # expert parallelism (rlax.models.expert_parallel)
    ("expert_mlp", ("tensor",)),
    ("head_dim", ()),
    ("layers", ()),
    ("norm", ()),
    # activations
    ("act_seq", ()),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
    ("cache_seq", ()),
)


def make_mesh(devices: Sequence[jax.Device], *, data: int = 1, fsdp: int = -1, tensor: int = 1) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over `devices`; one size may be -1 (inferred)."""
  devs = list(devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError("at most one mesh axis size may be -1")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devs) % known:
      raise ValueError(f"{len(devs)} devices do not divide into mesh axes {sizes}")
    sizes[sizes.index(-1)] = len(devs) // known
  if int(np.prod(sizes)) != len(devs):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, got {len(devs)}")
  return Mesh(np.asarray(devs, dtype=object).reshape(sizes), MESH_AXES)


def spec_for(logical: Sequence[str | None], shape: Sequence[int], mesh_shape: dict[str, int],
             rules=RULES) -> P:
  """PartitionSpec for one array from its logical names, skipping non-dividing mesh axes."""
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name, dim in zip(logical, shape):
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no rule; add it to rlax.models.sharding.RULES")
    axes = []
    size = 1
    for ax in table[name]:
      n = mesh_shape.get(ax, 1)
      if n == 1 or ax in used or dim % (size * n):
        continue
      axes.append(ax)
      size *= n
    used.update(axes)
    out.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
  return P(*out)


def batch_sharding(mesh: Mesh, rows: int, ndim: int = 1) -> NamedSharding:
  """Sharding of a [rows, ...] array whose first dimension is the logical 'batch' axis (`RULES`).

  The one place that decides how rows split: the trainer's batch, the sampler's
  rows and the micro-batch / prefill row counts all derive from it.
  """
  return NamedSharding(mesh, spec_for(("batch",) + (None,) * (ndim - 1), (rows,) + (1,) * (ndim - 1),
                                      dict(mesh.shape)))


def row_shards(mesh: Mesh | None, rows: int) -> int:
  """How many ways `batch_sharding(mesh, rows)` splits the rows (1 without a mesh)."""
  if mesh is None:
    return 1
  return entry_size(dict(mesh.shape), batch_sharding(mesh, rows).spec[0])


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, an axis name, or a tuple of them)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def entry_size(mesh_shape: dict[str, int], entry) -> int:
  """How many ways one PartitionSpec entry splits its dimension on a mesh of `mesh_shape`."""
  return int(np.prod([mesh_shape[a] for a in entry_axes(entry)], dtype=np.int64))


def tree_shardings(shapes: Any, axes: Any, mesh: Mesh, rules=RULES) -> Any:
  """NamedShardings for a tree of arrays/ShapeDtypeStructs given a matching tree of logical names."""
  mesh_shape = dict(mesh.shape)
  return jax.tree.map(lambda x, a: NamedSharding(mesh, spec_for(a, x.shape, mesh_shape, rules)),
                      shapes, axes)


def constrain(x: jax.Array, logical: Sequence[str | None], rules=RULES) -> jax.Array:
  """Sharding constraint on an activation under the ambient mesh (`jax.set_mesh`); no-op without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  spec = spec_for(logical, x.shape, dict(mesh.shape), rules)
  return jax.lax.with_sharding_constraint(x, spec)
