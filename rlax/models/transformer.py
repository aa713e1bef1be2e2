"""Decoder-only transformer (Llama 3 / Qwen2 / Qwen3, dense or mixture-of-experts): parameters, KV cache
and the forward pass.

Parameters are one nested dict with a leading layer axis on every per-layer
weight, so the same tree serves the NNX module (`rlax.models.nnx_model`), optax,
orbax, the parameter server and `lax.scan` over layers. The block's math is in
`rlax.models.layers`. Shapes: B batch, T new tokens, S cache slots, D d_model,
H query heads, K KV heads, Dh head dim, F mlp, V vocab, L layers.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rlax.models.config import ModelConfig
from rlax.models import moe
from rlax.models.layers import attention, block, rms_norm, rope, rope_inv_freq
from rlax.models.sharding import constrain

Params = dict[str, Any]


def param_axes(cfg: ModelConfig) -> Params:
  """Logical axis names of every parameter, in the same tree as `init_params`."""
  layers = {
      "attn_norm": ("layers", "norm"),
      "q": ("layers", "embed", "heads", "head_dim"),
      "k": ("layers", "embed", "kv_heads", "head_dim"),
      "v": ("layers", "embed", "kv_heads", "head_dim"),
      "o": ("layers", "heads", "head_dim", "embed"),
      "mlp_norm": ("layers", "norm"),
      "gate": ("layers", "embed", "mlp"),
      "up": ("layers", "embed", "mlp"),
      "down": ("layers", "mlp", "embed"),
  }
  if cfg.moe is not None:
    for n in ("gate", "up", "down"):
      del layers[n]
    layers.update(router=("layers", "embed", None), experts_gate=("layers", "experts", "embed", "expert_mlp"),
                  experts_up=("layers", "experts", "embed", "expert_mlp"),
                  experts_down=("layers", "experts", "expert_mlp", "embed"))
    if cfg.moe.shared_mlp_dim:
      layers.update(shared_gate=("layers", "embed", "mlp"), shared_up=("layers", "embed", "mlp"),
                    shared_down=("layers", "mlp", "embed"), shared_router=("layers", "embed", None))
  if cfg.qkv_bias:
    layers.update(q_bias=("layers", "heads", "head_dim"), k_bias=("layers", "kv_heads", "head_dim"),
                  v_bias=("layers", "kv_heads", "head_dim"))
  if cfg.qk_norm:
    layers.update(q_norm=("layers", "head_dim"), k_norm=("layers", "head_dim"))
  axes = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("norm",)}
  if not cfg.tie_embeddings:
    axes["lm_head"] = ("embed", "vocab")
  return axes


def param_shapes(cfg: ModelConfig) -> Params:
  """Shapes of every parameter, in the same tree as `init_params`."""
  L, D, H, K, Dh, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                          cfg.mlp_dim, cfg.vocab_size)
  layers = {"attn_norm": (L, D), "q": (L, D, H, Dh), "k": (L, D, K, Dh), "v": (L, D, K, Dh),
            "o": (L, H, Dh, D), "mlp_norm": (L, D), "gate": (L, D, F), "up": (L, D, F),
            "down": (L, F, D)}
  m = cfg.moe
  if m is not None:
    for n in ("gate", "up", "down"):
      del layers[n]
    E, Fe, Fs = m.n_experts, m.expert_mlp_dim, m.shared_mlp_dim
    layers.update(router=(L, D, E), experts_gate=(L, E, D, Fe), experts_up=(L, E, D, Fe),
                  experts_down=(L, E, Fe, D))
    if Fs:
      layers.update(shared_gate=(L, D, Fs), shared_up=(L, D, Fs), shared_down=(L, Fs, D), shared_router=(L, D, 1))
  if cfg.qkv_bias:
    layers.update(q_bias=(L, H, Dh), k_bias=(L, K, Dh), v_bias=(L, K, Dh))
  if cfg.qk_norm:
    layers.update(q_norm=(L, Dh), k_norm=(L, Dh))
  shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """Random init (normal, std 0.02; norms at 1, biases at 0). Jit it with out_shardings to init sharded."""
  shapes = param_shapes(cfg)
  flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))
  keys = jax.random.split(key, len(flat))
  dtype = cfg.jnp_param_dtype
  out = []
  for (path, shape), k in zip(flat, keys):
    name = path[-1].key
    if name.endswith("norm"):
      out.append(jnp.ones(shape, dtype))
    elif name.endswith("bias"):
      out.append(jnp.zeros(shape, dtype))
    else:
      out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
  return jax.tree.unflatten(treedef, out)


@flax.struct.dataclass
class KVCache:
  """Keys/values for all layers plus which slots hold valid tokens.

  k, v: [L, B, S, K, Dh]; valid: [B, S]; index: [] next slot to write (shared by
  all rows: prompts are left-padded so that their last tokens align).
  """
  k: jax.Array
  v: jax.Array
  valid: jax.Array
  index: jax.Array

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  dtype = dtype or cfg.jnp_dtype
  shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 valid=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32))


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> int:
  dtype = jnp.dtype(dtype or cfg.jnp_dtype)
  return 2 * cfg.n_layers * batch * max_len * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize


def _run_layers(cfg, params, x, body, carry_extra, last_body=None):
  """Applies `body(x, layer_params, extra, l) -> (x, extra)` over layers, scanned or unrolled.

  last_body, if given, replaces `body` for the last layer (applied outside the scan).
  """
  layers = params["layers"]
  n = cfg.n_layers - (last_body is not None)
  if cfg.remat:
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable, static_argnums=())
    if last_body is not None:
      last_body = jax.checkpoint(last_body, policy=jax.checkpoint_policies.nothing_saveable, static_argnums=())
  if cfg.scan_layers and n > 0:
    def step(c, xs):
      lp, l = xs
      x, extra = body(c[0], lp, c[1], l)
      return (x, extra), None
    head = jax.tree.map(lambda w: w[:n], layers) if n < cfg.n_layers else layers
    (x, carry_extra), _ = jax.lax.scan(step, (x, carry_extra), (head, jnp.arange(n)))
  else:
    for l in range(n):
      x, carry_extra = body(x, jax.tree.map(lambda w: w[l], layers), carry_extra, l)
  if last_body is not None:
    l = cfg.n_layers - 1
    x, carry_extra = last_body(x, jax.tree.map(lambda w: w[l], layers), carry_extra, l)
  return x, carry_extra


def hidden_states(params: Params, cfg: ModelConfig, tokens: Int[Array, "B T"], *,
                  positions: Optional[Int[Array, "B T"]] = None,
                  input_mask: Optional[Bool[Array, "B T"]] = None,
                  cache: Optional[KVCache] = None, start: int = 0,
                  segment_ids: Optional[Int[Array, "B T"]] = None, parents: Optional[Int[Array, "B T"]] = None,
                  routes: Optional[Int[Array, "B T L k"]] = None, router_stats: bool = False
                  ) -> tuple:
  """Final-normed hidden states, and the updated cache when one is given (None without), and with
  `router_stats` (a MoE model, no cache) a third item: the layers' mean rlax.models.moe.RouterStats over the
  valid tokens (input_mask, nonzero segment_ids; the last layer's from position `start` on).

  Without a cache, token t attends to tokens s ≤ t with input_mask[s]. A packed row (rlax.rollout.packing)
  gives `segment_ids` (0: padding) and `parents`: token t attends to tokens s ≤ t of its own segment or
  of segment parents[t] (a prompt shared by several responses), with explicit `positions`. With a
  cache, the T tokens are written at slots [index, index+T) and attend to every
  valid slot up to their own. start > 0 (no cache): only positions start.. are
  returned ([B, T-start, D]); the last layer then skips the query, output and
  MLP work of the earlier positions, which only serve as its keys and values.
  `routes` (a MoE model, no cache): token t goes to experts routes[b, t, l] in layer l (routing replay), its
  weights from this forward's own router over them (rlax.models.moe.route).
  """
  B, T = tokens.shape
  if not 0 <= start < T or (start and cache is not None):
    raise ValueError(f"hidden_states: start={start} must be in [0, {T}) and 0 with a cache")
  if (routes is not None or router_stats) and (cfg.moe is None or cache is not None):
    raise ValueError("hidden_states: routes and router_stats are a MoE model's, in a forward without a cache")
  if input_mask is None:
    input_mask = jnp.ones((B, T), bool)
  if positions is None:
    # Position = number of valid tokens before this one (cached ones included).
    seen = 0 if cache is None else jnp.sum(cache.valid, axis=1, keepdims=True)
    positions = jnp.maximum(seen + jnp.cumsum(input_mask, axis=1) - 1, 0).astype(jnp.int32)
  cos_sin = rope(positions, rope_inv_freq(cfg))
  x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.jnp_dtype)
  x = constrain(x, ("batch", "act_seq", "act_embed"))

  if cache is None:
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = causal[None] & input_mask[:, None, :]
    if segment_ids is not None:
      kv = segment_ids[:, None, :]
      own = segment_ids[:, :, None]
      par = own if parents is None else parents[:, :, None]
      mask = mask & (kv > 0) & ((kv == own) | (kv == par))

    valid = input_mask if segment_ids is None else input_mask & (segment_ids > 0)

    def body(x, lp, stats, l, q_start=0):
      attend = lambda q, k, v: attention(q, k, v, mask[:, q_start:])
      mlp, seen = None, []
      if routes is not None or router_stats:
        def mlp(w, h):
          replay = None if routes is None else jnp.take(routes[:, q_start:], l, axis=2)
          out, logits, chosen = moe.routed(cfg, w, h, experts=replay)
          if router_stats:
            seen.append(moe.router_stats(logits.reshape(-1, logits.shape[-1]),
                                         chosen.reshape(-1, chosen.shape[-1]),
                                         valid[:, q_start:].reshape(-1).astype(jnp.float32)))
          return out
      x = block(cfg, lp, x, cos_sin, attend, q_start, mlp=mlp)
      return x, (jax.tree.map(jnp.add, stats, seen[0]) if router_stats else stats)

    last = functools.partial(body, q_start=start) if start else None
    zero = jnp.zeros((), jnp.float32)
    x, stats = _run_layers(cfg, params, x, body, moe.RouterStats(zero, zero) if router_stats else (), last)
    new_cache = None
  else:
    S = cache.max_len
    idx = cache.index
    valid = jax.lax.dynamic_update_slice(cache.valid, input_mask, (0, idx))
    q_slot = idx + jnp.arange(T)
    mask = valid[:, None, :] & (jnp.arange(S)[None, None, :] <= q_slot[None, :, None])

    def body(x, lp, kv, l):
      ck, cv = kv

      def attend(q, k, v):
        nonlocal ck, cv
        z = jnp.zeros((), jnp.int32)
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], (l, z, idx, z, z))
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], (l, z, idx, z, z))
        return attention(q, ck[l].astype(cfg.jnp_dtype), cv[l].astype(cfg.jnp_dtype), mask)

      x = block(cfg, lp, x, cos_sin, attend)
      return x, (ck, cv)

    x, (ck, cv) = _run_layers(cfg, params, x, body, (cache.k, cache.v))
    new_cache = KVCache(k=ck, v=cv, valid=valid, index=idx + T)
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  if router_stats:
    return x, new_cache, jax.tree.map(lambda a: a / cfg.n_layers, stats)
  return x, new_cache


def lm_head(params: Params, cfg: ModelConfig) -> Float[Array, "D V"]:
  w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  return w.astype(cfg.jnp_dtype)


def logits_from_hidden(params: Params, cfg: ModelConfig, h: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
  """Logits in f32 (accumulated in f32 even for bf16 compute)."""
  out = jnp.einsum("btd,dv->btv", h, lm_head(params, cfg), preferred_element_type=jnp.float32)
  return constrain(out, ("batch", "act_seq", "act_vocab"))


def forward(params: Params, cfg: ModelConfig, tokens: Int[Array, "B T"], **kw
            ) -> tuple[Float[Array, "B T V"], Optional[KVCache]]:
  """Full logits [B, T, V] (f32) and the updated cache. Use `token_logprobs` for long sequences."""
  h, cache = hidden_states(params, cfg, tokens, **kw)
  return logits_from_hidden(params, cfg, h), cache
