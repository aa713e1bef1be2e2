"""The one block (`rlax.models.layers.block`): fused and unfused weights agree, and the decode step built on it
equals the full forward for every architecture switch (bias, q/k-norm, tied embeddings, llama3 RoPE)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
from rlax.models import layers
from rlax.sampler import layouts
from rlax.sampler import params as params_lib
from rlax.sampler import step
import hf_testutil as U

CFGS = {
    "llama3rope": M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="llama",
                                rope_scaling=M.RopeScaling(8.0, 1.0, 4.0, 32)),
    "qwen2": M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="qwen2", qkv_bias=True),
    "qwen3": M.ModelConfig(96, 32, 2, 4, 1, 16, 48, arch="qwen3", qk_norm=True, tie_embeddings=True),
}
TOL = 1e-4


@pytest.mark.parametrize("name", sorted(CFGS))
@pytest.mark.parametrize("q_start", [0, 3])
def test_fused_weights_equal_unfused(name, q_start):
  cfg = CFGS[name]
  lp = jax.tree.map(lambda w: w[0], U.scaled_params(cfg, seed=1)["layers"])
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 7, cfg.d_model)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  mask = jnp.tril(jnp.ones((7, 7), bool))[None, q_start:]
  attend = lambda q, k, v: layers.attention(q, k, v, mask)
  run = jax.jit(lambda w: layers.block(cfg, w, x, layers.rope(pos, layers.rope_inv_freq(cfg)), attend, q_start))
  plain, fused = run(lp), run(layers.fuse(cfg, lp))
  assert plain.shape == (2, 7 - q_start, cfg.d_model)
  np.testing.assert_allclose(fused, plain, atol=1e-5)
  assert float(jnp.abs(plain - x[:, q_start:]).max()) > 1e-2  # the block really changed x


@functools.partial(jax.jit, static_argnames=("cfg", "lay"))
def _prefill(params, prompt, n, *, cfg, lay):
  logits, k, v, _ = step.forward(params_lib.fuse(params, cfg, stacked=False), cfg, prompt, jnp.zeros_like(n), n)
  cache = lay.write(lay.init(cfg, prompt.shape[0]), jnp.arange(prompt.shape[0]), k, v, jnp.zeros_like(n), n, n)
  return logits, cache


@functools.partial(jax.jit, static_argnames=("cfg", "lay"))
def _decode(params, cache, tok, pos, n, *, cfg, lay):
  fused = params_lib.fuse(params, cfg, stacked=False)
  return step.decode_step(fused, cfg, lay, cache, tok, pos, n, jnp.ones(tok.shape, bool), 1)[:2]


@pytest.mark.parametrize("name", sorted(CFGS))
def test_decode_step_equals_full_forward(name):
  """4 rows with prompts of 3, 5, 4 and 5 tokens (right-padded): the prefill's logits and keys/values written into
  the dense layout, then one decode step per token, each row at its own position."""
  cfg = CFGS[name]
  params = U.scaled_params(cfg, seed=3)
  P, n_new = 5, 8
  n = np.array([3, 5, 4, 5], np.int32)
  seqs = U.random_tokens(batch=4, length=P + n_new, seed=4)
  lay = layouts.Dense(P, n_new)
  prompt = np.where(np.arange(P)[None] < n[:, None], seqs[:, :P], 0)
  logits, cache = _prefill(params, jnp.asarray(prompt), jnp.asarray(n), cfg=cfg, lay=lay)
  full = [np.asarray(jax.jit(lambda p, t: M.forward(p, cfg, t)[0])(params, seqs[r:r + 1, :n[r] + n_new - 1]))[0]
          for r in range(4)]
  np.testing.assert_allclose(logits, np.stack([full[r][n[r] - 1] for r in range(4)]), atol=TOL)
  for g in range(n_new - 1):
    pos = n + g
    tok = seqs[np.arange(4), pos]
    logits, cache = _decode(params, cache, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(n), cfg=cfg, lay=lay)
    np.testing.assert_allclose(logits, np.stack([full[r][pos[r]] for r in range(4)]), atol=TOL)
