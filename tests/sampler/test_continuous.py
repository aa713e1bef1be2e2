"""Continuous batching (rlax.sampler.continuous) against the full-forward reference and the static engine."""

import jax
import numpy as np
import pytest

from rlax import models as M
from rlax import sampler as S

from harness.sampling_ref import (CFG, P0, P1, PROMPTS, assert_logprobs_match_their_versions,
                                  assert_matches_reference, assert_rows_match_reference)


def make(**kw):
  args = dict(max_prompt_len=16, max_new_tokens=8, slots=4, decode_chunk=3, params=P0)
  args.update(kw)
  return S.ContinuousSampler(CFG, **args)


@pytest.fixture(scope="module")
def cs():
  return make()


@pytest.mark.parametrize("strategy", [S.Greedy(), S.Temperature(0.8), S.TopP(0.9, 0.7, k=6)])
def test_matches_full_forward_reference_with_more_requests_than_slots(cs, strategy):
  # 4 prompts x 2 samples on 4 slots: half the rows wait for a slot.
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=strategy, seed=3, step=7)
  assert_matches_reference(out, strategy)


def test_per_request_limits_free_slots_for_queued_requests():
  cs = make(slots=4, decode_chunk=2)
  limits = np.asarray([1, 8, 3, 2, 8, 5, 4, 7])
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=1, max_new_tokens=limits)
  lps, _ = assert_rows_match_reference(out, limits, 8, seed=1)
  for r, n in enumerate(limits):
    assert np.all(lps[r, n:] == 0)
  # Useful work over slot-steps: short rows hand their slots on instead of idling to the longest.
  t = cs.last_timings
  assert 0 < t["slot_utilization"] <= 1 and t["decode_steps"] < 2 * 8


def test_long_rows_attend_over_later_segments_only_where_they_reach():
  """A 200-token budget splits the generated cache into segments (0-64, 64-128, 128-200): rows past the first
  segment attend over the later ones in blocks, the others skip them; all match the full forward."""
  cs = make(slots=4, max_new_tokens=200, decode_chunk=16)
  limits = np.asarray([150, 3, 70, 200, 10, 130, 65, 2])
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=4, max_new_tokens=limits)
  assert_rows_match_reference(out, limits, 200, seed=4, atol=1e-4)


def test_eos_and_stop_sequences_match_the_static_engine():
  base = np.asarray(S.Sampler(CFG, max_prompt_len=16, max_new_tokens=8, batch_size=16, params=P0)
                    .generate(PROMPTS, strategy=S.Greedy()).tokens)
  eos, stop = int(base[0, 2]), tuple(int(x) for x in base[1, 3:5])
  kw = dict(eos_id=eos, stop_sequences=[stop])
  static = S.Sampler(CFG, max_prompt_len=16, max_new_tokens=8, batch_size=16, params=P0, **kw)
  want = static.generate(PROMPTS, strategy=S.Greedy())
  got = make(slots=2, **kw).generate(PROMPTS, strategy=S.Greedy())
  for f in ("tokens", "lengths", "finish_reason", "versions"):
    np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)), err_msg=f)
  assert int(got.lengths[0]) <= 3 and int(got.finish_reason[0]) == S.EOS


def test_no_recompile_in_steady_state():
  # Compiles: a decode program per slot bucket (4, 2, 1: the tail shrinks), and a prefill + admission
  # program per admission bucket (1 or 2 groups).
  cs = make(slots=4)

  def calls(seed):
    cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Greedy(), max_new_tokens=[3, 8, 1, 2, 5, 5, 6, 7])
    cs.update_weights(P1, version=seed)  # params are jit arguments
    cs.generate([[9] * 12, [3], [4, 4]], samples_per_prompt=2, strategy=S.Greedy(), seed=seed, max_new_tokens=4)
    cs.generate(PROMPTS[::-1] * 2, samples_per_prompt=2, strategy=S.Greedy(), seed=seed)

  calls(1)
  counts = dict(cs.trace_counts)
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


def test_submesh_matches_single_device(cs):
  mesh = M.make_mesh(jax.devices()[:4], data=2, fsdp=1, tensor=2)
  single = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.TopP(0.9), seed=2)
  meshed = make(mesh=mesh)
  out = meshed.generate(PROMPTS, samples_per_prompt=2, strategy=S.TopP(0.9), seed=2)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(single.logprobs), atol=1e-5)


def test_bad_requests():
  cs = make(slots=4)
  with pytest.raises(ValueError, match="samples_per_prompt=3 must be >= 1 and divide slots=4"):
    cs.generate(PROMPTS, samples_per_prompt=3)
  with pytest.raises(ValueError, match=r"max_new_tokens must lie in \[1, 8\]"):
    cs.generate(PROMPTS, max_new_tokens=9)
  with pytest.raises(ValueError, match="on_swap"):
    make(on_swap="later")


def test_slots_sized_from_the_memory_budget():
  kw = dict(max_prompt_len=16, max_new_tokens=112, unit=4, cap=1000)
  one = S.ContinuousSampler.slots_that_fit(CFG, **kw, memory_budget_bytes=1 << 40)
  assert one == 1000 // 4 * 4  # plenty of memory: the cap
  # Per 4 slots: keys + values of 2 layers x 2 kv heads x 128 positions x 8 dims x 4 bytes, twice (the cache
  # and its recompute transient); params f32.
  per_unit = 4 * 2 * 2 * 2 * 128 * 8 * 4 * 2
  params = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(P0))
  got = S.ContinuousSampler.slots_that_fit(CFG, **kw, memory_budget_bytes=params + 3 * per_unit + 1)
  assert got == 12
  with pytest.raises(ValueError, match="one group of 4 slots x 128 tokens needs"):
    S.ContinuousSampler.slots_that_fit(CFG, **kw, memory_budget_bytes=params + per_unit - 1)
