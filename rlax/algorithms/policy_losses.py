"""Per-token policy-gradient losses: PPO/DAPO clip, GSPO, CISPO, REINFORCE.

Every loss takes per-token arrays [B, T] (current log-probs `logp`, which carry
the gradient; `old_logp` of the policy the ratio is taken against; a 0/1 `mask`)
and advantages [B] (one per sequence) or [B, T] (per token). It returns the
per-token loss [B, T] (to minimize; 0 where mask is 0) and an info dict with
the ratio and a 0/1 `clipped` indicator, both [B, T]. Aggregation over tokens
is separate (`aggregation.py`) so any loss combines with any aggregation.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlax.algorithms.segments import Segments

Info = dict[str, jax.Array]


def _check(logp, old_logp, advantages, mask) -> tuple[jax.Array, jax.Array]:
  chex.assert_rank([logp, old_logp, mask], 2)
  chex.assert_equal_shape([logp, old_logp, mask])
  chex.assert_rank(advantages, {1, 2})
  if advantages.ndim == 1:
    chex.assert_axis_dimension(advantages, 0, logp.shape[0])
    advantages = advantages[:, None]
  else:
    chex.assert_equal_shape([advantages, logp])
  return advantages.astype(jnp.float32), mask.astype(jnp.float32)


def _clip_surrogate(ratio, adv, eps_low, eps_high, dual_clip):
  """max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), optionally capped at -c A for A < 0."""
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(unclipped, clipped)
  was_clipped = clipped > unclipped
  if dual_clip is not None:
    cap = -adv * dual_clip
    dual = (adv < 0) & (loss > cap)
    loss = jnp.where(dual, cap, loss)
    was_clipped = was_clipped | dual
  return loss, was_clipped


def ppo_loss(logp: Float[Array, "B T"], old_logp: Float[Array, "B T"], advantages: Float[Array, "B *T"],
             mask: Float[Array, "B T"], *, eps_low: float = 0.2, eps_high: float = 0.2,
             dual_clip: Optional[float] = None) -> tuple[Float[Array, "B T"], Info]:
  """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), per token.

  r = exp(logp - old_logp); loss = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).
  eps_low != eps_high is DAPO's decoupled "clip-higher" (Yu et al. 2025, arXiv
  2503.14476). `dual_clip` = c > 1 caps the loss at -c A for A < 0 (Ye et al.
  2020, arXiv 1912.09729), bounding updates from very large ratios.
  """
  adv, m = _check(logp, old_logp, advantages, mask)
  ratio = jnp.exp(logp - old_logp)
  loss, clipped = _clip_surrogate(ratio, adv, eps_low, eps_high, dual_clip)
  return loss * m, {"ratio": ratio, "clipped": clipped.astype(jnp.float32) * m}


def gspo_loss(logp: Float[Array, "B T"], old_logp: Float[Array, "B T"], advantages: Float[Array, "B"],
              mask: Float[Array, "B T"], *, eps_low: float = 3e-4, eps_high: float = 4e-4,
              segments: Segments = Segments()) -> tuple[Float[Array, "B T"], Info]:
  """GSPO (Zheng et al. 2025, arXiv 2507.18071), token form with a sequence-level ratio.

  s_i = exp((1/|y_i|) sum_t mask (logp - old_logp)) is the length-normalized
  sequence ratio; each token uses s_it = sg(s_i) * exp(logp_t - sg(logp_t)),
  whose value is s_i and whose gradient is s_i * grad logp_t, in the clipped
  surrogate max(-A s_it, -A clip(s_it, 1-eps_low, 1+eps_high)). With
  seq-mean-token-mean aggregation this is exactly GSPO's objective. A packed batch (`segments` packed) gives
  each sequence's advantage on its slots, [R, T].
  """
  chex.assert_rank(advantages, 2 if segments.packed else 1)
  adv, m = _check(logp, old_logp, advantages, mask)
  n = jnp.maximum(segments.sum(m), 1.0)
  log_s = segments.sum((logp - old_logp) * m) / n
  s = segments.spread(jax.lax.stop_gradient(jnp.exp(log_s)), m) * jnp.exp(logp - jax.lax.stop_gradient(logp))
  loss, clipped = _clip_surrogate(s, adv, eps_low, eps_high, None)
  return loss * m, {"ratio": s, "clipped": clipped.astype(jnp.float32) * m}


def cispo_loss(logp: Float[Array, "B T"], old_logp: Float[Array, "B T"], advantages: Float[Array, "B *T"],
               mask: Float[Array, "B T"], *, eps_low: float = 1.0, eps_high: float = 0.28
               ) -> tuple[Float[Array, "B T"], Info]:
  """CISPO (MiniMax-M1, arXiv 2506.13585): loss = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp.

  The IS weight is clipped and detached, so every token keeps a gradient (unlike
  PPO, which zeroes clipped tokens). eps_low = 1 leaves the weight unbounded
  below, as in the paper.
  """
  adv, m = _check(logp, old_logp, advantages, mask)
  ratio = jnp.exp(logp - old_logp)
  w = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  clipped = (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)
  return -w * adv * logp * m, {"ratio": ratio, "clipped": clipped.astype(jnp.float32) * m}


def reinforce_loss(logp: Float[Array, "B T"], old_logp: Float[Array, "B T"], advantages: Float[Array, "B *T"],
                   mask: Float[Array, "B T"]) -> tuple[Float[Array, "B T"], Info]:
  """REINFORCE (Williams 1992): loss = -A * logp per token; no ratio (old_logp only feeds the metric)."""
  adv, m = _check(logp, old_logp, advantages, mask)
  ratio = jnp.exp(logp - old_logp)
  return -adv * logp * m, {"ratio": ratio, "clipped": jnp.zeros_like(m)}


POLICY_LOSSES = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss, "reinforce": reinforce_loss}
