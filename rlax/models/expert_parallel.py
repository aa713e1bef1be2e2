"""Expert parallelism: a MoE layer's experts split over the mesh axes the rules table gives the logical axis
'experts' (rlax.models.sharding.RULES), the tokens exchanged inside a `shard_map`.

Dispatch is the all-gather kind (Megatron's "allgather" token dispatcher): within an expert-parallel group
every device gathers the group's tokens with their experts and gate weights, runs its own experts on the
tokens routed to them (a dropless grouped matmul; the others are rows past its groups, never computed by
ragged_dot), and a reduce-scatter returns each token's sum to the device that holds it. Shapes are static
and nothing is dropped; with top-k routing over E experts on an EP-way group it moves (EP - 1) / EP of the
group's activations each way, as many bytes as an all-to-all of k copies moves when k ≈ EP. The expert MLP's
width over 'tensor' is a partial sum, reduced over 'tensor'. Without a mesh, or with experts on no mesh axis,
`experts` is the local computation.

Shapes: N tokens, D d_model, E experts, k experts per token.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from rlax.models import sharding as shd


def expert_axes(mesh_shape: dict[str, int], n_experts: int) -> tuple[str, ...]:
  """The mesh axes the experts split over (the rules table's 'experts', where they divide E): the planner's
  and the forward's one answer."""
  return shd.entry_axes(shd.spec_for(("experts",), (n_experts,), mesh_shape)[0])


def experts(w: dict[str, Any], x: Float[Array, "N D"], chosen: Int[Array, "N k"], weights: Float[Array, "N k"],
            local: Callable) -> Float[Array, "N D"]:
  """Σ_j weights[:, j] · expert_{chosen[:, j]}(x): `local(w, x, chosen, weights)` on each device's experts
  under the ambient mesh's expert parallelism, or on all of them without one."""
  mesh = jax.sharding.get_abstract_mesh()
  E = w["experts_gate"].shape[0]
  ep = () if mesh.empty else expert_axes(dict(mesh.shape), E)
  if not ep:
    return local(w, x, chosen, weights)
  shape = dict(mesh.shape)
  rows = shd.entry_axes(shd.spec_for(("batch", None), x.shape, shape)[0])
  wide = lambda name: shd.spec_for(("experts", None, "expert_mlp") if name != "experts_down"
                                   else ("experts", "expert_mlp", None), w[name].shape, shape)
  mlp_axes = shd.entry_axes(wide("experts_gate")[2])  # the expert MLP's width: partial sums over these
  gather = tuple(a for a in ep if a in rows)   # tokens split over these: gathered, then scattered back
  spread = tuple(a for a in ep if a not in rows)  # tokens whole on these: each device's part, summed
  names = ("experts_gate", "experts_up", "experts_down")

  def per_device(x, chosen, weights, gate, up, down):
    if gather:
      x, chosen, weights = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, chosen, weights))
    e_local = gate.shape[0]
    first = jax.lax.axis_index(ep) * e_local
    mine = (chosen >= first) & (chosen < first + e_local)
    ids = jnp.where(mine, chosen - first, e_local)  # e_local: not this device's expert (rows past its groups)
    y = local({"experts_gate": gate, "experts_up": up, "experts_down": down}, x, ids, jnp.where(mine, weights, 0))
    if gather:
      y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
    reduce = spread + mlp_axes
    return jax.lax.psum(y, reduce) if reduce else y

  row = P(rows or None, None)
  specs = (row, row, row) + tuple(wide(nm) for nm in names)
  return jax.shard_map(per_device, in_specs=specs, out_specs=row, check_vma=False)(
      x, chosen, weights, *(w[nm] for nm in names))


def exchange_bytes(cfg, mesh_shape: dict[str, int], tokens_per_chip: int, passes: int) -> dict[str, Any]:
  """What `experts` moves per chip for `tokens_per_chip` tokens through every MoE layer `passes` times (a
  forward 1; a train step 2, 3 with remat: the backward of a gather is a scatter of the same size): the
  all-gather of the group's tokens (with their experts and gate weights) and the reduce-scatter of the
  results, each (G - 1) x tokens x row bytes for an EP group of G chips. The planner's figure."""
  ep = expert_axes(mesh_shape, cfg.moe.n_experts)
  group = shd.entry_size(mesh_shape, ep)
  row = cfg.d_model * cfg.jnp_dtype.itemsize
  per_pass = (group - 1) * tokens_per_chip * (2 * row + cfg.moe.top_k * 8)
  return dict(axes=list(ep), group=group, experts_per_chip=cfg.moe.n_experts // group,
              bytes=float(per_pass * cfg.n_layers * passes))
