"""The one block (`rlax.models.layers.block`): fused and unfused weights agree, and the decode step built on it
equals the full forward for every architecture switch (bias, q/k-norm, tied embeddings, llama3 RoPE)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
from rlax.models import layers
from rlax.sampler import decode
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
  run = jax.jit(lambda w: layers.block(cfg, w, x, pos, layers.rope_inv_freq(cfg), attend, q_start))
  plain, fused = run(lp), run(layers.fuse(cfg, lp))
  assert plain.shape == (2, 7 - q_start, cfg.d_model)
  np.testing.assert_allclose(fused, plain, atol=1e-5)
  assert float(jnp.abs(plain - x[:, q_start:]).max()) > 1e-2  # the block really changed x


@functools.partial(jax.jit, static_argnames=("cfg",))
def _decode(params, cfg, cache, tok, pos, gslot):
  return decode.decode_step(decode.fuse_params(params, cfg), cfg, cache, tok, pos, gslot, 0)


@pytest.mark.parametrize("name", sorted(CFGS))
def test_decode_step_equals_full_forward(name):
  """2 prompts x 2 samples: the shared prompt cache from the cached forward, then one decode step per token."""
  cfg = CFGS[name]
  params = U.scaled_params(cfg, seed=3)
  P, n_new, G = 5, 8, 2
  seqs = U.random_tokens(batch=4, length=P + n_new - 1, seed=4)
  seqs[1, :P], seqs[3, :P] = seqs[0, :P], seqs[2, :P]  # rows 2p, 2p+1 continue prompt p
  full, _ = jax.jit(lambda p, t: M.forward(p, cfg, t))(params, seqs)
  _, mc = jax.jit(lambda p, t: M.hidden_states(p, cfg, t, cache=M.init_cache(cfg, 2, P)))(params, seqs[::G, :P])
  cache = decode.from_model_cache(mc, P, G, n_new)
  for t in range(P, P + n_new - 1):
    logits, cache = _decode(params, cfg, cache, jnp.asarray(seqs[:, t]), jnp.full((4,), t), jnp.int32(t - P))
    np.testing.assert_allclose(logits, full[:, t], atol=TOL)
