"""Sampler engine against an independent reference: a full forward (no KV cache) per step, per row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
from rlax import sampler as S
from rlax.sampler import decode

from harness.sampling_ref import CFG, P0, P1, PROMPTS, assert_matches_reference, reference


def make(**kw):
  args = dict(max_prompt_len=16, max_new_tokens=8, batch_size=16, params=P0)
  args.update(kw)
  return S.Sampler(CFG, **args)


@pytest.fixture(scope="module")
def sm():
  """One default sampler shared by tests that only read from it (saves compiles)."""
  return make()


@pytest.mark.parametrize("strategy", [S.Greedy(), S.Temperature(0.8), S.TopK(4, 1.2), S.TopP(0.7, 1.0),
                                      S.TopP(0.9, 0.7, k=6)])
def test_matches_full_forward_reference(sm, strategy):
  """Greedy = step-by-step argmax; sampled tokens and behaviour log-probs = full-forward recomputation."""
  out = sm.generate(PROMPTS, samples_per_prompt=2, strategy=strategy, seed=3, step=7)
  assert_matches_reference(out, strategy)
  # Left-padded prompts into the 8-token bucket.
  assert out.prompt_tokens.shape == (8, 8)
  np.testing.assert_array_equal(np.asarray(out.prompt_tokens[2])[1:], PROMPTS[1])
  assert np.asarray(out.prompt_mask[0]).tolist() == [False] * 5 + [True] * 3


def test_group_samples_differ_and_share_one_prefill(sm):
  """G samples of one prompt come from one prefill row (see reference equality above) yet differ."""
  out = sm.generate([PROMPTS[1]], samples_per_prompt=4, strategy=S.Temperature(1.5), seed=0)
  rows = {tuple(r) for r in np.asarray(out.tokens).tolist()}
  assert len(rows) > 1
  ref_tok, _ = reference(lambda t: P0, [PROMPTS[1]], 8, S.Temperature(1.5), G=4)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref_tok)


def test_stop_conditions_and_early_exit():
  base = np.asarray(make().generate(PROMPTS, strategy=S.Greedy()).tokens)
  eos = int(base[0, 2])
  stop = tuple(int(x) for x in base[1, 3:5])
  sm = make(eos_id=eos, stop_sequences=[stop])
  out = sm.generate(PROMPTS, strategy=S.Greedy())
  toks, lens, why = np.asarray(out.tokens), np.asarray(out.lengths), np.asarray(out.finish_reason)
  for r in range(len(PROMPTS)):
    row = base[r].tolist()
    end, reason = 8, S.LENGTH
    for t in range(8):
      if row[t] == eos:
        end, reason = t + 1, S.EOS
        break
      if t >= 1 and tuple(row[t - 1:t + 1]) == stop:
        end, reason = t + 1, S.STOP
        break
    assert (lens[r], why[r]) == (end, reason), r
    np.testing.assert_array_equal(toks[r, :end], base[r, :end])
    assert np.all(toks[r, end:] == 0) and np.all(np.asarray(out.logprobs)[r, end:] == 0)
    assert np.all(np.asarray(out.versions)[r, end:] == -1)
  assert lens[0] <= 3 and why[0] == S.EOS
  assert sm.last_timings["steps"] == lens.max()
  # One row that hits EOS early: the decode loop stops there instead of running to max_new_tokens.
  one = sm.generate([PROMPTS[0]], strategy=S.Greedy())
  assert int(one.lengths[0]) == lens[0] and sm.last_timings["steps"] == lens[0] < 8


def test_padding_invariance(sm):
  """A row's output depends on its prompt, id and sample index only, not on the batch or the bucket."""
  kw = dict(samples_per_prompt=2, strategy=S.Temperature(1.0), seed=5)
  alone = sm.generate([PROMPTS[0]], prompt_ids=[11], **kw)
  mixed = sm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], prompt_ids=[3, 11, 4], **kw)
  longer = sm.generate([PROMPTS[0], list(range(1, 13))], prompt_ids=[11, 9], **kw)  # 16-token bucket
  assert longer.prompt_tokens.shape[1] == 16 and alone.prompt_tokens.shape[1] == 8
  for other, rows in ((mixed, slice(2, 4)), (longer, slice(0, 2))):
    np.testing.assert_array_equal(np.asarray(other.tokens[rows]), np.asarray(alone.tokens))
    np.testing.assert_allclose(np.asarray(other.logprobs[rows]), np.asarray(alone.logprobs), atol=1e-5)
  again = sm.generate([PROMPTS[0]], prompt_ids=[11], **kw)
  np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(alone.tokens))


def test_no_recompile_inside_buckets():
  sm = make()
  sm.generate([[1, 2, 3], [5]], strategy=S.Greedy())
  counts = dict(sm.trace_counts)
  assert counts == {"prefill": 1, "decode": 1}
  sm.generate([[1, 2, 3, 4, 5, 6, 7], [4, 4]], strategy=S.Greedy(), seed=1)  # same buckets (8, 2 rows)
  sm.update_weights(P1, version=1)  # params are jit arguments
  sm.generate([[9] * 8, [3]], strategy=S.Greedy())
  assert dict(sm.trace_counts) == counts
  sm.generate([[9] * 9, [1]], strategy=S.Greedy())  # next prompt bucket: one new compile each
  assert dict(sm.trace_counts) == {"prefill": 2, "decode": 2}


def test_long_generation_over_cache_segments():
  """Past 128 new tokens the generated cache is split in segments; output still equals the reference."""
  assert decode.segments(130) == ((0, 64), (64, 128), (128, 130))
  long = make(max_new_tokens=130, batch_size=2)
  out = long.generate(PROMPTS[:2], strategy=S.Temperature(1.0), seed=1)
  ref_tok, ref_lp = reference(lambda t: P0, PROMPTS[:2], 130, S.Temperature(1.0), seed=1)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref_tok)
  np.testing.assert_allclose(np.asarray(out.logprobs), ref_lp, atol=1e-5)


def test_weight_update_between_chunks():
  """Swapping weights before chunk 1 applies from that chunk's first token, and versions record it."""
  sm = make(max_new_tokens=9, decode_chunk=3)
  swaps = []

  def on_chunk(i, t):
    if i == 1:
      swaps.append(t)
      sm.update_weights(P1, version=1)

  out = sm.generate(PROMPTS, strategy=S.Greedy(), on_chunk=on_chunk)
  assert swaps == [3] and out.version == 1 and sm.last_timings["chunks"] == 3
  assert sm.last_timings["refills"] == 1
  assert np.all(np.asarray(out.versions) == np.asarray([0] * 3 + [1] * 6)[None])
  ref_tok, ref_lp = reference(lambda t: P0 if t < 3 else P1, PROMPTS, 9, S.Greedy())
  np.testing.assert_array_equal(np.asarray(out.tokens), ref_tok)
  np.testing.assert_allclose(np.asarray(out.logprobs), ref_lp, atol=1e-5)
  # The new weights really changed the continuation (otherwise this test proves nothing).
  old_tok, _ = reference(lambda t: P0, PROMPTS, 9, S.Greedy())
  assert not np.array_equal(old_tok[:, 3:], ref_tok[:, 3:])


def test_submesh_matches_single_device(sm):
  mesh = M.make_mesh(jax.devices()[:4], data=2, fsdp=1, tensor=2)
  single = sm.generate(PROMPTS, samples_per_prompt=2, strategy=S.TopP(0.9), seed=2)
  meshed = make(mesh=mesh, params=None)
  meshed.update_weights(P0, version=0)
  assert set(meshed._weights[0]["layers"]["q"].sharding.device_set) == set(jax.devices()[:4])
  out = meshed.generate(PROMPTS, samples_per_prompt=2, strategy=S.TopP(0.9), seed=2)
  assert len(out.tokens.sharding.device_set) == 4
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(single.logprobs), atol=1e-5)
  # Per device: batch split over data=2, KV heads over tensor=2.
  assert meshed.memory["cache"] * 4 == sm.memory["cache"]
  # One prompt x G rows fills one of the two data shards' prefill rows: it is padded, not refused.
  one = meshed.generate(PROMPTS[:1], samples_per_prompt=8, strategy=S.Greedy(), seed=2)
  np.testing.assert_array_equal(np.asarray(one.tokens),
                                np.asarray(sm.generate(PROMPTS[:1], samples_per_prompt=8, strategy=S.Greedy(),
                                                       seed=2).tokens))


def test_memory_budget_and_bad_requests(sm):
  with pytest.raises(ValueError, match=r"KV cache .* batch 16 x 24 slots.*budget is 10,000 bytes"):
    make(memory_budget_bytes=10_000)
  with pytest.raises(ValueError, match="exceeds max_prompt_len 16"):
    sm.generate([[1] * 17])
  with pytest.raises(ValueError, match="exceed batch_size 16"):
    sm.generate(PROMPTS, samples_per_prompt=5)
  with pytest.raises(ValueError, match=r"\['layers'\]\['q'\]"):
    sm.update_weights({**P0, "layers": {**P0["layers"], "q": P0["layers"]["q"][:, :4]}}, 1)


def test_lowerings_are_the_programs_generate_runs():
  """lower_prefill / lower_decode trace exactly what generate runs: generate afterwards traces nothing new."""
  mesh = M.make_mesh(jax.devices()[:4], data=2, fsdp=1, tensor=2)
  sm = make(mesh=mesh)
  held = sm._weights[0]
  for a, w in zip(jax.tree.leaves(sm.abstract_params()), jax.tree.leaves(held)):
    assert (a.shape, a.dtype, a.sharding) == (w.shape, w.dtype, w.sharding)
  assert tuple(sm.batch_sharding(2).spec) == ("data", None)
  strategy = S.TopK(4, 1.2)
  prefill = sm.lower_prefill(len(PROMPTS), 7, 2, strategy).compile()  # 7 tokens: the 8-token bucket
  sm.lower_decode(prefill, strategy).compile()
  assert dict(sm.trace_counts) == {"prefill": 1, "decode": 1}
  sm.generate(PROMPTS, samples_per_prompt=2, strategy=strategy)
  assert dict(sm.trace_counts) == {"prefill": 1, "decode": 1}


def test_weights_are_held_in_the_compute_dtype():
  """float32 params, bfloat16 compute: the parameter server's bf16 delivery is kept as is, float32 params
  are cast on the sampler mesh; both generate the same, and memory counts bf16 params."""
  from rlax.param_server import ParameterServer
  cfg = CFG.replace(param_dtype="float32", dtype="bfloat16")
  trainer_mesh = M.make_mesh(jax.devices()[:2], fsdp=2)
  sampler_mesh = M.make_mesh(jax.devices()[2:4], data=2, fsdp=1)
  params = M.create_params(cfg, trainer_mesh, seed=0)
  ps = ParameterServer(M.param_shardings(cfg, sampler_mesh), sampler_dtype=cfg.dtype)
  ps.push(params, 1)
  sm = S.Sampler(cfg, sampler_mesh, max_prompt_len=16, max_new_tokens=6, batch_size=8)
  sm.update_weights(*ps.pull())
  assert all(a is b for a, b in zip(jax.tree.leaves(sm._weights[0]), jax.tree.leaves(ps.pull()[0])))  # no copy
  pulled = sm.generate(PROMPTS, strategy=S.Greedy())
  sm.update_weights(params, 2)  # float32 on the trainer mesh
  for a, w in zip(jax.tree.leaves(sm.abstract_params()), jax.tree.leaves(sm._weights[0])):
    assert (a.dtype, a.sharding) == (w.dtype, w.sharding) and w.dtype == jnp.bfloat16
  direct = sm.generate(PROMPTS, strategy=S.Greedy())
  assert direct.version == 2 and pulled.version == 1
  np.testing.assert_array_equal(np.asarray(direct.tokens), np.asarray(pulled.tokens))
  np.testing.assert_array_equal(np.asarray(direct.logprobs), np.asarray(pulled.logprobs))
  assert sm.memory["params"] * 2 == make(params=None).memory["params"]  # bf16 (data=2 replicates params)
  with pytest.raises(ValueError, match=r"\['embed'\] is float16.*expected bfloat16 or float32"):
    sm.update_weights(jax.tree.map(lambda x: x.astype(jnp.float16), params), 3)
