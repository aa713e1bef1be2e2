"""The paged layout: the Pallas TPU kernel (interpret mode on CPU) and the jnp reference against a dense numpy
softmax, and the one decode step over the paged cache against the full-sequence forward (no cache)."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
from rlax.sampler import layouts, paged
from rlax.sampler import params as params_lib
from rlax.sampler import step as step_lib

# Slot lengths: one token, inside the first page, exactly one page, and spanning several pages (page 4).
LENGTHS = [1, 3, 4, 14]


def _paged_problem(dtype, H=8, K=2, Dh=32, pg=4, n=4, seed=0):
  """Random per-slot key/value sequences scattered into a shuffled page pool with spare pages.

  Returns q [S, H, Dh], pools [K, P, pg, Dh], page table [S, n], and the logical sequences (numpy f32, as
  stored in `dtype`) for the dense reference.
  """
  rng = np.random.default_rng(seed)
  S = len(LENGTHS)
  P = S * n + 3
  table = rng.permutation(P)[:S * n].reshape(S, n).astype(np.int32)
  q = rng.standard_normal((S, H, Dh)).astype(np.float32)
  ks = [rng.standard_normal((L, K, Dh)).astype(np.float32) for L in LENGTHS]
  vs = [rng.standard_normal((L, K, Dh)).astype(np.float32) for L in LENGTHS]
  round_ = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
  q, ks, vs = round_(q), [round_(k) for k in ks], [round_(v) for v in vs]
  kp = rng.standard_normal((K, P, pg, Dh)).astype(np.float32)  # garbage beyond each slot's length
  vp = rng.standard_normal((K, P, pg, Dh)).astype(np.float32)
  for s, L in enumerate(LENGTHS):
    for t in range(L):
      kp[:, table[s, t // pg], t % pg] = ks[s][t]
      vp[:, table[s, t // pg], t % pg] = vs[s][t]
  as_ = lambda a: jnp.asarray(a, dtype)
  return as_(q), as_(kp), as_(vp), jnp.asarray(LENGTHS, jnp.int32), jnp.asarray(table), ks, vs


def _dense(q, ks, vs, kv_dtype=np.float32):
  """Per slot and head: softmax(q k^T / sqrt(Dh)) v over the slot's own keys, in float64."""
  q = np.asarray(q, np.float64)
  S, H, Dh = q.shape
  out = np.zeros((S, H, Dh))
  for s in range(S):
    k, v = (np.asarray(jnp.asarray(a, kv_dtype).astype(jnp.float32), np.float64) for a in (ks[s], vs[s]))
    K = k.shape[1]
    for h in range(H):
      kh = h // (H // K)  # GQA: query heads [kh*G, (kh+1)*G) share KV head kh
      sc = k[:, kh] @ q[s, h] / np.sqrt(Dh)
      p = np.exp(sc - sc.max())
      out[s, h] = (p / p.sum()) @ v[:, kh]
  return out


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_reference_paged_attention_matches_dense(dtype, tol):
  q, kp, vp, lens, table, ks, vs = _paged_problem(dtype)
  got = paged.reference_attention(q, kp, vp, lens, table)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), _dense(q, ks, vs), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_pallas_kernel_in_interpret_mode_matches_dense(dtype, tol):
  """jax's Pallas TPU paged_attention kernel, run in Pallas TPU interpret mode on CPU.

  The kernel loads K/V pages as bfloat16 (whatever the pool dtype), so the dense reference rounds them too;
  with that, f32 agrees to float32 rounding.
  """
  q, kp, vp, lens, table, ks, vs = _paged_problem(dtype)
  got = jax.jit(lambda *a: paged.kernel_attention(*a, pages_per_block=2, interpret=True))(q, kp, vp, lens, table)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), _dense(q, ks, vs, kv_dtype=jnp.bfloat16), atol=tol,
                             rtol=tol)
  ref = paged.reference_attention(q, kp, vp, lens, table)
  if dtype == jnp.float32:  # the kernel's bf16 K/V shows against an f32 reference at about bf16 precision
    assert 1e-4 < float(jnp.max(jnp.abs(got - ref))) < 5e-2


CFG = M.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                    qkv_bias=True)
PG, MAX_LEN = 4, 11  # 3 pages per slot, the last one partly used
STARTS = np.array([0, 2, 5, 1])  # slot s joins at step STARTS[s]: slots sit at different positions


@functools.partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnums=1)
def _step(params, cache, tok, pos, live, *, cfg, layout):
  fused = params_lib.fuse(params, cfg, stacked=cfg.scan_layers, concat=False)
  return step_lib.decode_step(fused, cfg, layout, cache, tok, pos, jnp.zeros_like(pos), live, 1)[:2]


def _params(cfg):
  p = M.create_params(cfg, seed=0)
  # Sharper logits than the 0.02-std init, so an attention error shows in them.
  return {**p, "lm_head": p["lm_head"] * 30.0, "layers": {**p["layers"],
          "q_bias": 0.5 * jax.random.normal(jax.random.key(1), p["layers"]["q_bias"].shape)}}


def _cache(cfg, S, T, shards):
  n = paged.pages_per_slot(T, PG)
  if shards == 1:  # shuffled pages, with spare pages in the pool
    table = np.random.default_rng(0).permutation(S * n + 2)[:S * n].reshape(S, n)
    pages = S * n + 2
  else:  # page ids are local to each slot shard's part of the pool
    table, pages = paged.contiguous_page_table(S, n, shards)[:, ::-1], S * n
  shape = (cfg.n_kv_heads, cfg.n_layers, pages, PG, cfg.head_dim)
  return layouts.PagedCache(k=jnp.zeros(shape, cfg.jnp_dtype), v=jnp.zeros(shape, cfg.jnp_dtype),
                            page_table=jnp.asarray(table, jnp.int32))


def _run(cfg, params, tokens, attention="reference", mesh=None, shards=1, steps=None):
  """Decodes tokens [S, T] with staggered starts; returns {(slot, position): logits} of every active step."""
  S, T = tokens.shape
  layout = layouts.Paged(T, PG, attention)
  cache = _cache(cfg, S, T, shards)
  ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
  out = {}
  with ctx:
    if mesh is not None:
      cache = jax.device_put(cache, layout.shardings(cfg, mesh, S))
    for t in range(steps or T + STARTS.max()):
      pos = np.clip(t - STARTS, 0, T - 1)
      active = (t >= STARTS) & (t - STARTS < T)
      tok = tokens[np.arange(S), pos]
      logits, cache = _step(params, cache, jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32),
                            jnp.asarray(active), cfg=cfg, layout=layout)
      logits = np.asarray(logits)
      out.update({(s, int(pos[s])): logits[s] for s in range(S) if active[s]})
  return out


def _check(out, full, tol):
  assert out, "no step was compared"
  for (s, p), logits in out.items():
    np.testing.assert_allclose(logits, full[s, p], atol=tol, rtol=tol, err_msg=f"slot {s} position {p}")


@pytest.fixture(scope="module")
def problem():
  tokens = np.random.default_rng(3).integers(1, CFG.vocab_size, (len(STARTS), MAX_LEN))
  params = _params(CFG)
  return tokens, params, np.asarray(M.forward(params, CFG, jnp.asarray(tokens))[0])


@pytest.mark.parametrize("scan", [False, True])
def test_decode_step_matches_full_forward(problem, scan):
  """Every slot at every position (staggered: slots at different positions in one step, pages shuffled)."""
  tokens, params, full = problem
  out = _run(CFG.replace(scan_layers=scan), params, tokens)
  assert len(out) == len(STARTS) * MAX_LEN
  _check(out, full, 1e-4)


def test_decode_step_with_interpreted_kernel(problem):
  """The Pallas kernel (interpret mode) inside the scanned step: bf16-loaded K/V, so bf16-level agreement."""
  tokens, params, full = problem
  out = _run(CFG.replace(scan_layers=True), params, tokens, attention="interpret", steps=7)
  _check(out, full, 5e-2)


def test_decode_step_sharded_over_slots_and_kv_heads(problem):
  """Under a data 2 x tensor 2 mesh the write and attention run per shard (shard_map), with local page ids."""
  tokens, params, full = problem
  mesh = M.make_mesh(jax.devices()[:4], data=2, fsdp=1, tensor=2)
  params = jax.device_put(params, M.param_shardings(CFG, mesh))
  out = _run(CFG.replace(scan_layers=True), params, tokens, mesh=mesh, shards=2)
  assert len(out) == len(STARTS) * MAX_LEN
  _check(out, full, 1e-4)


def test_decode_step_bfloat16(problem):
  """bf16 weights, compute and cache: the same logits as the bf16 full forward, to bf16 rounding."""
  tokens, params, _ = problem
  cfg = CFG.replace(scan_layers=True, dtype="bfloat16", param_dtype="bfloat16")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  full = np.asarray(M.forward(params, cfg, jnp.asarray(tokens))[0])
  out = _run(cfg, params, tokens, steps=8)
  scale = np.abs(full).max()
  errs = [np.abs(v - full[k]).max() / scale for k, v in out.items()]
  assert len(errs) == 8 + 6 + 3 + 7 and max(errs) < 2e-2  # measured 3.4e-3


def test_idle_slots_write_nothing(problem):
  _, params, _ = problem
  cfg = CFG.replace(scan_layers=True)
  layout = layouts.Paged(MAX_LEN, PG)
  cache = _cache(cfg, 4, MAX_LEN, 1)
  _, new = _step(params, cache, jnp.asarray([3, 3, 3, 3], jnp.int32), jnp.asarray([2, 1, 0, 3], jnp.int32),
                 jnp.zeros(4, bool), cfg=cfg, layout=layout)
  assert not np.asarray(new.k).any() and not np.asarray(new.v).any()


def test_kernel_cost_and_page_sizes():
  cfg = M.preset("qwq32b")
  per_page = 2 * 64 * 8 * 128 * 128 * 2  # K and V, 64 layers, 8 KV heads, bf16
  assert paged.default_pages_per_block(129, 128) == 3 and paged.default_pages_per_block(128, 128) == 8
  c = paged.kernel_cost(cfg, [1, 128, 129], 128)
  assert c["pages_read"] == 64 * 4
  assert c["bytes_accessed"] == 64 * (4 * per_page // 64 + 2 * 3 * 40 * 128 * 4)
  assert paged.kernel_cost(cfg, [1, 128, 129], 128, pages_per_block=2)["pages_read"] == 64 * 6  # whole blocks
  assert [paged.default_page_size(n) for n in (24, 300, 1 << 14)] == [16, 32, 128]
