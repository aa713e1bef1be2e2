"""Advantage estimators: group-relative (GRPO, Dr. GRPO, RLOO), REINFORCE++ (per token) and GAE.

Group convention (one for all of rlax): `rewards` is [B] with B = P * G, laid
out as P prompt groups of G contiguous rows (rows p*G .. p*G+G-1 are the G
samples of prompt p); `group_size` is the static int G. Estimators that need a
baseline from the group reshape to [P, G]. A group whose rewards are all equal
carries no learning signal and gets advantage exactly 0 (never NaN).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlax.algorithms.segments import Segments


def _groups(rewards: Float[Array, "B"], group_size: int) -> Float[Array, "P G"]:
  chex.assert_rank(rewards, 1)
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(f"batch of {rewards.shape[0]} rewards is not a whole number of groups of {group_size}")
  return rewards.astype(jnp.float32).reshape(-1, group_size)


def _zero_if_flat(adv: Float[Array, "P G"], g: Float[Array, "P G"]) -> Float[Array, "P G"]:
  # Rounding in the mean (e.g. eight 0.1s) would leave ~1e-9 residues that the std division blows up
  # to O(1); a group with max == min gets exactly 0 instead.
  flat = jnp.max(g, axis=-1, keepdims=True) == jnp.min(g, axis=-1, keepdims=True)
  return jnp.where(flat, 0.0, adv)


def grpo_advantages(rewards: Float[Array, "B"], group_size: int, eps: float = 1e-6) -> Float[Array, "B"]:
  """GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300): A_i = (r_i - mean_g r) / (std_g r + eps).

  std is the population std (ddof 0) of the G rewards of row i's group. [B] -> [B].
  """
  g = _groups(rewards, group_size)
  mean = jnp.mean(g, axis=1, keepdims=True)
  centred = g - mean
  std = jnp.sqrt(jnp.mean(centred * centred, axis=1, keepdims=True))
  return _zero_if_flat(centred / (std + eps), g).reshape(-1)


def dr_grpo_advantages(rewards: Float[Array, "B"], group_size: int) -> Float[Array, "B"]:
  """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783): A_i = r_i - mean_g r.

  No division by the group std (which biases towards too-easy/too-hard prompts). [B] -> [B].
  """
  g = _groups(rewards, group_size)
  return _zero_if_flat(g - jnp.mean(g, axis=1, keepdims=True), g).reshape(-1)


def rloo_advantages(rewards: Float[Array, "B"], group_size: int) -> Float[Array, "B"]:
  """RLOO (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al. 2019): A_i = r_i - (1/(G-1)) sum_{j != i} r_j.

  Equivalently G/(G-1) * (r_i - mean_g r). Needs G >= 2. [B] -> [B].
  """
  if group_size < 2:
    raise ValueError(f"RLOO needs group_size >= 2 for a leave-one-out baseline, got {group_size}")
  g = _groups(rewards, group_size)
  loo = (jnp.sum(g, axis=1, keepdims=True) - g) / (group_size - 1)
  return _zero_if_flat(g - loo, g).reshape(-1)


def reinforce_pp_advantages(rewards: Float[Array, "B"], group_size: int | None = None, eps: float = 1e-6, *,
                            mask: Float[Array, "B T"] | None = None, kl: Float[Array, "B T"] | None = None,
                            beta: float = 0.0, segments: Segments = Segments()
                            ) -> Float[Array, "B"] | Float[Array, "B T"]:
  """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): per-token A_t = r - beta * sum_{i>=t} KL_i, batch-normalized.

  The KL penalty is "KL to go": token t carries the KL of itself and every later
  response token (eq. 4 of the paper), so early tokens pay for what follows. The
  advantages are then normalized by the mean and population std over **all
  scored tokens of the batch** (its section 3.2), so a long response weighs more
  than a short one. `mask` [B, T]: scored tokens (the output is 0 elsewhere);
  `kl` [B, T]: per-token KL estimate (None: no penalty). Without `mask` the
  output is [B], every sequence counted once (one token each).

  `group_size` = G >= 2 subtracts the group mean reward first (the paper's
  "REINFORCE++-baseline"); None is plain REINFORCE++. A batch whose advantages
  are all equal gives exactly 0. `segments`: which sequence each slot of `mask` is (a packed batch).
  """
  chex.assert_rank(rewards, 1)
  a = rewards.astype(jnp.float32)
  if group_size is not None:
    if group_size < 2:
      raise ValueError(f"REINFORCE++-baseline needs group_size >= 2 for a group mean, got {group_size}")
    a = dr_grpo_advantages(a, group_size)
  if mask is None:
    if kl is not None:
      raise ValueError("reinforce_pp_advantages: a per-token kl needs the mask of scored tokens")
    a, m = a[:, None], jnp.ones((a.shape[0], 1), jnp.float32)
  else:
    chex.assert_rank(mask, 2)
    if not segments.packed:
      chex.assert_axis_dimension(mask, 0, a.shape[0])
    m = mask.astype(jnp.float32)
    a = segments.spread(a, m)
    if kl is not None:
      chex.assert_equal_shape([kl, mask])
      a = a - beta * segments.reverse_cumsum(kl.astype(jnp.float32) * m)
  n = jnp.maximum(jnp.sum(m), 1.0)
  mean = jnp.sum(a * m) / n
  centred = (a - mean) * m
  std = jnp.sqrt(jnp.sum(centred * centred) / n)
  # As in _zero_if_flat: equal advantages on every scored token carry no signal; exactly 0, not rounding noise.
  hi = jnp.max(jnp.where(m > 0, a, -jnp.inf))
  lo = jnp.min(jnp.where(m > 0, a, jnp.inf))
  out = jnp.where(hi == lo, 0.0, centred / (std + eps))
  return out[:, 0] if mask is None else out


def gae_advantages(rewards: Float[Array, "B T"], values: Float[Array, "B T"], mask: Float[Array, "B T"],
                   gamma: float = 1.0, lam: float = 0.95, segments: Segments = Segments()
                   ) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
  """GAE (Schulman et al. 2016, arXiv 1506.02438) for PPO with a value model, per token.

  delta_t = r_t + gamma * V_{t'} - V_t and A_t = delta_t + gamma * lam * A_{t'},
  where t' is the next position with mask 1 (V = A = 0 past the last one), so
  padding and masked-out tokens are skipped. Returns (advantages, returns =
  advantages + values), both [B, T] and 0 where mask is 0. A packed batch (`segments`) restarts the
  recursion at each sequence's end.
  """
  chex.assert_rank([rewards, values, mask], 2)
  chex.assert_equal_shape([rewards, values, mask])
  m = mask.astype(jnp.float32)

  def step(carry, xs):
    r, v, mk, cont = xs
    next_v, next_a = carry[0] * cont, carry[1] * cont
    delta = r + gamma * next_v - v
    a = delta + gamma * lam * next_a
    # Masked positions pass the carry through unchanged.
    carry = (jnp.where(mk > 0, v, next_v), jnp.where(mk > 0, a, next_a))
    return carry, a * mk

  zeros = jnp.zeros(rewards.shape[0], jnp.float32)
  cont = jnp.broadcast_to(segments.continues(), m.shape).astype(jnp.float32)
  xs = (rewards.astype(jnp.float32).T, values.astype(jnp.float32).T, m.T, cont.T)
  _, adv = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
  adv = adv.T
  return adv, (adv + values) * m
