"""REINFORCE++ (Hu et al. 2025, arXiv 2501.03262) against an independent float64 numpy implementation.

The reference follows the paper's formulas directly: A_t = r - beta * sum_{i>=t} KL_i on each response
token (eq. 4), then (A - mean) / std over every response token of the batch (sec. 3.2).
"""

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from rlax import algorithms as A


def reference(r, mask, kl, beta, group_size=None, eps=1e-6):
  """Float64, loop by loop: the paper's KL-to-go advantage, then token-level batch normalization."""
  r = np.asarray(r, np.float64).copy()
  mask = np.asarray(mask, np.float64)
  kl = np.zeros_like(mask) if kl is None else np.asarray(kl, np.float64)
  if group_size:
    for p in range(0, len(r), group_size):
      r[p:p + group_size] -= r[p:p + group_size].mean()
  adv = np.zeros_like(mask)
  values = []
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t]:
        to_go = sum(kl[b, i] for i in range(t, mask.shape[1]) if mask[b, i])
        adv[b, t] = r[b] - beta * to_go
        values.append(adv[b, t])
  values = np.asarray(values)
  mean, std = values.mean(), values.std()  # population std, as the paper's batch statistics
  return np.where(mask > 0, (adv - mean) / (std + eps), 0.0)


# Four responses of different lengths (the 4th is one token), right-padded, after a 2-slot prompt.
MASK = np.array([[0, 1, 1, 1, 1, 1],
                 [0, 1, 1, 0, 0, 0],
                 [0, 1, 1, 1, 1, 0],
                 [0, 1, 0, 0, 0, 0]], np.float32)
KL = np.random.default_rng(0).uniform(-0.2, 0.6, MASK.shape).astype(np.float32)
R = np.array([1.0, 0.0, 1.0, 0.0], np.float32)


class ReinforcePPTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_kl_to_go_and_token_level_normalization(self):
    fn = self.variant(lambda r, m, kl: A.reinforce_pp_advantages(r, None, 1e-6, mask=m, kl=kl, beta=0.5))
    got = fn(jnp.asarray(R), jnp.asarray(MASK), jnp.asarray(KL))
    np.testing.assert_allclose(got, reference(R, MASK, KL, 0.5), rtol=1e-5, atol=1e-5)
    # Only scored tokens carry an advantage.
    np.testing.assert_array_equal(np.asarray(got)[MASK == 0], 0.0)

  def test_without_kl_long_responses_weigh_more(self):
    # No KL: A_t = r on every token, but the statistics count tokens, not sequences (5 + 4 tokens of
    # reward 1 against 2 + 1 of reward 0): mean 0.75, std sqrt(3)/4.
    got = A.reinforce_pp_advantages(jnp.asarray(R), mask=jnp.asarray(MASK))
    want = np.where(MASK > 0, (R[:, None] - 0.75) / (np.sqrt(3) / 4 + 1e-6), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got, reference(R, MASK, None, 0.0), rtol=1e-5)

  def test_baseline_variant_subtracts_group_mean_first(self):
    r = np.array([1.0, 0.0, 3.0, 1.0], np.float32)
    got = A.reinforce_pp_advantages(jnp.asarray(r), 2, mask=jnp.asarray(MASK), kl=jnp.asarray(KL), beta=0.1)
    np.testing.assert_allclose(got, reference(r, MASK, KL, 0.1, group_size=2), rtol=1e-5, atol=1e-5)
    with self.assertRaisesRegex(ValueError, "group_size >= 2"):
      A.reinforce_pp_advantages(jnp.asarray(r), 1)

  def test_all_equal_is_exactly_zero(self):
    got = A.reinforce_pp_advantages(jnp.full((4,), 0.1), mask=jnp.asarray(MASK))
    np.testing.assert_array_equal(got, np.zeros(MASK.shape))

  def test_registry_plain_reinforce_pp_learns_with_one_sample_per_prompt(self):
    # The registry always passes group_size; plain REINFORCE++ must not subtract a group mean of one sample.
    r = jnp.array([1.0, 0.0, 0.0, 1.0])
    got = A.get_algorithm("reinforce_pp").advantages(r, 1)
    np.testing.assert_allclose(got, [1.0, -1.0, -1.0, 1.0], rtol=1e-5)
    per_token = A.get_algorithm("reinforce_pp", kl_coef=0.5).advantages(
        jnp.asarray(R), 1, mask=jnp.asarray(MASK), kl=jnp.asarray(KL))
    np.testing.assert_allclose(per_token, reference(R, MASK, KL, 0.5), rtol=1e-5, atol=1e-5)
    base = A.get_algorithm("reinforce_pp_baseline")
    # Group means 0.5 and 3 -> [0.5, -0.5, 0, 0]; batch mean 0, std sqrt(0.125).
    s = np.sqrt(2.0)
    np.testing.assert_allclose(base.advantages(jnp.array([1.0, 0.0, 3.0, 3.0]), 2), [s, -s, 0, 0], rtol=1e-5)
    with self.assertRaisesRegex(ValueError, "takes sequence rewards"):
      A.get_algorithm("grpo").advantages(jnp.asarray(R), 2, mask=jnp.asarray(MASK), kl=jnp.asarray(KL))


if __name__ == "__main__":
  absltest.main()
