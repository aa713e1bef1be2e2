"""KL to a reference policy (k1/k2/k3), entropy, and PPO's clipped value loss; all per token [B, T].

The KL estimators follow Schulman, "Approximating KL divergence" (2020,
joschu.net/blog/kl-approx.html), with samples y ~ pi (the policy) and
log-ratio d = log pi(y) - log pi_ref(y):
  k1 = d                      (unbiased, high variance, can be negative)
  k2 = d^2 / 2                (biased, low variance; its gradient is the KL's gradient)
  k3 = exp(-d) - 1 + d        (unbiased, always >= 0; GRPO's penalty)
Use them as a loss term (`aggregate(kl_estimate(...))`, GRPO) or subtracted
from the reward (`kl_penalized_rewards`, one sum per sequence; REINFORCE++ and PPO penalize per token,
see `advantages.reinforce_pp_advantages` and `rlax.trainer.critic`).
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlax.algorithms.segments import Segments

KL_ESTIMATORS = ("k1", "k2", "k3")
# exp(-d) overflows f32 near d = -88; a ±20 clamp only touches pathological tokens.
_MAX_LOG_RATIO = 20.0


def kl_estimate(logp: Float[Array, "B T"], ref_logp: Float[Array, "B T"], kind: str = "k3"
                ) -> Float[Array, "B T"]:
  """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (k1, k2 or k3; see module doc)."""
  chex.assert_rank([logp, ref_logp], 2)
  chex.assert_equal_shape([logp, ref_logp])
  d = logp - ref_logp
  if kind == "k1":
    return d
  if kind == "k2":
    return 0.5 * d * d
  if kind == "k3":
    d = jnp.clip(d, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.exp(-d) - 1.0 + d
  raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")


def kl_penalized_rewards(rewards: Float[Array, "B"], logp: Float[Array, "B T"], ref_logp: Float[Array, "B T"],
                         mask: Float[Array, "B T"], beta: float, kind: str = "k1",
                         segments: Segments = Segments()) -> Float[Array, "B"]:
  """Reward shaping r_i - beta * sum_t mask * k(logp, ref_logp) (Ouyang et al. 2022, arXiv 2203.02155).

  Pass the old policy's detached log-probs: the penalty is a reward, not a gradient path. [B] -> [B]
  (`segments`: which sequence each slot is, for a packed batch).
  """
  chex.assert_rank(rewards, 1)
  if not segments.packed:
    chex.assert_axis_dimension(logp, 0, rewards.shape[0])
  kl = kl_estimate(logp, ref_logp, kind) * mask.astype(jnp.float32)
  return rewards.astype(jnp.float32) - beta * segments.sum(kl)


def clipped_value_loss(values: Float[Array, "B T"], old_values: Float[Array, "B T"],
                       returns: Float[Array, "B T"], mask: Float[Array, "B T"], clip_eps: float = 0.2
                       ) -> Float[Array, "B T"]:
  """PPO value loss with clipping (Schulman et al. 2017; as in OpenAI baselines), per token.

  0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2), 0 where mask is 0.
  """
  chex.assert_rank([values, old_values, returns, mask], 2)
  chex.assert_equal_shape([values, old_values, returns, mask])
  v_clip = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
  loss = 0.5 * jnp.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
  return loss * mask.astype(jnp.float32)


def entropy_bonus(entropy: Float[Array, "B T"], mask: Float[Array, "B T"], coef: float) -> Float[Array, "B T"]:
  """Per-token entropy term to add to the loss: -coef * H_t (minimizing it raises entropy), 0 where masked."""
  chex.assert_equal_shape([entropy, mask])
  return -coef * entropy * mask.astype(jnp.float32)
