"""The weights as the sampler uses them: in the compute dtype (`cfg.dtype`) on the sampler mesh's shardings,
and fused for decoding.

The weights service's reshard casts on the trainer side (fewer bytes cross) and delivers exactly this layout;
`Placer` makes it from anything else a user hands over (float32 params, another mesh). The sampler holds no
weights itself: it reads them from its `WeightsService`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Optional

import jax
from jax.sharding import Mesh

from rlax import models
from rlax.models import layers
from rlax.models.init import abstract_params as model_params


def shardings(cfg: models.ModelConfig, mesh: Optional[Mesh]):
  """The sampler's parameter shardings (None without a mesh)."""
  return models.param_shardings(cfg, mesh) if mesh is not None else None


def abstract(cfg: models.ModelConfig, mesh: Optional[Mesh] = None) -> models.Params:
  """ShapeDtypeStructs of the weights as the sampler holds them (compute dtype, its shardings)."""
  sds = lambda s, sh=None: jax.ShapeDtypeStruct(s.shape, cfg.jnp_dtype, sharding=sh)
  if mesh is None:
    return jax.tree.map(sds, model_params(cfg))
  return jax.tree.map(sds, model_params(cfg), shardings(cfg, mesh))


def validate(cfg: models.ModelConfig, params: models.Params) -> None:
  """Raises one ValueError naming the first leaf whose tree position, shape or dtype does not fit `cfg`."""
  want = models.param_shapes(cfg)
  is_shape = lambda s: isinstance(s, tuple)
  if jax.tree.structure(params) != jax.tree.structure(want, is_leaf=is_shape):
    raise ValueError("update_weights: parameter tree does not match the sampler's model config")
  ok = {cfg.jnp_dtype, cfg.jnp_param_dtype}
  for (path, x), shape in zip(jax.tree.flatten_with_path(params)[0], jax.tree.leaves(want, is_leaf=is_shape)):
    if tuple(x.shape) != tuple(shape) or x.dtype not in ok:
      raise ValueError(f"update_weights: {jax.tree_util.keystr(path)} is {x.dtype}{list(x.shape)}, expected "
                       f"{' or '.join(sorted({cfg.dtype, cfg.param_dtype}))}{list(shape)}")


class Placer:
  """params (any mesh, param or compute dtype) → the sampler's layout; leaves already there are kept as is."""

  def __init__(self, cfg: models.ModelConfig, mesh: Optional[Mesh]):
    self.cfg, self.mesh, self.shardings = cfg, mesh, shardings(cfg, mesh)
    cast = lambda p: jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), p)
    self._cast = jax.jit(cast, out_shardings=self.shardings) if mesh is not None else jax.jit(cast)

  def __call__(self, params: models.Params) -> models.Params:
    validate(self.cfg, params)
    if self.mesh is not None:
      params = jax.device_put(params, self.shardings)
    if any(x.dtype != self.cfg.jnp_dtype for x in jax.tree.leaves(params)):
      with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
        params = self._cast(params)
    return params


def fused_layout(cfg: models.ModelConfig, layout, platform: str) -> tuple[bool, bool]:
  """(stacked, joined) of the weights the sampler's programs read (`fuse`): the layers stay stacked when every
  program scans them (the model scans its layers and the cache `layout` rides in a scan's carry; unrolled
  programs want separate per-layer buffers); q|k|v and gate|up are joined on CPU. Read by the engine and the
  memory estimate."""
  return bool(cfg.scan_layers and layout.scans), platform == "cpu"


def fuse(params: models.Params, cfg: models.ModelConfig, *, stacked: bool, concat: bool = True) -> dict:
  """Every sampler program's weights: every layer `layers.fuse`d when `concat` (q|k|v and gate|up: one matmul
  each, what XLA:CPU wants; on TPU a step reads the same bytes either way, so it keeps the stored weights), as
  one stacked tree (stacked=True, for a scan over layers) or a list of per-layer trees; plus embed, final norm
  and lm head in the compute dtype. The sampler makes them once per weights version (`Sampler.fused`)."""
  return assemble(params, made(params, cfg, stacked=stacked, concat=concat))


def made(params: models.Params, cfg: models.ModelConfig, *, stacked: bool, concat: bool) -> dict:
  """The leaves of `fuse` computed anew (the sampler's compiled `fuse` program); the rest pass through as stored
  (`assemble`), never copied: the embedding, a stored lm head, the stacked layers when nothing is joined."""
  out = {"final_norm": params["final_norm"].astype(cfg.jnp_dtype)}
  if cfg.tie_embeddings or params["lm_head"].dtype != cfg.jnp_dtype:
    out["lm_head"] = models.lm_head(params, cfg)
  if concat or not stacked:
    lay = jax.vmap(lambda w: layers.fuse(cfg, w))(params["layers"]) if concat else params["layers"]
    out["layers"] = lay if stacked else [jax.tree.map(lambda w, l=l: w[l], lay) for l in range(cfg.n_layers)]
  return out


def assemble(params: models.Params, made_leaves: dict) -> dict:
  """`fuse`'s tree from `made`'s leaves and the stored ones it passes through."""
  return {"layers": params["layers"], "lm_head": params.get("lm_head"), **made_leaves, "embed": params["embed"]}


class Fused:
  """Every program's weights (`fuse`), made once per weights version: made inside every call they cost a copy
  of the weights per decode chunk and admission (~0.25 s for SmolLM2 on 2 CPU cores, more than a decode step),
  which made short chunks dear. `fused(params)` makes them on first use of these params and keeps them until
  other params come or `release()` (weak references: a version the weights service dropped is not kept
  alive). jit: the engine's (it counts traces); ctx: its mesh context."""

  def __init__(self, cfg: models.ModelConfig, jit, *, stacked: bool, joined: bool, ctx):
    self._make = jit("fuse", functools.partial(made, cfg=cfg, stacked=stacked, concat=joined))
    self._ctx, self._held, self._abstract = ctx, ((), None), None

  def __call__(self, params: models.Params) -> dict:
    refs, fused = self._held
    leaves = jax.tree.leaves(params)
    if len(refs) != len(leaves) or any(r() is not x for r, x in zip(refs, leaves)):
      self.release()  # the old copy goes before the new one is made
      with self._ctx():
        fused = assemble(params, self._make(params))
      self._held = (tuple(weakref.ref(x) for x in leaves), fused)
    return fused

  def release(self) -> None:
    self._held = ((), None)

  def lower(self, abstract_params) -> jax.stages.Lowered:
    with self._ctx():
      return self._make.lower(abstract_params)

  def abstract(self, abstract_params) -> dict:
    """ShapeDtypeStructs of the output, with the shardings the compiled program gives them."""
    if self._abstract is None:
      lowered = self.lower(abstract_params)
      out = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh), lowered.out_info,
                         lowered.compile().output_shardings)
      self._abstract = assemble(abstract_params, out)
    return self._abstract
