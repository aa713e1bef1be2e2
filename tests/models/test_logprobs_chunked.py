"""Chunked token log-probs against a naive log_softmax of full logits: values, entropy, temperature, grads."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
import hf_testutil as U

CFG = M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="llama")
B, T = 3, 25


def naive(params, cfg, tokens, temperature=1.0, input_mask=None):
  """log p(next token) and entropy from the whole [B, T, V] logits."""
  logits, _ = M.forward(params, cfg, tokens, input_mask=input_mask)
  logp = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
  lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


@pytest.mark.parametrize("chunk, temperature", [(4, 1.0), (7, 0.7), (1, 1.3), (256, 1.0)])
def test_chunked_equals_naive(chunk, temperature):
  params = U.scaled_params(CFG, seed=chunk)
  tokens = jnp.asarray(U.random_tokens(B, T, seed=chunk))
  ref_lp, ref_ent = naive(params, CFG, tokens, temperature)
  lp, ent = M.token_logprobs(params, CFG, tokens, chunk=chunk, temperature=temperature, with_entropy=True)
  assert lp.shape == ent.shape == (B, T - 1)
  np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
  only = M.token_logprobs(params, CFG, tokens, chunk=chunk, temperature=temperature)
  np.testing.assert_allclose(only, lp, atol=1e-6)
  # A uniform distribution over V would have entropy log V; these logits are far from uniform or flat.
  assert 0.1 < float(ent.mean()) < np.log(96) - 0.1


def test_temperature_changes_the_result():
  params = U.scaled_params(CFG)
  tokens = jnp.asarray(U.random_tokens(B, T))
  a = M.token_logprobs(params, CFG, tokens, temperature=1.0)
  b = M.token_logprobs(params, CFG, tokens, temperature=0.5)
  assert float(jnp.abs(a - b).max()) > 1e-2


def test_left_padded_rows_match_unpadded():
  params = U.scaled_params(CFG, seed=2)
  seq = jnp.asarray(U.random_tokens(1, 12, seed=3))
  padded = jnp.concatenate([jnp.zeros((1, 5), jnp.int32), seq], axis=1)
  mask = jnp.arange(17)[None] >= 5
  lp = M.token_logprobs(params, CFG, padded, input_mask=mask, chunk=4)
  ref, _ = naive(params, CFG, seq)
  np.testing.assert_allclose(lp[:, 5:], ref, atol=1e-5)


def test_gradients_equal_naive():
  params = U.scaled_params(CFG, seed=5)
  tokens = jnp.asarray(U.random_tokens(B, T, seed=6))
  w = jnp.asarray(np.random.default_rng(7).normal(size=(B, T - 1)), jnp.float32)

  def chunked(p):
    lp, ent = M.token_logprobs(p, CFG, tokens, chunk=6, temperature=0.8, with_entropy=True)
    return jnp.sum(lp * w) + 0.1 * jnp.sum(ent)

  def reference(p):
    lp, ent = naive(p, CFG, tokens, temperature=0.8)
    return jnp.sum(lp * w) + 0.1 * jnp.sum(ent)

  g = jax.jit(jax.grad(chunked))(params)
  g_ref = jax.jit(jax.grad(reference))(params)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_ref))
  assert scale > 1e-2
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), g, g_ref)


def _big_vocab_intermediates(jaxpr, limit):
  """Shapes of activations in `jaxpr` (sub-jaxprs included) with last dim V and > `limit` rows.

  Only rank ≥ 3 values count: logits are [B, t, V] (or stacked per chunk), weights are rank 2.
  """
  found = []
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      shape = getattr(v.aval, "shape", ())
      if len(shape) >= 3 and shape[-1] == CFG.vocab_size and int(np.prod(shape[:-1])) > limit:
        found.append(shape)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _big_vocab_intermediates(sub, limit)
  return found


def test_never_builds_full_logits():
  """Neither the forward nor the backward pass holds more than one chunk of [*, V] logits."""
  params = U.scaled_params(CFG)
  tokens = jnp.asarray(U.random_tokens(B, T))
  f = lambda p: jnp.sum(M.token_logprobs(p, CFG, tokens, chunk=4, with_entropy=True)[0])
  limit = B * 4
  assert _big_vocab_intermediates(jax.make_jaxpr(f)(params).jaxpr, limit) == []
  assert _big_vocab_intermediates(jax.make_jaxpr(jax.grad(f))(params).jaxpr, limit) == []
  # The checker does see full logits when they exist.
  g = lambda p: jnp.sum(naive(p, CFG, tokens)[0])
  assert _big_vocab_intermediates(jax.make_jaxpr(g)(params).jaxpr, limit)


@pytest.mark.parametrize("scan, remat", [(False, False), (True, True)])
def test_start_skips_the_prompt_exactly(scan, remat):
  # start > 0 runs the last layer's queries/MLP and the logits only from `start` on: same values and
  # gradients there (left padding included), zeros before.
  cfg = M.ModelConfig(96, 32, 3, 4, 2, 8, 64, arch="llama", scan_layers=scan, remat=remat)
  params = U.scaled_params(cfg, seed=8)
  tokens = jnp.asarray(U.random_tokens(B, T, seed=9))
  mask = jnp.arange(T)[None] >= jnp.asarray([[0], [3], [6]])
  s = 9
  full_lp, full_ent = M.token_logprobs(params, cfg, tokens, input_mask=mask, chunk=4, with_entropy=True)
  lp, ent = M.token_logprobs(params, cfg, tokens, input_mask=mask, chunk=4, with_entropy=True, start=s)
  assert lp.shape == ent.shape == (B, T - 1)
  np.testing.assert_allclose(lp[:, s:], full_lp[:, s:], atol=1e-6)
  np.testing.assert_allclose(ent[:, s:], full_ent[:, s:], rtol=1e-6, atol=1e-6)  # entropies ~4: a few f32 ulps
  assert not np.any(np.asarray(lp[:, :s])) and not np.any(np.asarray(ent[:, :s]))
  w = jnp.asarray(np.random.default_rng(10).normal(size=(B, T - 1)), jnp.float32).at[:, :s].set(0.0)
  grad = lambda start: jax.grad(lambda p: jnp.sum(w * M.token_logprobs(p, cfg, tokens, input_mask=mask,
                                                                        start=start)))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), grad(s), grad(0))
  with pytest.raises(ValueError, match="start=24 must be in"):
    M.token_logprobs(params, cfg, tokens, start=T - 1)
