"""One-turn episodes (single-turn runs): exactly plain sampling then grading, row for row and reward for reward,
one grade call per step (per `run`: one in all), no forks and no env/* metrics; held-out evaluation through them
gives the numbers text generation and grading gave."""

import dataclasses

import numpy as np

from rlax import envs
from rlax import evaluation
from rlax import sampler as S
from rlax.data.records import Record
from rlax.rollout import text as rollout_text

from harness.sampling_ref import CFG, P0, PROMPTS


class Render:
  class tokenizer:  # pylint: disable=invalid-name
    decode = staticmethod(lambda ids: " ".join(map(str, ids)))

  @staticmethod
  def encode_all(records):
    return [PROMPTS[int(r.id)] for r in records]


def reward(text, rec):  # not a dyadic fraction: float64 and float32 differ
  return len(text.split()) / 3 + (rec.source == "b") / 10, {"n": len(text.split())}


class Pool:
  def __init__(self):
    self.calls = []

  def grade(self, fn, texts, recs):
    self.calls.append(len(texts))
    return [fn(t, r) for t, r in zip(texts, recs)]


RECS = [Record(id=str(i), prompt=str(i), answer="", source="ab"[i % 2]) for i in range(len(PROMPTS))]


def make(**kw):
  return S.Sampler(CFG, **dict(dict(max_prompt_len=8, max_new_tokens=6, slots=4, decode_chunk=2, params=P0), **kw))


def test_run_is_generate_then_grade():
  sm, pool = make(), Pool()
  with envs.single_turn_episodes(Render, reward, pool.grade)(sm.stream(S.Temperature(1.0)), sync=True) as eps:
    done = eps.run(RECS, samples_per_prompt=2, seed=3, step=1, prompt_ids=[5, 6, 7, 8])
  want = rollout_text.to_host(sm.generate(Render.encode_all(RECS), samples_per_prompt=2, strategy=S.Temperature(1.0),
                                     seed=3, step=1, prompt_ids=[5, 6, 7, 8]))
  got = S.concat_outputs([f.out for f in done])
  for f in dataclasses.fields(want):
    np.testing.assert_array_equal(np.asarray(getattr(got, f.name)), np.asarray(getattr(want, f.name)), f.name)
  graded = Pool().grade(reward, rollout_text.completions(Render.tokenizer, want), [r for r in RECS for _ in range(2)])
  rewards = np.concatenate([f.rewards for f in done])
  assert rewards.dtype == np.float64 and rewards.tolist() == [g[0] for g in graded]
  assert pool.calls == [8] and [f.tag for f in done] == [0, 1, 2, 3]
  assert all(f.forks is None for f in done) and eps.stats([e for f in done for e in f.episodes]) == {}
  cut = np.asarray(want.finish_reason) == S.LENGTH
  assert [e["stop"] == "length" for f in done for e in f.episodes] == cut.tolist()
  assert [e["tokens"] for f in done for e in f.episodes] == np.asarray(want.lengths).tolist()
  assert [e["info"] for f in done for e in f.episodes] == [g[1] for g in graded]


def test_streamed_groups_are_graded_as_they_stop():
  sm, pool = make(), Pool()
  eps = envs.single_turn_episodes(Render, reward, pool.grade)(sm.stream(S.Temperature(1.0)))
  assert eps.submit(RECS, samples_per_prompt=2, seed=3, step=1, tags=["w", "x", "y", "z"]) == ["w", "x", "y", "z"]
  done = []
  while eps.pending:
    n = len(pool.calls)
    got = eps.step()
    assert len(pool.calls) == n + bool(got)  # one call per step that finished groups
    done += got
  assert sorted(f.tag for f in done) == ["w", "x", "y", "z"] and eps.reward_s > 0
  assert "slot_utilization" in eps.timings()


def test_held_out_equals_text_generation_and_grading():
  sm, pool = make(), Pool()
  res = evaluation.held_out(RECS, sampler=sm, render=Render, reward_fn=reward, pool=pool, method=S.Temperature(1.0),
                            n=2, seed=4, greedy=True)
  gen = rollout_text.text_generate_fn(sm, Render, S.Temperature(1.0), seed=4, step=0)
  greedy = rollout_text.text_generate_fn(sm, Render, S.Greedy(), seed=4, step=0)
  want = evaluation.evaluate(gen, RECS, reward, n=2, ks=(1, 2), grade_fn=Pool().grade, greedy_fn=greedy)
  assert res == want and "mean_length" in res and not any(k.startswith("env/") for k in res)
