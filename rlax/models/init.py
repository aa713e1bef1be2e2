"""Shape-first, sharded parameter creation: nothing is ever built unsharded."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from rlax.models import sharding, transformer
from rlax.models.config import ModelConfig


def abstract_params(cfg: ModelConfig):
  """ShapeDtypeStructs of the parameter tree (no memory allocated)."""
  return jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules=sharding.RULES):
  """NamedShardings of every parameter on `mesh` through the logical-axis rules."""
  return sharding.tree_shardings(abstract_params(cfg), transformer.param_axes(cfg), mesh, rules)


def create_params(cfg: ModelConfig, mesh: Mesh | None = None, seed: int | jax.Array = 0, rules=sharding.RULES):
  """Random parameters initialized directly into their shardings on `mesh` (or on the default device).

  seed: an int, or a PRNG key (e.g. `nnx.Rngs(0).params()`).
  """
  key = seed if isinstance(seed, jax.Array) else jax.random.key(seed)
  init = lambda k: transformer.init_params(cfg, k)
  if mesh is None:
    return jax.jit(init)(key)
  return jax.jit(init, out_shardings=param_shardings(cfg, mesh, rules))(key)
