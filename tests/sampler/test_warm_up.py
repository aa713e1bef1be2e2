"""Sampler.warm_up compiles every program a stream can call: after it, streams of any group count, any tail
length and any extension compile nothing (the engine's trace counts stay put); on a mesh too, and a second
engine of the same programs (a rebuilt sampler) compiles nothing at all."""

import collections

import jax
import numpy as np

from rlax import models as M
from rlax import sampler as S
from rlax.run.compiles import CompileCounter

from harness.sampling_ref import CFG, P0, PROMPTS

ENV = [[7, 8, 9], [11], [5, 6, 4, 3, 2]]


def test_no_program_traced_after_the_warm_up():
  cs = S.Sampler(CFG, max_prompt_len=8, max_new_tokens=24, slots=16, decode_chunk=3, params=P0)
  greedy, temp = S.Greedy(), S.Temperature(1.0)
  cs.warm_up(cs.weights_source()()[0], ((2, temp), (1, greedy)), extend=True)
  before = dict(cs.trace_counts)
  rng = np.random.default_rng(0)
  for i in range(3):  # different prompt counts and lengths: admissions, tails and shrinks of every size
    n = int(rng.integers(1, 9))
    prompts = [PROMPTS[j % len(PROMPTS)] for j in range(n)]
    cs.generate(prompts, samples_per_prompt=2, strategy=temp, seed=i,
                max_new_tokens=[int(x) for x in rng.integers(1, 24, 2 * n)])
  cs.generate(PROMPTS, samples_per_prompt=1, strategy=greedy)
  stream = cs.stream(greedy)
  stream.submit(PROMPTS, samples_per_prompt=1, max_new_tokens=3, hold=True)
  turns = {}
  while stream.pending:  # multi-turn: each row extended by replies of 3, 1 and 5 tokens
    for g in stream.step():
      (req,) = g.requests
      k = turns.get(g.tag, 0)
      if k == len(ENV):
        stream.release(req)
        continue
      assert stream.extend(req, ENV[k], max_new_tokens=2)
      turns[g.tag] = k + 1
  assert dict(cs.trace_counts) == before


def test_on_a_mesh_the_tails_compile_nothing_and_a_twin_engine_nothing_at_all():
  """The stream's shrinks and cancels pass host indices: the warm-up's calls are the same programs."""
  mesh = M.make_mesh(jax.devices()[:4], data=4, fsdp=1, tensor=1)
  make = lambda: S.Sampler(CFG, mesh, max_prompt_len=8, max_new_tokens=24, slots=16, decode_chunk=3, params=P0)
  temp = S.Temperature(1.0)
  cs = make()
  cs.warm_up(cs.weights_source()()[0], ((2, temp),))
  before = cs.trace_counts
  for i, n in enumerate((8, 3, 1)):  # tails of every slot bucket (16, 8, 4)
    cs.generate((PROMPTS * 2)[:n], samples_per_prompt=2, strategy=temp, seed=i, max_new_tokens=[1, 23] * n)
  stream = cs.stream(temp)
  stream.submit(PROMPTS[:4], samples_per_prompt=2, max_new_tokens=20)
  stream.step()
  stream.cancel_older(cs.version + 1)  # every running row stops
  assert cs.trace_counts == before
  compiles = CompileCounter()  # JAX's own compile events, whichever program
  twin = make()
  twin.warm_up(twin.weights_source()()[0], ((2, temp),))
  twin.generate(PROMPTS[:3], samples_per_prompt=2, strategy=temp, max_new_tokens=[1, 23] * 3)
  assert not twin.trace_counts and compiles.delta()[0] == 0, (twin.trace_counts, compiles.names())


def test_prompt_buckets_prefill_short_prompts_narrow_and_sample_the_same():
  """prompt_factor=2 with max_prompt_len=80: prefills of 32, 64 or 80 tokens, all warmed up; the rows drawn equal
  those of the engine that prefills every prompt at 80 (greedy tokens; log-probs to float error)."""
  make = lambda f: S.Sampler(CFG, max_prompt_len=80, max_new_tokens=6, slots=8, decode_chunk=3, params=P0,
                             prompt_factor=f)
  wide, narrow = make(0), make(2)
  assert wide.prompt_buckets == (80,) and narrow.prompt_buckets == (32, 64, 80)
  greedy = S.Greedy()
  narrow.warm_up(narrow.weights_source()()[0], ((2, greedy),))
  before = narrow.trace_counts
  prompts = PROMPTS + [list(range(1, 50)), list(range(3, 80))]  # widths 32, 64 and 80
  a, b = (e.generate(prompts, samples_per_prompt=2, strategy=greedy) for e in (wide, narrow))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)
  assert narrow.trace_counts == before


def test_row_keys_of_any_row_count_within_a_power_of_two_compile_once():
  """The rows are padded on the host and the padding cut there: 1..8 rows are one program, each row's key the
  reference fold_in chain."""
  from rlax.sampler import rows as rows_lib
  rows_lib.row_key_data(3, 2, [0], [0])
  compiles = CompileCounter()
  got = [rows_lib.row_key_data(3, 2, np.arange(n) * 5, np.arange(n) % 2) for n in range(1, 9)]
  assert compiles.delta()[0] == 0, compiles.names()
  base = jax.random.fold_in(jax.random.key(3), 2)
  want = [np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.fold_in(base, 5 * i), i % 2)))
          for i in range(8)]
  for n, keys in enumerate(got, 1):
    np.testing.assert_array_equal(keys, np.stack(want[:n]))


def test_the_warm_up_compiles_the_programs_its_plan_counts():
  """`warmup.programs` (what rlax.compiled counts, no engine built) are the programs the warm-up compiles: JAX's own
  compile events, multi-turn, two sampling methods, two prompt widths (the eager operations a process compiles
  once, `stage`, aside)."""
  from rlax.sampler import warmup
  cs = S.Sampler(CFG, max_prompt_len=40, max_new_tokens=18, slots=8, decode_chunk=3, params=P0, prompt_factor=2)
  uses = ((2, S.Temperature(0.7)), (1, S.Greedy()))
  sizes = warmup.sizes(8, 1, paged=False, on_swap="recompute", max_prompt_len=40, max_new_tokens=18, prompt_factor=2)
  assert (sizes.slot_buckets, sizes.prompt_widths, sizes.group_buckets(2)) == ((1, 2, 4, 8), (32, 40), (1, 2, 4))
  planned = warmup.programs(sizes.calls(uses, extend=True))
  assert sizes == cs.sizes and planned == warmup.programs(cs.warm_up_calls(uses, extend=True))
  # Per slot bucket: a state, 2 decodes, a recompute, a cancel; a shrink to the next smaller (3) and a grow (3);
  # extensions: rows 1, 2, 4, 8 x block 8 (an append is at most 16 tokens); prefills: 1, 2, 4, 8 prompts x 2
  # widths (G=2 shares G=1's); admits: 3 (G=2) + 4 (G=1); the fuse.
  assert len(planned) == 4 * 5 + 3 + 3 + 4 + 4 * 2 + 3 + 4 + 1
  params = cs.weights_source()()[0]
  jax.random.key_data(jax.random.key(0))  # the warm-up's key: compiled once a process, not the engine's
  cs.fused(params)  # the weights' fuse: one per model, whichever engine compiled it first
  compiles = CompileCounter()
  cs.warm_up(params, uses, extend=True)
  compiles.delta()
  names = collections.Counter(n.split(" on ")[0] for n in compiles.names() if not n.startswith("jit(stage)"))
  assert names == collections.Counter(f"jit({p[0] if p[0] != 'state' else 'empty'})" for p in planned
                                 if p != ("fuse",))
