"""`Transformer`: the Flax NNX way to build and apply the model. Its state *is* the parameter tree.

    model = Transformer(cfg, rngs=nnx.Rngs(0), mesh=mesh)    # initialized straight into its shardings
    logits, _ = model(tokens)                                  # M.forward(model.params, cfg, tokens)
    logp = model.token_logprobs(tokens)                        # M.token_logprobs(model.params, cfg, tokens)
    model = Transformer.from_params(cfg, hf.load_checkpoint(path, mesh=mesh)[1])

Every `nnx.Param` holds one array of the pure tree that `M.create_params` and
`hf.load_checkpoint` return and the trainer, sampler, parameter server and
orbax pass around (`model.params` gives it back, the same arrays, no copy), and
carries its logical axes as `logical_axes` metadata. So `nnx.jit`,
`nnx.grad` and `nnx.Optimizer(model, tx, wrt=nnx.Param)` work on the module,
and anything written for the pure functions works on `model.params`; the
module adds no math of its own.
"""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float, Int

from rlax.models import init, logprobs, transformer
from rlax.models.config import ModelConfig

_is_axes = lambda a: isinstance(a, tuple)  # leaves of param_axes / param_shapes


def _param(x, axes: tuple, sharding) -> nnx.Param:
  """A Param over `x` tagged with its logical axes and, for a NamedSharding, its mesh sharding."""
  # The sharding metadata is what gives `nnx.eval_shape` models sharded abstract state (a restore target) and
  # what `nnx.get_named_sharding` reads. No eager sharding: x is laid out already, re-laying it would copy it.
  meta = dict(out_sharding=tuple(sharding.spec), mesh=sharding.mesh) if isinstance(sharding, NamedSharding) else {}
  return nnx.Param(x, logical_axes=axes, eager_sharding=False, **meta)


class _Layers(nnx.Module):
  """The stacked per-layer weights ([L, ...] each), one Param per name."""

  def __init__(self, values: dict, axes: dict, shardings: dict):
    for name, v in values.items():
      setattr(self, name, _param(v, axes[name], shardings[name]))


class Transformer(nnx.Module):
  """Decoder-only transformer (Llama 3 / Qwen2 / Qwen3) as an NNX module over `rlax.models` pure functions.

  Transformer(cfg, rngs=nnx.Rngs(0)) initializes like `M.create_params(cfg, seed=rngs.params())`; with a
  `mesh`, straight into the logical-axis rules' shardings (no unsharded copy). Under `nnx.eval_shape` it
  allocates nothing: an abstract model whose state, shardings included, is an orbax restore target.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
    self.cfg = cfg
    params = init.create_params(cfg, mesh, seed=rngs.params())
    axes = transformer.param_axes(cfg)
    shardings = init.param_shardings(cfg, mesh) if mesh is not None else jax.tree.map(lambda _: None, axes,
                                                                                    is_leaf=_is_axes)
    self.embed = _param(params["embed"], axes["embed"], shardings["embed"])
    self.layers = _Layers(params["layers"], axes["layers"], shardings["layers"])
    self.final_norm = _param(params["final_norm"], axes["final_norm"], shardings["final_norm"])
    if not cfg.tie_embeddings:
      self.lm_head = _param(params["lm_head"], axes["lm_head"], shardings["lm_head"])

  @classmethod
  def from_params(cls, cfg: ModelConfig, params: transformer.Params) -> "Transformer":
    """Wraps an existing parameter tree: its arrays, as they are sharded; nothing is copied or initialized."""
    want = transformer.param_shapes(cfg)
    if jax.tree.structure(params) != jax.tree.structure(want, is_leaf=_is_axes):
      raise ValueError(f"Transformer.from_params: parameter tree does not match the config; expected "
                       f"{jax.tree.structure(want, is_leaf=_is_axes)}")
    for (path, x), shape in zip(jax.tree.flatten_with_path(params)[0], jax.tree.leaves(want, is_leaf=_is_axes)):
      if tuple(x.shape) != tuple(shape):
        raise ValueError(f"Transformer.from_params: {jax.tree_util.keystr(path)} has shape {list(x.shape)}, "
                         f"expected {list(shape)}")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params, lambda var, x: _param(x, var.logical_axes, getattr(x, "sharding", None)))
    return nnx.merge(graphdef, state)

  @property
  def params(self) -> transformer.Params:
    """The pure parameter tree (nested dicts of the module's own arrays)."""
    return nnx.to_pure_dict(nnx.state(self, nnx.Param))

  def __call__(self, tokens: Int[Array, "B T"], **kw) -> tuple[Float[Array, "B T V"], Optional[transformer.KVCache]]:
    """`M.forward`: f32 logits [B, T, V] and the updated cache (keywords as there)."""
    return transformer.forward(self.params, self.cfg, tokens, **kw)

  def token_logprobs(self, tokens: Int[Array, "B T"], **kw):
    """`M.token_logprobs`: [B, T-1] log-prob of each next token, chunked (keywords as there)."""
    return logprobs.token_logprobs(self.params, self.cfg, tokens, **kw)
