"""The plan's weight-sync rows: what one trainer → sampler push carries (the weights, or with LoRA the
adapters), its bandwidth model, and LoRA's merge of the adapters into the sampler's pristine base."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from rlax import config as config_lib
from rlax import models
from rlax.models import lora as lora_lib
from rlax.models import variation
from rlax.multihost import transport_spec
from rlax.sampler import Sampler, sizing


def _with(shapes: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)


def push_target(c: config_lib.RunConfig, sampler: Sampler) -> Any:
  """ShapeDtypeStructs (on the sampler's shardings) of what a push delivers: the weights in the compute
  dtype, or LoRA's adapters (f32, as the runtime's AdapterTransport sends them)."""
  return variation.of(c.model, c.lora).pushed(sampler.abstract_params(), sampler.mesh)


def pristine_base(c: config_lib.RunConfig, mesh) -> Any:
  """LoRA: the sampler's pristine copy of the base (sent once), in the compute dtype on its parameter shardings."""
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, c.model.jnp_dtype), models.init.abstract_params(c.model))
  return _with(shapes, models.param_shardings(c.model, mesh))


def pristine_bytes(c: config_lib.RunConfig, mesh) -> int:
  """Bytes per sampler chip of LoRA's pristine base (`pristine_base`)."""
  return sizing.tree_bytes(pristine_base(c, mesh))


def lower_merge(c: config_lib.RunConfig, sampler: Sampler) -> jax.stages.Lowered:
  """LoRA's per-version merge on the sampler, as the runtime jits it (lora.merge_to onto the sampler's shardings)."""
  out = jax.tree.map(lambda x: x.sharding, sampler.abstract_params())
  fn = jax.jit(lambda b, a: lora_lib.merge_to(b, a, c.lora, c.model.jnp_dtype), out_shardings=out)
  return fn.lower(pristine_base(c, sampler.mesh), push_target(c, sampler))


def push_estimate(target: Any, chip, cross_dcn: bool) -> dict[str, float]:
  """Bandwidth model of one trainer → sampler push of `target` (CrossMeshPush's three phases, no overlap).

  transport: trainer chips reshard to unique 1/n pieces over ICI; cross: each piece crosses once, over DCN
  when the roles sit on different slices (else ICI); gather: sampler chips all-gather their own shards
  over ICI. Bytes are in the target's dtype.
  """
  dst = jax.tree.leaves(target)
  mesh = dst[0].sharding.mesh
  total = sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in dst)
  tr = [NamedSharding(mesh, transport_spec(s.shape, dict(mesh.shape), s.sharding.spec)) for s in dst]
  piece = sizing.tree_bytes(dst, tr)
  shard = sizing.tree_bytes(dst)
  link = chip.dcn_bw if cross_dcn else chip.ici_bw
  t = dict(transport_s=piece / chip.ici_bw, cross_s=piece / link, gather_s=max(shard - piece, 0) / chip.ici_bw)
  return dict(total_bytes=total, per_chip_transport_bytes=piece, per_chip_sampler_bytes=shard,
              link="dcn" if cross_dcn else "ici", seconds=sum(t.values()), **t)


def estimates(c: config_lib.RunConfig, sampler: Sampler, chip, cross_dcn: bool) -> dict[str, Any]:
  """The push estimate; with LoRA also the base's one-time push and the pristine copy's bytes per sampler chip."""
  out = dict(push=push_estimate(push_target(c, sampler), chip, cross_dcn))
  if variation.of(c.model, c.lora).frozen_base:
    full = push_estimate(pristine_base(c, sampler.mesh), chip, cross_dcn)
    out.update(push_base_once=full, lora=dict(
        rank=c.lora.rank, targets=list(c.lora.targets),
        adapter_params=lora_lib.count(lora_lib.abstract(c.model, c.lora)),
        push_share_of_full=out["push"]["total_bytes"] / full["total_bytes"],
        sampler_pristine_bytes_per_chip=full["per_chip_sampler_bytes"]))  # the base's shards
  return out
