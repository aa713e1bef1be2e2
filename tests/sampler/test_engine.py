"""The sampling engine (rlax.sampler.Sampler, dense layout) against an independent reference: a full forward (no
KV cache) per step, per row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
from rlax import sampler as S
from rlax.sampler import layouts
from rlax.weights.reshard import reshard

from harness.sampling_ref import (CFG, P0, P1, PROMPTS, assert_logprobs_match_their_versions,
                                  assert_matches_reference, assert_rows_match_reference, reference)


def make(**kw):
  args = dict(max_prompt_len=16, max_new_tokens=8, slots=4, decode_chunk=3, params=P0)
  args.update(kw)
  return S.Sampler(CFG, **args)


@pytest.fixture(scope="module")
def cs():
  return make()


@pytest.mark.parametrize("strategy", [S.Greedy(), S.Temperature(0.8), S.TopK(4, 1.2), S.TopP(0.9, 0.7, k=6)])
def test_matches_full_forward_reference_with_more_requests_than_slots(cs, strategy):
  # 4 prompts x 2 samples on 4 slots: half the rows wait for a slot.
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=strategy, seed=3, step=7)
  assert_matches_reference(out, strategy)
  assert np.all(np.asarray(out.sampled))
  # Left-padded prompts in the output, whatever the cache holds.
  np.testing.assert_array_equal(np.asarray(out.prompt_tokens[2])[-7:], PROMPTS[1])
  assert np.asarray(out.prompt_mask[0]).tolist() == [False] * 13 + [True] * 3


def test_uniform_batch_in_one_admission():
  """A batch that fits the slots is admitted at once and decoded to its limit: the old static engine's case."""
  cs = make(slots=8, decode_chunk=8)
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=3, step=7)
  assert_matches_reference(out, S.Temperature(1.0))
  t = cs.last_timings
  assert t["chunks"] == 1 and t["decode_steps"] == 7 and t["slot_utilization"] == 1.0


def test_group_samples_differ_and_share_one_prefill(cs):
  out = cs.generate([PROMPTS[1]], samples_per_prompt=4, strategy=S.Temperature(1.5), seed=0)
  assert len({tuple(r) for r in np.asarray(out.tokens).tolist()}) > 1
  ref_tok, _ = reference(lambda t: P0, [PROMPTS[1]], 8, S.Temperature(1.5), G=4)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref_tok)


def test_padding_invariance(cs):
  """A row's output depends on its prompt, id and sample index only, not on the batch around it."""
  kw = dict(samples_per_prompt=2, strategy=S.Temperature(1.0), seed=5)
  alone = cs.generate([PROMPTS[0]], prompt_ids=[11], **kw)
  mixed = cs.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], prompt_ids=[3, 11, 4], **kw)
  np.testing.assert_array_equal(np.asarray(mixed.tokens[2:4]), np.asarray(alone.tokens))
  np.testing.assert_allclose(np.asarray(mixed.logprobs[2:4]), np.asarray(alone.logprobs), atol=1e-5)


def test_per_request_limits_free_slots_for_queued_requests():
  cs = make(slots=4, decode_chunk=2)
  limits = np.asarray([1, 8, 3, 2, 8, 5, 4, 7])
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=1, max_new_tokens=limits)
  lps, _ = assert_rows_match_reference(out, limits, 8, seed=1)
  for r, n in enumerate(limits):
    assert np.all(lps[r, n:] == 0)
  t = cs.last_timings
  assert 0 < t["slot_utilization"] <= 1 and t["decode_steps"] < 2 * 8


def test_long_rows_attend_over_later_segments_only_where_they_reach():
  """A 200-token budget splits the generated cache into segments (0-32, 32-64, 64-128, 128-200): rows past the first
  segment attend over the later ones in blocks, the others skip them; all match the full forward."""
  assert layouts.segments(200) == ((0, 32), (32, 64), (64, 128), (128, 200))
  cs = make(slots=4, max_new_tokens=200, decode_chunk=16)
  limits = np.asarray([150, 3, 70, 200, 10, 130, 65, 2])
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=4, max_new_tokens=limits)
  assert_rows_match_reference(out, limits, 200, seed=4, atol=1e-4)


def test_stop_conditions_and_early_exit():
  base = np.asarray(make().generate(PROMPTS, strategy=S.Greedy()).tokens)
  eos, stop = int(base[0, 2]), tuple(int(x) for x in base[1, 3:5])
  cs = make(slots=2, eos_id=eos, stop_sequences=[stop])
  out = cs.generate(PROMPTS, strategy=S.Greedy())
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
    assert np.all(np.asarray(out.versions)[r, end:] == -1) and not np.any(np.asarray(out.sampled)[r, end:])
  assert lens[0] <= 3 and why[0] == S.EOS
  # One row that stops early: the decode loop stops there instead of running to max_new_tokens.
  one = cs.generate([PROMPTS[0]], strategy=S.Greedy())
  assert cs.last_timings["decode_steps"] == int(one.lengths[0]) - 1 < 7


def test_no_recompile_in_steady_state():
  # Compiles: a decode program per slot bucket (4, 2, 1: the tail shrinks), and a prefill + admission
  # program per admission bucket (1 or 2 groups).
  cs = make(slots=4, max_new_tokens=9)  # not the module fixture's programs: its own traces are counted

  def calls(version):
    cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Greedy(), max_new_tokens=[3, 8, 1, 2, 5, 5, 6, 7])
    cs.update_weights(P1 if version % 2 else P0, version=version)  # params are jit arguments
    cs.generate([[9] * 12, [3], [4, 4]], samples_per_prompt=2, strategy=S.Greedy(), seed=version, max_new_tokens=4)
    cs.generate(PROMPTS[::-1] * 2, samples_per_prompt=2, strategy=S.Greedy(), seed=version)

  calls(1)
  counts = cs.trace_counts  # a Counter: a program an engine before this one traced counts 0
  assert counts["decode"] <= 3 and counts["prefill"] <= 2 and counts["admit"] <= 2, counts
  assert "recompute" not in counts  # the swap happened between calls, not inside one
  calls(2)
  assert dict(cs.trace_counts) == counts
  # Another group size admits rows in other shapes; the decode program is still the same one.
  cs.generate(PROMPTS, samples_per_prompt=4, strategy=S.Greedy(), seed=6)
  cs.generate(PROMPTS[:2], samples_per_prompt=4, strategy=S.Greedy(), seed=7)
  assert cs.trace_counts["decode"] == counts["decode"] and cs.trace_counts["admit"] <= counts["admit"] + 1


@pytest.mark.parametrize("on_swap", ["recompute", "keep"])
def test_weight_swap_mid_generation_keeps_each_tokens_version_and_logprob(on_swap):
  """Rows in flight continue under new weights; every token records the version that drew it."""
  cs = make(slots=4, decode_chunk=3, max_new_tokens=9, on_swap=on_swap)

  def on_chunk(i, _):
    if i == 1:
      cs.update_weights(P1, version=1)

  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=2, on_chunk=on_chunk)
  ver = np.asarray(out.versions)
  assert out.version == 1 and cs.last_timings["swaps"] == 1
  assert set(np.unique(ver).tolist()) == {0, 1}
  assert np.all(np.diff(ver, axis=1) >= 0)  # per row: old version first, then new
  assert np.any(ver[:, 0] == 1)  # rows admitted after the swap start under it
  if on_swap == "keep":
    return
  # Recompute: each token's behaviour log-prob is exactly its version's policy, teacher-forced.
  assert_logprobs_match_their_versions(out, {0: P0, 1: P1})


def test_weights_source_is_read_not_held(cs):
  """The engine holds no weights: a (params, version) pair or any source's latest() is what a call uses."""
  a = cs.generate(PROMPTS, strategy=S.Greedy(), weights=(P1, 7))
  assert a.version == 7 and cs.version == 0
  ref_tok, _ = reference(lambda t: P1, PROMPTS, 8, S.Greedy())
  np.testing.assert_array_equal(np.asarray(a.tokens), ref_tok)
  with pytest.raises(ValueError, match="no weights"):
    make(params=None).generate(PROMPTS)


def test_submesh_matches_single_device(cs):
  mesh = M.make_mesh(jax.devices()[:4], data=2, fsdp=1, tensor=2)
  single = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.TopP(0.9), seed=2)
  meshed = make(mesh=mesh)
  params, _ = meshed.weights.latest()
  assert set(params["layers"]["q"].sharding.device_set) == set(jax.devices()[:4])
  out = meshed.generate(PROMPTS, samples_per_prompt=2, strategy=S.TopP(0.9), seed=2)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(single.logprobs), atol=1e-5)
  # Per device: slots split over data=2, KV heads over tensor=2.
  assert meshed.memory["cache"] * 4 == cs.memory["cache"]


def test_weights_are_held_in_the_compute_dtype():
  """float32 params, bfloat16 compute: the reshard's bf16 delivery is published as is, float32 params are cast on
  the sampler mesh; both generate the same, and memory counts bf16 params."""
  cfg = CFG.replace(param_dtype="float32", dtype="bfloat16")
  trainer_mesh = M.make_mesh(jax.devices()[:2], fsdp=2)
  sampler_mesh = M.make_mesh(jax.devices()[2:4], data=2, fsdp=1)
  params = M.create_params(cfg, trainer_mesh, seed=0)
  pushed, _ = reshard(params, M.param_shardings(cfg, sampler_mesh), cfg.dtype)
  sm = S.Sampler(cfg, sampler_mesh, max_prompt_len=16, max_new_tokens=6, slots=8)
  sm.update_weights(pushed, 1)
  assert all(a is b for a, b in zip(jax.tree.leaves(sm.weights.latest()[0]), jax.tree.leaves(pushed)))  # no copy
  got = sm.generate(PROMPTS, strategy=S.Greedy())
  sm.update_weights(params, 2)  # float32 on the trainer mesh
  for a, w in zip(jax.tree.leaves(sm.abstract_params()), jax.tree.leaves(sm.weights.latest()[0])):
    assert (a.dtype, a.sharding) == (w.dtype, w.sharding) and w.dtype == jnp.bfloat16
  direct = sm.generate(PROMPTS, strategy=S.Greedy())
  assert direct.version == 2 and got.version == 1
  np.testing.assert_array_equal(np.asarray(direct.tokens), np.asarray(got.tokens))
  np.testing.assert_array_equal(np.asarray(direct.logprobs), np.asarray(got.logprobs))
  assert sm.memory["params"] * 2 == make(params=None).memory["params"]  # bf16 (data=2 replicates params)
  with pytest.raises(ValueError, match=r"\['embed'\] is float16.*expected bfloat16 or float32"):
    sm.update_weights(jax.tree.map(lambda x: x.astype(jnp.float16), params), 3)


def test_lowerings_are_the_programs_a_stream_runs():
  """abstract_state / lower_admit / lower_decode / lower_fuse trace exactly what generate runs: it then traces
  nothing new."""
  mesh = M.make_mesh(jax.devices()[:4], data=2, fsdp=1, tensor=2)
  sm = make(mesh=mesh, slots=8, max_new_tokens=7)  # programs no other engine of this process runs (but `fuse`)
  empty = sm.empty()
  for a, x in zip(jax.tree.leaves(sm.abstract_state()), jax.tree.leaves(empty)):
    assert (a.shape, a.dtype, a.sharding) == (x.shape, x.dtype, x.sharding)
  strategy = S.TopK(4, 1.2)
  lowered = sm.lower_admit(4, 2, strategy)
  lowered["prefill"].compile(), lowered["admit"].compile()
  sm.lower_decode(strategy).compile()
  sm.lower_fuse().compile()
  programs = dict(sm.trace_counts)  # each traced once (`fuse` is shared with the submesh test's engine)
  assert {"prefill": 1, "admit": 1, "decode": 1}.items() <= programs.items() <= {**programs, "fuse": 1}.items()
  sm.generate(PROMPTS, samples_per_prompt=2, strategy=strategy)
  assert dict(sm.trace_counts) == programs


def test_bad_requests_and_memory_budget():
  cs = make(slots=4)
  with pytest.raises(ValueError, match="samples_per_prompt=3 must be >= 1 and divide slots=4"):
    cs.generate(PROMPTS, samples_per_prompt=3)
  with pytest.raises(ValueError, match=r"max_new_tokens must lie in \[1, 8\]"):
    cs.generate(PROMPTS, max_new_tokens=9)
  with pytest.raises(ValueError, match="exceeds max_prompt_len 16"):
    cs.generate([[1] * 17])
  with pytest.raises(ValueError, match="on_swap"):
    make(on_swap="later")
  with pytest.raises(ValueError, match=r"\['layers'\]\['q'\]"):
    cs.update_weights({**P0, "layers": {**P0["layers"], "q": P0["layers"]["q"][:, :4]}}, 1)
  with pytest.raises(ValueError, match=r"KV cache .* for 4 slots x 24 tokens.*budget is 10,000 bytes"):
    make(memory_budget_bytes=10_000)
  with pytest.raises(ValueError, match="attention must be one of"):
    make(attention="pallas")
