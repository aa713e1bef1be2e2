"""Advantage estimators against hand-computed values, with and without jit."""

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from rlax import algorithms as A

# Two groups of 4: a mixed one and an all-equal one (no signal -> advantage 0).
REWARDS = jnp.array([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])


class GroupAdvantagesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo(self):
    adv = self.variant(A.grpo_advantages, static_argnums=(1, 2))(REWARDS, 4, 1e-6)
    # Group 1: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6).
    s = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(adv, [s, -s, s, -s, 0, 0, 0, 0], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_all_equal_non_representable_group_is_exactly_zero(self):
    # Eight 0.1s: the f32 mean is not exactly 0.1, which must not become an O(1) advantage.
    adv = self.variant(A.grpo_advantages, static_argnums=(1,))(jnp.full((8,), 0.1), 8)
    np.testing.assert_array_equal(adv, np.zeros(8))

  @chex.variants(with_jit=True, without_jit=True)
  def test_dr_grpo(self):
    adv = self.variant(A.dr_grpo_advantages, static_argnums=(1,))(jnp.array([3.0, 1.0, 2.0, 5.0, 5.0, 5.0]), 3)
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0, 0.0, 0.0])

  @chex.variants(with_jit=True, without_jit=True)
  def test_rloo(self):
    adv = self.variant(A.rloo_advantages, static_argnums=(1,))(jnp.array([3.0, 1.0, 2.0, 4.0, 4.0, 4.0]), 3)
    # 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0.
    np.testing.assert_allclose(adv, [1.5, -1.5, 0.0, 0.0, 0.0, 0.0])

  def test_rloo_needs_two_samples(self):
    with self.assertRaisesRegex(ValueError, "group_size >= 2"):
      A.rloo_advantages(REWARDS, 1)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reinforce_pp_global_normalization(self):
    r = jnp.array([1.0, 2.0, 3.0, 6.0])
    adv = self.variant(A.reinforce_pp_advantages, static_argnums=(1, 2))(r, None, 0.0)
    centred = np.array([-2.0, -1.0, 0.0, 3.0])
    np.testing.assert_allclose(adv, centred / np.sqrt(np.mean(centred ** 2)), rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reinforce_pp_baseline_then_batch_norm(self):
    r = jnp.array([1.0, 3.0, 10.0, 10.0])
    adv = self.variant(A.reinforce_pp_advantages, static_argnums=(1, 2))(r, 2, 0.0)
    # Group means 2 and 10 -> [-1, 1, 0, 0]; batch mean 0, std sqrt(0.5).
    np.testing.assert_allclose(adv, np.array([-1.0, 1.0, 0.0, 0.0]) / np.sqrt(0.5), rtol=1e-6)
    flat = A.reinforce_pp_advantages(jnp.full((4,), 0.3), 2)
    np.testing.assert_array_equal(flat, np.zeros(4))

  def test_bad_group_size(self):
    with self.assertRaisesRegex(ValueError, "not a whole number of groups of 3"):
      A.grpo_advantages(REWARDS, 3)


class GaeTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_against_hand_computed(self):
    gamma, lam = 0.9, 0.5
    # Row 0: 3 response tokens then padding; row 1: a masked-out middle token (skipped).
    r = jnp.array([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0]])
    v = jnp.array([[0.5, 0.4, 0.3, 9.0], [0.2, 9.0, 0.1, 0.0]])
    m = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    adv, ret = self.variant(A.gae_advantages, static_argnums=(3, 4))(r, v, m, gamma, lam)
    d2 = 1.0 - 0.3
    d1 = 0.0 + gamma * 0.3 - 0.4
    d0 = 0.0 + gamma * 0.4 - 0.5
    a2, a1 = d2, d1 + gamma * lam * d2
    a0 = d0 + gamma * lam * a1
    e2 = 2.0 - 0.1
    e0 = 0.0 + gamma * 0.1 - 0.2 + gamma * lam * e2
    np.testing.assert_allclose(adv, [[a0, a1, a2, 0.0], [e0, 0.0, e2, 0.0]], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret, (np.asarray(adv) + np.asarray(v)) * np.asarray(m), rtol=1e-6)

  def test_gamma_one_lambda_one_is_reward_to_go_minus_value(self):
    r = jnp.array([[1.0, 2.0, 3.0]])
    v = jnp.array([[0.5, 0.5, 0.5]])
    adv, _ = A.gae_advantages(r, v, jnp.ones((1, 3)), 1.0, 1.0)
    np.testing.assert_allclose(adv, [[6.0 - 0.5, 5.0 - 0.5, 3.0 - 0.5]], rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
