"""The engine over the paged cache layout (`Sampler(attention="paged" | "paged_interpret")`) against the
full-forward reference: the same tokens as the dense layout, drawn with the same uniforms."""

import jax
import numpy as np
import pytest

from rlax import models as M
from rlax import sampler as S

from harness.sampling_ref import (CFG, P0, P1, PROMPTS, assert_logprobs_match_their_versions,
                                  assert_matches_reference, assert_rows_match_reference, reference)

LIMITS = np.asarray([1, 8, 3, 2, 8, 5, 4, 7])


def make(**kw):
  # 4-token pages: a slot's 16 prompt + 8 new positions span 6 pages, so writes and reads cross page edges.
  args = dict(max_prompt_len=16, max_new_tokens=8, slots=4, decode_chunk=2, params=P0, attention="paged",
              page_size=4)
  args.update(kw)
  return S.Sampler(CFG, **args)


@pytest.fixture(scope="module")
def cs():
  # On a 2 x 2 submesh: slots and pages split over 'data' (page ids local to a shard's pool), KV heads over
  # 'tensor'; the interpret-mode test below covers a single device.
  return make(mesh=M.make_mesh(jax.devices()[:4], data=2, fsdp=1, tensor=2))


def _check_limits(cs, limits=LIMITS):
  """4 prompts x 2 samples on 4 slots with per-row limits: queued rows take the slots short rows free."""
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=1, max_new_tokens=limits)
  return assert_rows_match_reference(out, limits, 8, seed=1, atol=None)


def test_paged_path_matches_reference_with_more_requests_than_slots(cs):
  assert cs.paged and cs.attention == "paged" and cs.version == 0
  np.testing.assert_array_equal(np.asarray(cs.empty().cache.page_table)[:, 0], [0, 6, 0, 6])
  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.TopP(0.9, 0.7, k=6), seed=3, step=7)
  assert_matches_reference(out, S.TopP(0.9, 0.7, k=6))
  lps, ref_lp = _check_limits(cs)
  for r, n in enumerate(LIMITS):
    np.testing.assert_allclose(lps[r, :n], ref_lp[r, :n], atol=1e-5)
    assert np.all(lps[r, n:] == 0)
  assert 0 < cs.last_timings["slot_utilization"] <= 1


def test_pallas_kernel_in_interpret_mode_matches_reference():
  """The Pallas TPU paged_attention kernel (interpret mode on CPU; head_dim 8 is fine there, the Mosaic
  compiler would want 128). The kernel loads K/V pages as bfloat16, so log-probs agree to bf16 precision;
  the sampled tokens (sharp logits) are the reference's."""
  # Fewer steps than the other tests (interpret mode is slow on CPU); 8-token pages: 3 per slot, one block.
  limits = np.minimum(LIMITS, 5)
  lps, ref_lp = _check_limits(make(attention="paged_interpret", max_new_tokens=5, page_size=8), limits)
  err = max(float(np.max(np.abs(lps[r, :n] - ref_lp[r, :n]))) for r, n in enumerate(limits))
  assert err < 3e-2, err


def test_weight_swap_recompute_refills_the_pages(cs):
  """on_swap="recompute": the running rows' pages are rewritten under the new weights, so every token's
  log-prob is exactly its version's teacher-forced log-prob."""
  versions = [(cs.placer(P0), 0)]

  def on_chunk(i, _):
    if i == 1:
      versions.append((cs.placer(P1), 1))

  out = cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=2, on_chunk=on_chunk,
                    weights=lambda: versions[-1])
  ver = np.asarray(out.versions)
  assert cs.last_timings["swaps"] == 1 and set(np.unique(ver).tolist()) == {0, 1}
  assert np.all(np.diff(ver, axis=1) >= 0)
  assert np.any((ver[:, 0] == 0) & (ver[:, -1] == 1))  # some row was decoding across the swap
  assert_logprobs_match_their_versions(out, {0: P0, 1: P1})


def test_cancelled_slots_are_refilled_for_queued_groups(cs):
  """cancel_older frees the stale rows' slots mid-decode; the queued groups admitted into them (their pages
  rewritten from their own prefill) match the reference under the new weights."""
  versions = [(cs.placer(P0), 0)]
  stream = cs.stream(S.Temperature(1.0), weights=lambda: versions[-1])
  stream.submit(PROMPTS, samples_per_prompt=2, seed=5)
  assert stream.step() == [] and stream.queued == 2
  versions.append((cs.placer(P1), 1))
  assert stream.cancel_older(1) == [0, 1]
  done = {}
  while stream.pending:
    done.update((g.tag, g.out) for g in stream.step())
  assert sorted(done) == [2, 3]
  ref_tok, ref_lp = reference(lambda t: P1, PROMPTS[2:], 8, S.Temperature(1.0), seed=5, prompt_ids=[2, 3], G=2)
  for i, tag in enumerate((2, 3)):
    out = done[tag]
    np.testing.assert_array_equal(out.tokens, ref_tok[2 * i:2 * i + 2])
    np.testing.assert_allclose(out.logprobs, ref_lp[2 * i:2 * i + 2], atol=1e-5)
    assert np.all(out.versions == 1)


def test_no_recompile_in_steady_state(cs):
  # The paged layout keeps its slots (no shrink): one decode program per sampling strategy (a static argument of
  # decode and admit; earlier tests used others), a prefill and an admit per admission bucket (1 or 2 groups).
  before = cs.trace_counts
  cs.generate(PROMPTS, samples_per_prompt=2, strategy=S.Greedy(), max_new_tokens=[3, 8, 1, 2, 5, 5, 6, 7])
  counts = cs.trace_counts
  new = counts - before
  assert new["decode"] <= 1 and new["prefill"] <= 2 and new["admit"] <= 2, (before, counts)
  assert new["shrink"] == new["grow"] == 0  # the paged pool is not laid out by slot: it never shrinks
  kw = dict(samples_per_prompt=2, strategy=S.Greedy(), seed=4, weights=(cs.placer(P1), 5))
  cs.generate([[9] * 12, [3], [4, 4]], max_new_tokens=4, **kw)
  cs.generate(PROMPTS[::-1] * 2, **kw)
  assert dict(cs.trace_counts) == counts


def test_attention_choice():
  assert make(attention="dense").paged is False
  auto = make(attention="auto")
  # Off TPU (or for head_dim % 128 != 0) "auto" keeps the dense XLA path.
  assert auto.attention == ("paged" if jax.default_backend() == "tpu" and CFG.head_dim % 128 == 0 else "dense")
  assert not make().shrink
  with pytest.raises(ValueError, match="attention must be one of"):
    make(attention="pallas")
