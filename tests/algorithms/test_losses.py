"""Policy losses, aggregation, KL/entropy/value terms and IS weights against hand-computed values."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.test_util import check_grads

from rlax import algorithms as A

L = np.log


def _row(*log_ratios):
  """logp, old_logp [1, n] with logp - old = log_ratios (old fixed at -1)."""
  old = -jnp.ones((1, len(log_ratios)))
  return old + jnp.array([log_ratios], jnp.float32), old


class PolicyLossTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_ppo_clip_cases(self):
    logp, old = _row(L(1.5), L(1.5), L(0.5), L(0.5), 0.0)
    adv = jnp.array([[1.0, -1.0, -1.0, 1.0, 2.0]])
    loss, info = self.variant(A.ppo_loss)(logp, old, adv, jnp.ones((1, 5)))
    # max(-A r, -A clip(r, 0.8, 1.2)) per token.
    np.testing.assert_allclose(loss, [[-1.2, 1.5, 0.8, -0.5, -2.0]], rtol=1e-6)
    np.testing.assert_array_equal(info["clipped"], [[1, 0, 1, 0, 0]])
    np.testing.assert_allclose(info["ratio"], [[1.5, 1.5, 0.5, 0.5, 1.0]], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_dual_clip_caps_negative_advantage(self):
    logp, old = _row(L(5.0), L(5.0))
    f = lambda *a: A.ppo_loss(*a, dual_clip=3.0)
    loss, info = self.variant(f)(logp, old, jnp.array([[-1.0, 1.0]]), jnp.ones((1, 2)))
    # A<0: max(5, 1.2) = 5 capped at -c A = 3. A>0: plain clip -1.2.
    np.testing.assert_allclose(loss, [[3.0, -1.2]], rtol=1e-6)
    np.testing.assert_array_equal(info["clipped"], [[1, 1]])

  @chex.variants(with_jit=True, without_jit=True)
  def test_dapo_clip_higher(self):
    logp, old = _row(L(1.25), L(1.25))
    f = lambda *a: A.ppo_loss(*a, eps_low=0.2, eps_high=0.28)
    loss, _ = self.variant(f)(logp, old, jnp.array([1.0]), jnp.array([[1.0, 0.0]]))
    # 1.25 < 1.28: not clipped (PPO's 0.2 would clip to 1.2); the padded token contributes 0.
    np.testing.assert_allclose(loss, [[-1.25, 0.0]], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_gspo_sequence_ratio(self):
    logp, old = _row(0.2, 0.4, 5.0)
    mask = jnp.array([[1.0, 1.0, 0.0]])
    loss, info = self.variant(A.gspo_loss)(logp, old, jnp.array([-1.0]), mask)
    s = np.exp(0.3)  # length-normalized over the 2 unmasked tokens; the masked 5.0 is ignored
    np.testing.assert_allclose(info["ratio"][0, :2], [s, s], rtol=1e-6)
    # A = -1: max(s, clip(s, 1-3e-4, 1+4e-4)) = s, unclipped.
    np.testing.assert_allclose(loss, [[s, s, 0.0]], rtol=1e-6)
    loss, info = A.gspo_loss(logp, old, jnp.array([1.0]), mask)
    np.testing.assert_allclose(loss, [[-1.0004, -1.0004, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(info["clipped"], [[1, 1, 0]])

  def test_gspo_one_token_response_equals_token_ratio(self):
    logp, old = _row(L(1.1))
    loss, info = A.gspo_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 1)), eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(info["ratio"], [[1.1]], rtol=1e-6)
    np.testing.assert_allclose(loss, [[-1.1]], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_cispo(self):
    logp, old = _row(L(1.5), L(1.1))
    loss, info = self.variant(A.cispo_loss)(logp, old, jnp.array([2.0]), jnp.ones((1, 2)))
    # -sg(clip(r, 0, 1.28)) * A * logp.
    np.testing.assert_allclose(loss, -np.array([[1.28, 1.1]]) * 2.0 * np.asarray(logp), rtol=1e-6)
    np.testing.assert_array_equal(info["clipped"], [[1, 0]])
    # Unlike PPO, the clipped token keeps a gradient: -w A.
    g = jax.grad(lambda lp: jnp.sum(A.cispo_loss(lp, old, jnp.array([2.0]), jnp.ones((1, 2)))[0]))(logp)
    np.testing.assert_allclose(g, [[-2.56, -2.2]], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reinforce(self):
    logp, old = _row(0.3, -0.2)
    loss, _ = self.variant(A.reinforce_loss)(logp, old, jnp.array([[0.5, -2.0]]), jnp.array([[1.0, 1.0]]))
    np.testing.assert_allclose(loss, -np.array([[0.5, -2.0]]) * np.asarray(logp), rtol=1e-6)

  def test_zero_staleness_ratio_is_one_and_gradient_is_policy_gradient(self):
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.random((3, 5)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=3), jnp.float32)
    mask = jnp.asarray(rng.random((3, 5)) > 0.3, jnp.float32)
    _, info = A.ppo_loss(logp, logp, adv, mask)
    np.testing.assert_array_equal(info["ratio"], np.ones((3, 5)))
    for name in ("ppo", "gspo", "cispo"):
      fn = A.POLICY_LOSSES[name]
      g = jax.grad(lambda lp: A.aggregate(fn(lp, jax.lax.stop_gradient(lp), adv, mask)[0], mask,
                                          "seq_mean_token_mean"))(logp)
      pg = jax.grad(lambda lp: A.aggregate(A.reinforce_loss(lp, lp, adv, mask)[0], mask,
                                           "seq_mean_token_mean"))(logp)
      np.testing.assert_allclose(g, pg, rtol=1e-6, atol=1e-8, err_msg=name)
    # Hand form of the on-policy estimate: -A_i m_it / (|y_i| * n_seqs).
    n = np.asarray(mask).sum(1, keepdims=True)
    np.testing.assert_allclose(pg, -np.asarray(adv)[:, None] * np.asarray(mask) / n / 3, rtol=1e-6)

  @parameterized.parameters("ppo", "gspo", "reinforce")
  def test_grad_matches_finite_differences(self, name):
    rng = np.random.default_rng(1)
    old = jnp.asarray(-1.0 - rng.random((2, 4)), jnp.float32)
    # Ratios in (0.9, 1.1) stay clear of PPO's kinks at 0.8 / 1.2 (GSPO gets wide ranges below).
    logp = old + jnp.asarray(rng.uniform(-0.1, 0.1, (2, 4)), jnp.float32)
    adv = jnp.array([1.5, -0.7])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    fn = A.POLICY_LOSSES[name]
    if name == "gspo":
      fn = lambda *a: A.gspo_loss(*a, eps_low=0.5, eps_high=0.5)
    f = lambda lp: A.aggregate(fn(lp, old, adv, mask)[0], mask, "seq_mean_token_mean")
    check_grads(f, (logp,), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)

  def test_cispo_grad_matches_finite_differences_when_weights_are_clipped(self):
    # With every ratio above 1 + eps_high the detached weight is a constant, so FD sees the same function.
    old = jnp.array([[-1.0, -2.0, -1.5]])
    logp = old + jnp.array([[0.5, 0.6, 0.7]])
    f = lambda lp: A.aggregate(A.cispo_loss(lp, old, jnp.array([1.3]), jnp.ones((1, 3)))[0], jnp.ones((1, 3)),
                               "token_mean")
    check_grads(f, (logp,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)

  def test_fully_masked_row_gives_no_nan(self):
    logp, old = jnp.zeros((2, 3)), jnp.zeros((2, 3))
    mask = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    for name, fn in A.POLICY_LOSSES.items():
      for mode in A.AGG_MODES:
        f = lambda lp: A.aggregate(fn(lp, old, jnp.array([1.0, 1.0]), mask)[0], mask, mode)
        val, g = jax.value_and_grad(f)(logp)
        self.assertTrue(np.isfinite(val) and np.all(np.isfinite(g)), f"{name}/{mode}")
        np.testing.assert_array_equal(g[1], np.zeros(3))
      val = A.aggregate(fn(logp, old, jnp.zeros(2), jnp.zeros((2, 3)))[0], jnp.zeros((2, 3)), "token_mean")
      self.assertEqual(float(val), 0.0)


class AggregationTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_modes(self):
    v = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    m = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    agg = self.variant(A.aggregate, static_argnames=("mode", "max_len"))
    np.testing.assert_allclose(agg(v, m, mode="token_mean"), 7.0 / 3.0, rtol=1e-6)
    # The empty third row is left out of the sequence mean.
    np.testing.assert_allclose(agg(v, m, mode="seq_mean_token_mean"), (1.5 + 4.0) / 2.0, rtol=1e-6)
    np.testing.assert_allclose(agg(v, m, mode="seq_mean_token_sum_norm"), 7.0 / (3 * 3), rtol=1e-6)
    np.testing.assert_allclose(agg(v, m, mode="seq_mean_token_sum_norm", max_len=10), 7.0 / 30.0, rtol=1e-6)

  def test_global_denominators_make_micro_batches_add_up(self):
    rng = np.random.default_rng(2)
    v = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    m = jnp.asarray(rng.random((4, 5)) > 0.4, jnp.float32)
    tok, seqs = A.denominators(m)
    for mode in A.AGG_MODES:
      whole = A.aggregate(v, m, mode)
      parts = sum(A.aggregate(v[i::2], m[i::2], mode, num_tokens=tok, num_seqs=seqs, num_rows=4) for i in (0, 1))
      np.testing.assert_allclose(parts, whole, rtol=1e-5, err_msg=mode)

  def test_unknown_mode(self):
    with self.assertRaisesRegex(ValueError, "unknown loss aggregation 'mean'; known: token_mean"):
      A.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "mean")


class RegularizerTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_kl_estimators(self):
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.5]])  # d = [0.5, -0.5]
    kl = self.variant(A.kl_estimate, static_argnums=(2,))
    np.testing.assert_allclose(kl(logp, ref, "k1"), [[0.5, -0.5]], rtol=1e-6)
    np.testing.assert_allclose(kl(logp, ref, "k2"), [[0.125, 0.125]], rtol=1e-6)
    k3 = [np.exp(-0.5) - 1 + 0.5, np.exp(0.5) - 1 - 0.5]
    np.testing.assert_allclose(kl(logp, ref, "k3"), [k3], rtol=1e-6)
    with self.assertRaisesRegex(ValueError, "unknown KL estimator 'k4'"):
      A.kl_estimate(logp, ref, "k4")

  def test_k3_is_unbiased_for_kl(self):
    # Exact KL(p||q) of two categoricals vs the k3 expectation under p.
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.5, 0.3])
    k3 = np.asarray(A.kl_estimate(jnp.log(jnp.asarray(p, jnp.float32))[None], jnp.log(jnp.asarray(q))[None]))[0]
    np.testing.assert_allclose(np.sum(p * k3), np.sum(p * np.log(p / q)), rtol=1e-5)

  def test_kl_penalized_rewards(self):
    out = A.kl_penalized_rewards(jnp.array([1.0, 0.0]), jnp.array([[-1.0, -1.0], [-1.0, -1.0]]),
                                 jnp.array([[-2.0, -3.0], [-1.5, -1.0]]), jnp.array([[1.0, 1.0], [1.0, 0.0]]),
                                 beta=0.1, kind="k1")
    np.testing.assert_allclose(out, [1.0 - 0.1 * 3.0, 0.0 - 0.1 * 0.5], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_clipped_value_loss(self):
    v = jnp.array([[1.0, 0.0, 0.5]])
    v_old = jnp.array([[0.0, 0.0, 0.4]])
    ret = jnp.array([[0.0, 1.0, 2.0]])
    out = self.variant(A.clipped_value_loss)(v, v_old, ret, jnp.array([[1.0, 1.0, 0.0]]), 0.2)
    # Token 0: max(1, 0.2^2) / 2; token 1: max(1, 1) / 2; token 2 masked.
    np.testing.assert_allclose(out, [[0.5, 0.5, 0.0]], rtol=1e-6)

  def test_entropy_bonus(self):
    out = A.entropy_bonus(jnp.array([[2.0, 3.0]]), jnp.array([[1.0, 0.0]]), 0.01)
    np.testing.assert_allclose(out, [[-0.02, 0.0]], rtol=1e-6)


class ImportanceWeightTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_token_level(self):
    beh = jnp.zeros((1, 4))
    old = jnp.array([[L(3.0), L(0.5), 0.0, L(9.0)]])
    m = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    f = self.variant(A.importance_weights, static_argnums=(3, 4))
    w, st = f(old, beh, m, "tis_token", 2.0)
    np.testing.assert_allclose(w, [[2.0, 0.5, 1.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(st["is_frac_truncated"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose([st["is_ratio_max"], st["is_ratio_min"]], [3.0, 0.5], rtol=1e-6)
    np.testing.assert_allclose(st["is_ratio_mean"], 4.5 / 3, rtol=1e-6)
    w, _ = f(old, beh, m, "mis_token", 2.0)
    np.testing.assert_allclose(w, [[0.0, 0.5, 1.0, 0.0]], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_sequence_level(self):
    beh = jnp.zeros((3, 2))
    old = jnp.array([[L(1.5), 0.0], [L(2.0), L(1.5)], [5.0, 5.0]])
    m = jnp.array([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    f = self.variant(A.importance_weights, static_argnums=(3, 4))
    w, st = f(old, beh, m, "tis_seq", 2.0)
    np.testing.assert_allclose(w, [[1.5, 1.5], [2.0, 2.0], [0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(st["is_frac_truncated"], 0.5, rtol=1e-6)  # 1 of 2 non-empty rows
    w, _ = f(old, beh, m, "mis_seq", 2.0)
    np.testing.assert_allclose(w, [[1.5, 1.5], [0.0, 0.0], [0.0, 0.0]], rtol=1e-6)

  def test_none_and_unknown(self):
    w, st = A.importance_weights(jnp.ones((1, 2)), jnp.zeros((1, 2)), jnp.array([[1.0, 0.0]]), "none")
    np.testing.assert_array_equal(w, [[1.0, 0.0]])
    self.assertEqual(float(st["is_frac_truncated"]), 0.0)
    with self.assertRaisesRegex(ValueError, "unknown importance-sampling mode 'tis'"):
      A.importance_weights(jnp.ones((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), "tis")


if __name__ == "__main__":
  absltest.main()
