"""The sampler's model math: one multi-token forward (prefill, recompute, extension) and one decode step, both
applying `rlax.models.layers.block` with their own `attend`.

`forward` runs T new tokens per row at their own indices (RoPE positions) over an optional past (a row's
cached keys and values): a prefill has no past; an extension has the row's cache. It returns the new tokens'
keys and values, for the layout to write, and the logits after each row's last new token.

`decode_step` feeds one token per slot at its index and lets the cache layout (`rlax.sampler.layouts`) write
its key/value and attend; the layers are unrolled, or scanned when the layout carries its cache through a
scan (`layout.scans`) and the model scans its layers.

Shapes: A rows, T new tokens, Tp past entries, S slots, L layers, K KV heads, Dh head dim, V vocab.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rlax import models
from rlax.models import layers, moe


def _layers(cfg: models.ModelConfig, lay, x, carry, body, scan: bool):
  """x, carry through body(x, w, carry, l) -> (x, carry, out) for every layer: scanned or unrolled; the
  per-layer outs stacked [L, ...]."""
  if scan:
    def step(c, xs):
      x, carry, out = body(c[0], xs[0], c[1], xs[1])
      return (x, carry), out
    (x, carry), outs = jax.lax.scan(step, (x, carry), (lay, jnp.arange(cfg.n_layers, dtype=jnp.int32)))
    return x, carry, outs
  outs = []
  for l in range(cfg.n_layers):
    w = lay[l] if isinstance(lay, list) else jax.tree.map(lambda a, l=l: a[l], lay)
    x, carry, out = body(x, w, carry, l)
    outs.append(out)
  return x, carry, jax.tree.map(lambda *o: jnp.stack(o), *outs) if outs[0] is not None else None


def forward(fused: dict, cfg: models.ModelConfig, tokens: Int[Array, "A T"], start: Int[Array, "A"],
            count: Int[Array, "A"], past: Optional[tuple] = None
            ) -> tuple[Float[Array, "A V"], Float[Array, "L A T K Dh"], Float[Array, "L A T K Dh"],
                       Optional[Int[Array, "L A T k"]]]:
  """Token j < count[a] of row a sits at index start[a] + j and attends over the valid past entries and the
  row's new tokens up to itself. past: (k, v [L, A, Tp, K, Dh], valid [A, Tp]) or None. fused: the weights as
  `rlax.sampler.params.fuse` lays them out; stacked ones are scanned when the model scans its layers.

  Returns the f32 logits after token count[a] - 1, the new tokens' keys / values (after RoPE), and for a MoE
  model the experts each new token went to in each layer (what the trainer replays), else None.
  """
  A, T = tokens.shape
  dt = cfg.jnp_dtype
  positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  new_ok = jnp.arange(T)[None] < count[:, None]
  mask = jnp.tril(jnp.ones((T, T), bool))[None] & new_ok[:, None, :]  # [A, T, T]
  if past is not None:
    mask = jnp.concatenate([jnp.broadcast_to(past[2][:, None, :], (A, T, past[2].shape[1])), mask], axis=2)
  cos_sin = layers.rope(positions, layers.rope_inv_freq(cfg))
  x = models.constrain(jnp.take(fused["embed"], tokens, axis=0).astype(dt), ("batch", "act_seq", "act_embed"))

  def body(x, w, carry, l):
    kv = []  # this layer's new keys and values, then (MoE) its experts

    def attend(q, k, v):
      kv.extend([k, v])
      if past is not None:
        pk = past[0][l].astype(dt)
        pv = past[1][l].astype(dt)
        k, v = jnp.concatenate([pk, k], axis=1), jnp.concatenate([pv, v], axis=1)
      return layers.attention(q, k, v, mask)

    x = layers.block(cfg, w, x, cos_sin, attend, mlp=_recording_mlp(cfg, kv))
    return x, carry, tuple(kv) + (None,) * (3 - len(kv))

  stacked = not isinstance(fused["layers"], list)
  x, _, (ks, vs, routes) = _layers(cfg, fused["layers"], x, (), body, stacked and cfg.scan_layers and past is None)
  last = jnp.take_along_axis(x, jnp.clip(count - 1, 0, T - 1)[:, None, None], axis=1)
  return _logits(fused, cfg, last[:, 0]), ks, vs, routes


def _logits(fused: dict, cfg: models.ModelConfig, x: Float[Array, "A D"]) -> Float[Array, "A V"]:
  """f32 next-token logits of the last hidden states (final norm, then the head `fused` holds)."""
  h = layers.rms_norm(x, fused["final_norm"], cfg.norm_eps)
  logits = jnp.dot(h, fused["lm_head"], preferred_element_type=jnp.float32)
  return models.constrain(logits, ("batch", "act_vocab"))


def _recording_mlp(cfg: models.ModelConfig, into: list):
  """The layer's MLP, appending the experts it chose to `into` (a MoE model); None: the block's default."""
  if cfg.moe is None:
    return None

  def mlp(w, h):
    out, _, chosen = moe.routed(cfg, w, h)
    into.append(chosen)
    return out
  return mlp


def decode_step(fused: dict, cfg: models.ModelConfig, layout, cache, tok: Int[Array, "S"], pos: Int[Array, "S"],
                n_prompt: Int[Array, "S"], live: Bool[Array, "S"], reach: int
                ) -> tuple[Float[Array, "S V"], object, Optional[Int[Array, "L S k"]]]:
  """Feeds tok[s] at index pos[s] of every slot; `layout.attend` writes its key/value (running slots only)
  and attends. fused: the weights as `rlax.sampler.params.fuse` lays them out (`Sampler.fused`).

  Returns f32 logits [S, V] for each slot's next token, the updated cache, and for a MoE model the experts
  the fed tokens went to in each layer (else None).
  """
  dt = cfg.jnp_dtype
  cos_sin = layers.rope(pos[:, None], layers.rope_inv_freq(cfg))
  x = models.constrain(jnp.take(fused["embed"], tok, axis=0).astype(dt)[:, None], ("batch", "act_seq", "act_embed"))

  def body(x, w, cache, l):
    def attend(q, k, v):
      nonlocal cache
      o, cache = layout.attend(cache, l, q[:, 0], k[:, 0], v[:, 0], pos=pos, n_prompt=n_prompt, live=live,
                               reach=reach)
      return o[:, None]

    chosen = []
    x = layers.block(cfg, w, x, cos_sin, attend, mlp=_recording_mlp(cfg, chosen))
    return x, cache, chosen[0][:, 0] if chosen else None

  x, cache, routes = _layers(cfg, fused["layers"], x, cache, body, layout.scans and cfg.scan_layers)
  return _logits(fused, cfg, x[:, 0]), cache, routes
