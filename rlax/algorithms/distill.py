"""On-policy distillation's learning signal: the per-token reverse KL to a teacher, as an advantage.

The student samples y ~ pi_s; the teacher scores every sampled token. With d_t = log pi_s(y_t) - log pi_t(y_t)
(the sampler's log-prob: the distribution that drew the token), sum_t d_t is an unbiased estimate of
KL(pi_s || pi_t) of the sequence, and advantage A_t = -coef * d_t pushes each token towards the teacher
(Agarwal et al. 2024, GKD; Thinking Machines, "On-Policy Distillation", 2025). The policy loss, its clip and
the importance correction between sampler and trainer are the RL objective's (rlax.trainer.objective).
Optionally a dense term beside it: the forward KL over the teacher's top-k tokens at each sampled prefix
(`top_k_forward_kl`), which also teaches the tokens the student did not sample.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# A token the teacher finds (numerically) impossible would give an unbounded advantage.
_MAX_LOG_RATIO = 20.0


def reverse_kl_advantages(behaviour_logp: Float[Array, "B T"], teacher_logp: Float[Array, "B T"],
                          mask: Float[Array, "B T"], coef: float) -> Float[Array, "B T"]:
  """Per-token A_t = -coef * clip(log pi_s(y_t) - log pi_t(y_t), +-20) on scored slots (`mask` 1), 0 elsewhere.
  Any per-slot layout: [B, T-1] padded rows or [R, K] packed slots."""
  chex.assert_equal_shape([behaviour_logp, teacher_logp, mask])
  d = jnp.clip(behaviour_logp.astype(jnp.float32) - teacher_logp.astype(jnp.float32), -_MAX_LOG_RATIO,
               _MAX_LOG_RATIO)
  return jnp.where(mask > 0, -coef * d, 0.0)


def mean_reverse_kl(behaviour_logp: Float[Array, "B T"], teacher_logp: Float[Array, "B T"],
                    mask: Float[Array, "B T"]) -> Float[Array, ""]:
  """The batch's reverse KL to the teacher per scored token, as sampled (the `teacher_kl` metric)."""
  m = mask.astype(jnp.float32)
  return jnp.sum((behaviour_logp - teacher_logp) * m) / jnp.maximum(jnp.sum(m), 1.0)


def top_k_forward_kl(teacher_top_logp: Float[Array, "B T k"], student_logp: Float[Array, "B T k"]
                     ) -> Float[Array, "B T"]:
  """Per-slot KL(q || pi_s) over the teacher's k most likely tokens, q the teacher renormalized over them:
  sum_v q(v) (log q(v) - log pi_s(v)), pi_s the student's full-vocabulary log-probs of those tokens. It is >= 0
  (the student's mass on the k tokens is at most 1) and 0 only where the student puts all its mass there in
  the teacher's proportions. Its gradient is the cross-entropy's, -sum_v q(v) grad log pi_s(v) (Agarwal et al.
  2024, GKD's forward divergence). Unmasked: the caller multiplies by its loss mask."""
  q_log = jax.nn.log_softmax(teacher_top_logp.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.exp(q_log) * (q_log - student_logp.astype(jnp.float32)), axis=-1)
