"""The transformer block's math, written once.

The full forward (training, log-probs), the cached forward (sampler prefill and
refill) and the sampler's decode step all apply `block`; they differ only in
the `attend` callback: which keys and values a query sees, and where new ones
are written. `w` is one layer's weights, either a slice of the parameter tree's
"layers" (what training differentiates and shards) or the same weights `fuse`d
(q|k|v and gate|up concatenated along the output axis: one matmul each, which
the decode step uses). Training keeps them apart: concatenating weights whose
head axes are sharded would reshard them every step.

Shapes: B batch, T positions in, Tq = T - q_start positions queried, D d_model,
H query heads, K KV heads, Dh head dim, F mlp. The MLP is the second variation,
`mlp`: dense SwiGLU, or routed experts (rlax.models.moe) for a MoE config.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from rlax.models import moe
from rlax.models.linear import dense, dense_group  # re-exported: the blocks' matmuls
from rlax.models.config import ModelConfig
from rlax.models.sharding import constrain

NEG = -1e30  # additive mask bias: exp underflows to exactly 0 in f32, and no inf - inf NaNs

# attend(q [B, Tq, H, Dh], k [B, T, K, Dh], v [B, T, K, Dh]) -> [B, Tq, H, Dh]
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# mlp(w, h [B, T, D]) -> [B, T, D]
Mlp = Callable[[dict, jax.Array], jax.Array]


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [Dh/2], with Llama 3 scaling when configured (computed on the host)."""
  dh = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
  rs = cfg.rope_scaling
  if rs is None:
    return inv.astype(np.float32)
  low_wl = rs.original_max_position / rs.low_freq_factor
  high_wl = rs.original_max_position / rs.high_freq_factor
  wl = 2 * math.pi / inv
  scaled = np.where(wl > low_wl, inv / rs.factor, inv)
  smooth = (rs.original_max_position / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = (wl >= high_wl) & (wl <= low_wl)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(positions: Int[Array, "B T"], inv_freq) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, T, 1, Dh/2] of the rotary angles, f32: computed once per forward or decode step and shared
  by every layer (XLA:CPU would otherwise evaluate the trigonometry again in each layer's fusions)."""
  ang = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B,T,Dh/2]
  return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def apply_rope(x: Float[Array, "B T N Dh"], cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotary embedding, HF 'rotate_half' convention, with the tables `rope` gives; computed in f32."""
  cos, sin = cos_sin
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """RMSNorm as in HF Llama: normalize in f32, cast back, then scale."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w.astype(x.dtype) * xf.astype(x.dtype)


def _recomputed(fn: Callable) -> Callable:
  """`fn` whose outputs the backward pass recomputes from its inputs instead of keeping: for the largest
  activations that are cheap to make again, the attention probabilities ([rows, heads, T, S] f32; one QK^T
  matmul per layer) and the MLP's gated product (elementwise). On the SmolLM2 run's packed step this cut
  XLA:CPU's temporaries from 3.73 to 2.83 GiB. Inference is unchanged (nothing is differentiated)."""
  return jax.checkpoint(fn)


def attention(q: Float[Array, "B T H Dh"], k: Float[Array, "B S K Dh"], v: Float[Array, "B S K Dh"],
              mask: Bool[Array, "B T S"]) -> Float[Array, "B T H Dh"]:
  """Grouped-query attention; softmax in f32. Fully masked rows give zeros-weighted uniform output.

  The G = H/K query heads sharing a KV head are stacked along the query axis, so
  each (row, KV head) pair is one [G*T, Dh] @ [Dh, S] matmul, and the mask is an
  additive bias: on XLA:CPU this is ~1.6x faster, forward and backward, than a
  5-D einsum with a select.
  """
  B, T, H, Dh = q.shape
  K = k.shape[2]
  G = H // K
  qh = q.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, Dh)
  bias = jnp.where(mask, 0.0, NEG).astype(jnp.float32)

  @_recomputed
  def probs(qh, k, bias):
    s = jnp.einsum("bkqd,bskd->bkqs", qh, k, preferred_element_type=jnp.float32) / math.sqrt(Dh)
    s = s + jnp.tile(bias, (1, G, 1))[:, None]
    return jax.nn.softmax(s, axis=-1).astype(v.dtype)

  p = probs(qh, k, bias)
  o = jnp.einsum("bkqs,bskd->bkqd", p, v)
  return o.reshape(B, K, G, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)




def fuse(cfg: ModelConfig, w: dict[str, Any]) -> dict[str, Any]:
  """One layer's weights in compute dtype, with q|k|v ([D, (H+2K)*Dh]) and gate|up ([D, 2F]) concatenated."""
  D = cfg.d_model
  out = {name: a.astype(cfg.jnp_dtype) for name, a in w.items()
         if name not in ("q", "k", "v", "q_bias", "k_bias", "v_bias", "gate", "up")}
  out["qkv"] = jnp.concatenate([w[n].reshape(D, -1) for n in ("q", "k", "v")], axis=1).astype(cfg.jnp_dtype)
  if "gate" in w:  # a dense MLP (routed experts stay apart: each token reads only its own)
    out["gate_up"] = jnp.concatenate([w["gate"], w["up"]], axis=1).astype(cfg.jnp_dtype)
  if cfg.qkv_bias:
    out["qkv_bias"] = jnp.concatenate([w[n].reshape(-1) for n in ("q_bias", "k_bias", "v_bias")]
                                      ).astype(cfg.jnp_dtype)
  return out


def _project_qkv(cfg: ModelConfig, w, h, q_start: int):
  """q [B, Tq, H, Dh] from positions q_start.., k and v [B, T, K, Dh] from all positions (before RoPE)."""
  H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  if "qkv" in w:  # fused: the decode step's T = 1, so no query is computed in vain
    y = dense(h, w["qkv"])
    if cfg.qkv_bias:
      y = y + w["qkv_bias"]
    q, k, v = jnp.split(y, [H * Dh, (H + K) * Dh], axis=-1)
    lead = h.shape[:-1]
    return (q[:, q_start:].reshape(lead[0], -1, H, Dh), k.reshape(*lead, K, Dh), v.reshape(*lead, K, Dh))
  if q_start:
    q, (k, v) = dense(h[:, q_start:], w["q"]), dense_group(h, [w["k"], w["v"]])
  else:
    q, k, v = dense_group(h, [w["q"], w["k"], w["v"]])
  if cfg.qkv_bias:
    q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
  return q, k, v


def _mlp_in(w, h):
  """silu(h @ gate) * (h @ up), fused or not."""
  if "gate_up" in w:
    gu = dense(h, w["gate_up"])
    g, u = jnp.split(gu, 2, axis=-1)
  else:
    g, u = dense_group(h, [w["gate"], w["up"]])
  return _recomputed(lambda g, u: jax.nn.silu(g) * u)(g, u)


def swiglu(w: dict[str, Any], h: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
  """The dense MLP: (silu(h @ gate) * (h @ up)) @ down."""
  m = constrain(_mlp_in(w, h), ("batch", "act_seq", "act_mlp"))
  return dense(m, w["down"])


def default_mlp(cfg: ModelConfig) -> Mlp:
  """The MLP a layer of `cfg` applies when the caller has no routes to replay or record: SwiGLU, or the routed
  experts (rlax.models.moe) choosing their own."""
  if cfg.moe is None:
    return swiglu
  return lambda w, h: moe.routed(cfg, w, h)[0]


def block(cfg: ModelConfig, w: dict[str, Any], x: Float[Array, "B T D"], cos_sin: tuple[jax.Array, jax.Array],
          attend: Attend, q_start: int = 0, mlp: Optional[Mlp] = None) -> Float[Array, "B Tq D"]:
  """One pre-norm block: x + attention, then + MLP. cos_sin: `rope(positions, inv_freq)` of all T positions.

  RoPE'd q (positions q_start..), k and v (all positions) go to `attend`, which
  returns the attention output; it may also write k, v into a cache and attend
  over that instead. q_start > 0: only positions q_start.. are queried and
  carried on (their keys and values still come from every position). `mlp(w, h)`
  is the MLP (default: `default_mlp(cfg)`); a MoE caller passes one that replays
  or records the routes.
  """
  dt = cfg.jnp_dtype
  w = jax.tree.map(lambda a: a.astype(dt), w)
  h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
  q, k, v = _project_qkv(cfg, w, h, q_start)
  if cfg.qk_norm:
    q = rms_norm(q, w["q_norm"], cfg.norm_eps)
    k = rms_norm(k, w["k_norm"], cfg.norm_eps)
  q_rope = (cos_sin[0][:, q_start:], cos_sin[1][:, q_start:]) if q_start else cos_sin
  q = constrain(apply_rope(q, q_rope), ("batch", "act_seq", "act_heads", None))
  k = apply_rope(k, cos_sin)
  x = x[:, q_start:] + dense(attend(q, k, v), w["o"], n_in=2)
  x = constrain(x, ("batch", "act_seq", "act_embed"))
  h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
  x = x + (mlp or default_mlp(cfg))(w, h)
  return constrain(x, ("batch", "act_seq", "act_embed"))
