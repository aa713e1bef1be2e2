"""Sampling strategies against numpy references: masks, log-probs, and the inverse-CDF draw itself."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from rlax.sampler import strategies as st


def _np_adjust(logits, strategy):
  """Independent numpy version of each strategy's adjusted logits."""
  x = np.asarray(logits, np.float64) / getattr(strategy, "temperature", 1.0)
  k = getattr(strategy, "k", None)
  if k is not None:
    kth = np.sort(x, axis=-1)[:, ::-1][:, k - 1:k]
    x = np.where(x >= kth, x, -np.inf)
  if isinstance(strategy, st.TopP):
    out = np.empty_like(x)
    for r in range(x.shape[0]):
      order = np.argsort(-x[r], kind="stable")
      p = np.exp(x[r][order] - x[r].max())
      p /= p.sum()
      mass_before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
      n = max(1, int(np.sum(mass_before < strategy.p)))
      cut = x[r][order][n - 1]
      out[r] = np.where(x[r] >= cut, x[r], -np.inf)
    x = out
  return x


def _np_logsoftmax(x):
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("strategy", [st.Temperature(0.7), st.TopK(5, 1.3), st.TopP(0.8, 0.9),
                                      st.TopP(0.5, 1.0, k=7)])
def test_adjust_and_logprob_match_numpy(strategy):
  logits = 3.0 * jax.random.normal(jax.random.key(0), (6, 50))
  adj = np.asarray(jax.jit(strategy.adjust)(logits))
  ref = _np_adjust(logits, strategy)
  np.testing.assert_array_equal(np.isinf(adj), np.isinf(ref))
  np.testing.assert_allclose(adj[~np.isinf(adj)], ref[~np.isinf(ref)], rtol=1e-6)
  u = 1.0 - jax.random.uniform(jax.random.key(1), (6,))
  tok, lp = jax.jit(strategy.sample)(logits, u)
  tok = np.asarray(tok)
  assert np.all(np.isfinite(ref[np.arange(6), tok])), "sampled a masked token"
  np.testing.assert_allclose(np.asarray(lp), _np_logsoftmax(ref)[np.arange(6), tok], atol=1e-5)


def test_top_k_keeps_exactly_k_without_ties():
  logits = jnp.asarray([[0.1, 2.0, -1.0, 3.0, 0.5]])
  adj = np.asarray(st.TopK(2).adjust(logits))
  assert np.isfinite(adj).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_crossing_token():
  # probs 0.5, 0.3, 0.2: p=0.6 needs the first two (mass before the second is 0.5 < 0.6).
  logits = jnp.log(jnp.asarray([[0.3, 0.5, 0.2]]))
  adj = np.asarray(st.TopP(0.6).adjust(logits))
  assert np.isfinite(adj).tolist() == [[True, True, False]]


def test_greedy_is_first_argmax_with_temperature_one_logprob():
  logits = jnp.asarray([[1.0, 4.0, 4.0, 0.0], [2.0, -1.0, 0.0, 1.0]])
  tok, lp = st.Greedy().sample(logits, jnp.ones(2))
  assert np.asarray(tok).tolist() == [1, 0]
  np.testing.assert_allclose(np.asarray(lp), _np_logsoftmax(np.asarray(logits))[[0, 1], [1, 0]], rtol=1e-6)


def test_inverse_cdf_boundaries():
  # cdf of [0.25, 0, 0.5, 0.25] = [.25, .25, .75, 1]; the zero-mass token 1 is never picked.
  adj = jnp.log(jnp.asarray([[0.25, 0.0, 0.5, 0.25]] * 5))
  u = jnp.asarray([1e-6, 0.25, 0.2500001, 0.75, 1.0])
  assert np.asarray(st.inverse_cdf(adj, u)).tolist() == [0, 0, 2, 2, 3]


def test_inverse_cdf_frequencies():
  probs = np.asarray([0.05, 0.0, 0.4, 0.15, 0.3, 0.1] + [0.0] * 37)  # V = 43: exercises block padding
  adj = jnp.log(jnp.asarray(np.tile(probs, (20000, 1)), jnp.float32))
  u = 1.0 - jax.random.uniform(jax.random.key(3), (20000,))
  counts = np.bincount(np.asarray(jax.jit(st.inverse_cdf)(adj, u)), minlength=43) / 20000
  np.testing.assert_allclose(counts, probs, atol=0.012)  # > 4 sigma for p(1-p)/n at n=20000


def test_bad_arguments():
  with pytest.raises(ValueError, match="temperature"):
    st.Temperature(0.0)
  with pytest.raises(ValueError, match="TopK.k"):
    st.TopK(0)
  with pytest.raises(ValueError, match="TopP.p"):
    st.TopP(1.5)
