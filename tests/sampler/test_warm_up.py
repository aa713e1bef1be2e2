"""Sampler.warm_up compiles every program a stream can call: after it, streams of any group count, any tail
length and any extension compile nothing (the engine's trace counts stay put)."""

import numpy as np

from rlax import sampler as S

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
