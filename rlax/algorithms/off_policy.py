"""Off-policy correction for stale or numerically-mismatched rollouts: truncated and masked IS.

Rollouts come from the sampler's behaviour policy mu (log-probs recorded while
sampling, possibly from an older weight version and different numerics); the
trainer's PPO ratio is taken against its own "old" policy pi_old (its log-probs
recomputed at the start of the step). The correction weight w = pi_old / mu
multiplies the per-token loss (detached):
  TIS (truncated IS; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
       training", fengyao.notion.site/off-policy-rl; Espeholt et al. 2018 IMPALA): w' = min(w, C).
  MIS (masked IS; Liu et al. 2025, "When speed kills stability", yingru.notion.site):
       w' = w if w <= C else 0 — tokens (or whole sequences) too far off-policy are dropped.
Token level uses w_t = exp(old_t - mu_t); sequence level uses one weight per
row, w = exp(sum_t mask (old_t - mu_t)), broadcast to its tokens.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlax.algorithms.segments import Segments

IS_MODES = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq")
# Sequence log-ratios are sums over many tokens: clamp before exp to stay finite.
_MAX_LOG_W = 30.0


def importance_weights(old_logp: Float[Array, "B T"], behaviour_logp: Float[Array, "B T"],
                       mask: Float[Array, "B T"], mode: str, cap: float = 2.0,
                       segments: Segments = Segments()) -> tuple[Float[Array, "B T"], dict[str, jax.Array]]:
  """Detached correction weights [B, T] for `mode` in IS_MODES, and their statistics.

  Returns (weights, stats) where stats has the raw ratio's masked mean/max/min
  and the fraction of (token or sequence) weights truncated or masked, with its numerator and denominator
  (`is_over`, `is_units`: sums over micro-batches give the batch's fraction). Weights are 0 where mask is
  0; mode "none" gives the mask itself (weight 1). `segments`: which sequence each slot is.
  """
  chex.assert_rank([old_logp, behaviour_logp, mask], 2)
  chex.assert_equal_shape([old_logp, behaviour_logp, mask])
  if mode not in IS_MODES:
    raise ValueError(f"unknown importance-sampling mode {mode!r}; known: {', '.join(IS_MODES)}")
  m = mask.astype(jnp.float32)
  log_w = jax.lax.stop_gradient(old_logp - behaviour_logp) * m
  if mode.endswith("_seq"):
    w_seq = jnp.exp(jnp.clip(segments.sum(log_w), -_MAX_LOG_W, _MAX_LOG_W))
    w = segments.spread(w_seq, m)
    unit = (segments.sum(m) > 0).astype(jnp.float32)  # each non-empty sequence once
    over_units = (w_seq > cap).astype(jnp.float32) * unit
  else:
    w = jnp.exp(jnp.clip(log_w, -_MAX_LOG_W, _MAX_LOG_W))
    unit = m
    over_units = (w > cap).astype(jnp.float32) * m
  over = (w > cap).astype(jnp.float32)
  if mode.startswith("tis"):
    out = jnp.minimum(w, cap)
  elif mode.startswith("mis"):
    out = w * (1.0 - over)
  else:
    out = jnp.ones_like(w)
    over_units = jnp.zeros_like(unit)
  n_units = jnp.maximum(jnp.sum(unit), 1.0)
  stats = {
      "is_ratio_mean": jnp.sum(w * m) / jnp.maximum(jnp.sum(m), 1.0),
      "is_ratio_max": jnp.max(jnp.where(m > 0, w, -jnp.inf)),
      "is_ratio_min": jnp.min(jnp.where(m > 0, w, jnp.inf)),
      "is_frac_truncated": jnp.sum(over_units) / n_units,
      "is_over": jnp.sum(over_units), "is_units": jnp.sum(unit),
  }
  return out * m, stats
