"""An independent sampling reference: a full forward (no KV cache) per step, per row; tiny test weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax import models as M
from rlax.sampler import rows as rows_lib

CFG = M.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
PROMPTS = [[1, 5, 9], [1, 7, 3, 22, 40, 41, 13], [1, 60], [1, 2, 3, 4, 5]]


def _params(seed):
  # Sharper than the 0.02-std init, so top-k / top-p masks cut real mass.
  p = M.create_params(CFG, seed=seed)
  return {**p, "lm_head": p["lm_head"] * 60.0}


P0, P1 = _params(0), _params(1)


@functools.partial(jax.jit, static_argnames=("strategy",))
def _ref_step(params, seqs, last, keys, t, strategy):
  logits = M.forward(params, CFG, seqs)[0][jnp.arange(seqs.shape[0]), last]
  u = 1.0 - jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, t), ()))(keys)
  return strategy.sample(logits, u)


def reference(params_at, prompts, n_new, strategy, *, seed=0, step=0, prompt_ids=None, G=1):
  """Row-by-row sampling with M.forward over the whole sequence (no cache) at every step.

  params_at(t) gives the weights for token t. Returns tokens [R, n_new], logprobs [R, n_new].
  """
  ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
  rows = [(list(p), i, g) for p, i in zip(prompts, ids) for g in range(G)]
  keys = jax.random.wrap_key_data(rows_lib.row_key_data(seed, step, [r[1] for r in rows], [r[2] for r in rows]))
  T = max(len(r[0]) for r in rows) + n_new
  seqs = [r[0][:] for r in rows]
  toks, lps = np.zeros((len(rows), n_new), np.int64), np.zeros((len(rows), n_new))
  for t in range(n_new):
    # Right-padded: causal attention keeps the padding out of every real position.
    arr = jnp.asarray([s + [0] * (T - len(s)) for s in seqs], jnp.int32)
    last = jnp.asarray([len(s) - 1 for s in seqs])
    tok, lp = _ref_step(params_at(t), arr, last, keys, jnp.int32(t), strategy=strategy)
    toks[:, t], lps[:, t] = np.asarray(tok), np.asarray(lp)
    for s, x in zip(seqs, np.asarray(tok)):
      s.append(int(x))
  return toks, lps


def assert_matches_reference(out, strategy, *, n_new=8, seed=3, step=7, G=2):
  """`out` (PROMPTS x G samples, full length) equals the reference: tokens, log-probs, lengths, ids, versions."""
  from rlax import sampler as S  # pylint: disable=g-import-not-at-top
  ref_tok, ref_lp = reference(lambda t: P0, PROMPTS, n_new, strategy, seed=seed, step=step, G=G)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref_tok)
  np.testing.assert_allclose(np.asarray(out.logprobs), ref_lp, atol=1e-5)
  assert np.all(np.asarray(out.lengths) == n_new) and np.all(np.asarray(out.finish_reason) == S.LENGTH)
  assert np.all(np.asarray(out.versions) == 0)
  assert np.asarray(out.prompt_ids).tolist() == [i for i in range(len(PROMPTS)) for _ in range(G)]
  assert np.asarray(out.sample_ids).tolist() == list(range(G)) * len(PROMPTS)


def assert_rows_match_reference(out, limits, n_new, *, seed, atol=1e-5, G=2):
  """PROMPTS x G rows with per-row `limits`, temperature 1: each row's first limit tokens (and their
  log-probs within `atol`; None skips them) equal the reference; past the limit pad tokens, version -1."""
  from rlax import sampler as S  # pylint: disable=g-import-not-at-top
  ref_tok, ref_lp = reference(lambda t: P0, PROMPTS, n_new, S.Temperature(1.0), seed=seed, G=G)
  toks, lps, ver = np.asarray(out.tokens), np.asarray(out.logprobs), np.asarray(out.versions)
  np.testing.assert_array_equal(np.asarray(out.lengths), limits)
  for r, n in enumerate(limits):
    np.testing.assert_array_equal(toks[r, :n], ref_tok[r, :n], err_msg=f"row {r}")
    if atol is not None:
      np.testing.assert_allclose(lps[r, :n], ref_lp[r, :n], atol=atol, err_msg=f"row {r}")
    assert np.all(toks[r, n:] == 0) and np.all(ver[r, n:] == -1)
  return lps, ref_lp


def assert_logprobs_match_their_versions(out, params_by_version, *, G=2, atol=1e-5):
  """Every token's behaviour log-prob equals the teacher-forced log-prob under the weights of its version."""
  ver, toks, lps = np.asarray(out.versions), np.asarray(out.tokens), np.asarray(out.logprobs)
  for r in range(len(toks)):
    prompt = PROMPTS[r // G]
    seq = np.asarray([prompt + toks[r].tolist()], np.int32)
    for v, params in params_by_version.items():
      lp = np.asarray(M.token_logprobs(params, CFG, seq))[0, len(prompt) - 1:]
      m = ver[r] == v
      np.testing.assert_allclose(lps[r][m], lp[m], atol=atol, err_msg=f"row {r} version {v}")
