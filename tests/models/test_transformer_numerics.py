"""The transformer against itself: KV-cache decode, scan/remat, bf16 and 8-device sharding vs the plain forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax import models as M
import hf_testutil as U

CFGS = {
    "llama3rope": M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="llama",
                                rope_scaling=M.RopeScaling(8.0, 1.0, 4.0, 32)),
    "qwen2": M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="qwen2", qkv_bias=True),
    "qwen3": M.ModelConfig(96, 32, 3, 4, 1, 16, 48, arch="qwen3", qk_norm=True, tie_embeddings=True),
}
TOL = 1e-4


def _fwd(cfg):
  return jax.jit(lambda p, t, **kw: M.forward(p, cfg, t, **kw))


@pytest.mark.parametrize("name, scan, remat", [("llama3rope", False, False), ("qwen2", True, False),
                                               ("qwen3", False, True)])
def test_prefill_then_decode_equals_full_forward(name, scan, remat):
  cfg = CFGS[name].replace(scan_layers=scan, remat=remat)
  params = U.scaled_params(cfg)
  tokens = U.random_tokens(batch=2, length=12)
  full, _ = _fwd(cfg)(params, tokens)
  step = _fwd(cfg)
  logits, cache = step(params, tokens[:, :5], cache=M.init_cache(cfg, 2, 16))
  np.testing.assert_allclose(logits, full[:, :5], atol=TOL)
  for t in range(5, 12):
    logits, cache = step(params, tokens[:, t:t + 1], cache=cache)
    np.testing.assert_allclose(logits[:, 0], full[:, t], atol=TOL)
  assert int(cache.index) == 12 and bool(cache.valid[:, :12].all()) and not bool(cache.valid[:, 12:].any())


def test_left_padded_decode_equals_each_row_alone():
  """Rows of different prompt lengths, left-padded, decode exactly as if each ran unpadded on its own."""
  cfg = CFGS["llama3rope"]
  params = U.scaled_params(cfg, seed=1)
  seqs = [U.random_tokens(1, 11, seed=2)[0], U.random_tokens(1, 8, seed=3)[0]]  # prompts 7 and 4, +4 decoded
  prompt_lens, P_ = [7, 4], 7
  prompt = np.zeros((2, P_), np.int32)
  mask = np.zeros((2, P_), bool)
  for b, (s, n) in enumerate(zip(seqs, prompt_lens)):
    prompt[b, P_ - n:] = s[:n]
    mask[b, P_ - n:] = True
  step = _fwd(cfg)
  logits, cache = step(params, prompt, input_mask=mask, cache=M.init_cache(cfg, 2, 16))
  decoded = []
  for t in range(4):
    nxt = np.array([[s[n + t]] for s, n in zip(seqs, prompt_lens)], np.int32)
    out, cache = step(params, nxt, cache=cache)
    decoded.append(np.asarray(out[:, 0]))
  for b, (s, n) in enumerate(zip(seqs, prompt_lens)):
    ref, _ = _fwd(cfg)(params, s[None])
    np.testing.assert_allclose(logits[b, P_ - n:], ref[0, :n], atol=TOL)
    for t in range(4):
      np.testing.assert_allclose(decoded[t][b], ref[0, n + t], atol=TOL)


def test_scan_and_remat_equal_plain():
  """Forward and the gradient of chunked log-probs agree across layer scan and remat (one plain compile)."""
  cfg = CFGS["qwen2"]
  params = U.scaled_params(cfg, seed=4)
  tokens = U.random_tokens(batch=2, length=10, seed=5)

  def run(c):
    loss = lambda p: jnp.sum(M.token_logprobs(p, c, tokens, chunk=4) * jnp.arange(9.0))
    return _fwd(c)(params, tokens)[0], jax.jit(jax.value_and_grad(loss))(params)

  ref, (l_ref, g_ref) = run(cfg)
  scale = float(jnp.abs(g_ref["layers"]["q"]).max())
  assert scale > 1e-3
  for scan, remat in [(True, True), (False, True)]:  # the scan path alone is in the decode test
    out, (l, g) = run(cfg.replace(scan_layers=scan, remat=remat))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), g, g_ref)


def test_bf16_compute_runs_close_to_f32():
  cfg = CFGS["qwen3"]
  params = U.scaled_params(cfg, seed=6)
  tokens = U.random_tokens(seed=7)
  ref, _ = _fwd(cfg)(params, tokens)
  bf = cfg.replace(param_dtype="bfloat16", dtype="bfloat16")
  out, _ = _fwd(bf)(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), tokens)
  assert out.dtype == jnp.float32 and bool(jnp.isfinite(out).all())
  assert 1e-4 < float(jnp.abs(out - ref).max()) < 0.15  # really computed in bf16, and still close
  lp = jax.jit(lambda p, t: M.token_logprobs(p, bf, t, chunk=8))(params, tokens)
  assert lp.dtype == jnp.float32 and lp.shape == (2, 23) and bool((lp < 0).all())


@pytest.mark.parametrize("axes", [dict(fsdp=4, tensor=2), dict(data=2, fsdp=2, tensor=2)])
def test_sharded_forward_equals_single_device(axes):
  cfg = CFGS["llama3rope"]
  params = U.scaled_params(cfg, seed=8)
  tokens = U.random_tokens(batch=4, length=16, seed=9)
  ref, _ = _fwd(cfg)(params, tokens)
  ref_lp = jax.jit(lambda p, t: M.token_logprobs(p, cfg, t, chunk=4))(params, tokens)
  mesh = M.make_mesh(jax.devices(), **axes)
  sharded = jax.device_put(params, M.param_shardings(cfg, mesh))
  assert sharded["layers"]["gate"].addressable_shards[0].data.shape == (2, 32 // axes["fsdp"], 64 // 2)
  toks = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
  with jax.set_mesh(mesh):
    out, _ = jax.jit(lambda p, t: M.forward(p, cfg, t))(sharded, toks)
    lp = jax.jit(lambda p, t: M.token_logprobs(p, cfg, t, chunk=4))(sharded, toks)
  assert len(out.sharding.device_set) == 8
  np.testing.assert_allclose(out, ref, atol=TOL)
  np.testing.assert_allclose(lp, ref_lp, atol=TOL)
