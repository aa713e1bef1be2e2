"""EpisodeStream: multi-turn rows hold exactly the sampled and appended segments in order; the trainer's
recomputed log-probs equal the sampler's on sampled tokens (padded and packed rows); per-token versions
across a weight swap; one-turn episodes equal plain sampling; staleness acts per episode; the context budget."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import envs
from rlax import sampler as S
from rlax.rollout import packing
from rlax.trainer import layouts

from harness.sampling_ref import CFG, P0, P1, PROMPTS

REPLIES = [[7, 8, 9], [11, 12]]  # the environment's two answers
FIRST, THEN = 3, 4


class Scripted(envs.Environment):
  """Answers the first len(REPLIES) turns with REPLIES, then ends with reward = number of turns seen."""

  def __init__(self, seen=None, delay=0.0, replies=REPLIES):
    self.seen, self.delay, self.replies = seen if seen is not None else [], delay, replies

  async def reset(self, record):
    return envs.Observation(PROMPTS[record], max_new_tokens=FIRST)

  async def step(self, turn):
    self.seen.append(turn)
    if self.delay:
      await asyncio.sleep(self.delay)
    if turn.index < len(self.replies):
      return envs.StepResult(tokens=self.replies[turn.index], max_new_tokens=THEN, calls=("ok",))
    return envs.StepResult(reward=float(turn.index + 1), done=True, stop_reason="final_answer")


def make(**kw):
  args = dict(max_prompt_len=8, max_new_tokens=24, slots=4, decode_chunk=3, params=P0)
  args.update(kw)
  return S.Sampler(CFG, **args)


def run(sampler, make_env, records, G=2, weights=None, sync=True, **kw):
  with envs.EpisodeStream(sampler.stream(S.Temperature(1.0), weights=weights), make_env, sync=sync, **kw) as eps:
    return eps.run(records, samples_per_prompt=G, seed=3, step=1)


@pytest.fixture(scope="module")
def episodes():
  seen = []
  return run(make(), lambda: Scripted(seen), [0, 1]), seen


def test_row_is_sampled_and_appended_segments_in_order(episodes):
  done, seen = episodes
  n = FIRST + sum(len(r) + THEN for r in REPLIES)
  for f in done:
    assert f.rewards.tolist() == [3.0, 3.0]
    for i in range(2):
      toks, smp, lp = (np.asarray(x)[i] for x in (f.out.tokens, f.out.sampled, f.out.logprobs))
      assert int(f.out.lengths[i]) == n
      want = np.zeros(n, bool)
      want[:FIRST] = True
      at = FIRST
      for r in REPLIES:
        np.testing.assert_array_equal(toks[at:at + len(r)], r)  # appended verbatim
        at += len(r)
        want[at:at + THEN] = True
        at += THEN
      np.testing.assert_array_equal(smp[:n], want)
      assert np.all(lp[:n][~want] == 0) and np.all(lp[:n][want] < 0)
      assert [e["turns"] for e in f.episodes] == [3, 3] and f.episodes[i]["appended"] == 5
  # Every turn handed to the environment is a sampled segment of its row, verbatim.
  assert len(seen) == 2 * 2 * 3
  assert all(t.key is None for t in seen)
  for t in seen:
    assert len(t.tokens) == (FIRST if t.index == 0 else THEN) and t.finish_reason == "length"
    assert np.all(t.logprobs < 0) and np.all(t.versions == 0)


def test_training_turns_carry_their_key():
  """keys=True (training): each turn's key is (seed, step, prompt id, sample, turn), what a resumed run
  regenerates it under; without keys (evaluation) it is None."""
  seen = []
  with envs.EpisodeStream(make().stream(S.Temperature(1.0)), lambda: Scripted(seen), sync=True, keys=True) as eps:
    eps.run([0, 1], samples_per_prompt=2, seed=3, step=7, prompt_ids=[10, 11])
  assert sorted(t.key for t in seen) == [(3, 7, p, i, k) for p in (10, 11) for i in range(2) for k in range(3)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_trainer_logprobs_equal_sampler_on_sampled_tokens(episodes, packed):
  done, _ = episodes
  out = S.concat_outputs([f.out for f in done])
  batch = packing.pack(out, np.concatenate([f.rewards for f in done]), 8)
  lm = np.asarray(batch.loss_mask)
  assert lm.sum() == 4 * (FIRST + 2 * THEN)  # exactly the sampled tokens
  b = packing.pack_tokens(batch, 64) if packed else batch
  layout = layouts.of(b)
  got = np.asarray(layout.logprobs(P0, CFG, layout.inputs(jax.tree.map(jnp.asarray, b)), chunk=256,
                                   temperature=1.0))
  if packed:
    got = packing.unpack_slots(got, b, batch)
  np.testing.assert_allclose(got * lm, np.asarray(batch.behaviour_logprobs) * lm, atol=1e-4)


def test_versions_per_token_across_a_weight_swap_between_turns():
  box = {"w": (P0, 0)}
  seen = []

  class Swap(Scripted):
    async def step(self, turn):
      if turn.index == 0:
        box["w"] = (P1, 1)  # the trainer published version 1 while the environment answered
      return await super().step(turn)

  done = run(make(), lambda: Swap(seen), [0], G=1, weights=lambda: box["w"])
  ver = np.asarray(done[0].out.versions)[0]
  assert np.all(ver[:FIRST] == 0) and np.all(ver[FIRST + 3:FIRST + 3 + THEN] == 1)
  batch = packing.pack(done[0].out, done[0].rewards, 8)
  assert int(batch.versions[0]) == 0  # the episode is as old as its oldest token


def test_one_turn_episodes_equal_plain_sampling():
  class Ctx:  # the parts SingleTurnEnv reads
    class render:
      encode = staticmethod(lambda rec: PROMPTS[rec])

    class tokenizer:
      decode = staticmethod(lambda ids: " ".join(map(str, ids)))

    reward_fn = staticmethod(lambda text, rec: (float(len(text.split())), {}))
    grade = staticmethod(lambda fn, texts, recs: [fn(t, r) for t, r in zip(texts, recs)])

  sm = make(max_new_tokens=6)
  done = run(sm, lambda: envs.SingleTurnEnv(Ctx), [0, 1, 2], G=2)
  want = sm.generate([PROMPTS[i] for i in range(3)], samples_per_prompt=2, strategy=S.Temperature(1.0), seed=3,
                     step=1, prompt_ids=[0, 1, 2])
  got = S.concat_outputs([f.out for f in done])
  for k in ("tokens", "logprobs", "lengths", "sampled"):
    np.testing.assert_array_equal(np.asarray(getattr(got, k)), np.asarray(getattr(want, k)), err_msg=k)
  assert np.concatenate([f.rewards for f in done]).tolist() == [6.0] * 6


def test_a_waiting_environment_never_stalls_other_episodes():
  """Record 0's environment blocks until released; record 1's episodes run to their end meanwhile."""
  gate = asyncio.Event()

  class Blocked(Scripted):
    async def step(self, turn):
      if self.record == 0:
        await gate.wait()
      return await super().step(turn)

    async def reset(self, record):
      self.record = record
      return await super().reset(record)

  eps = envs.EpisodeStream(make().stream(S.Temperature(1.0)), lambda: Blocked(), sync=False)
  try:
    eps.submit([0, 1], samples_per_prompt=2, tags=[0, 1])
    first = []
    while not first:
      first = eps.step()
    assert [f.tag for f in first] == [1] and eps.pending == 1
    eps._loop.call_soon_threadsafe(gate.set)
    rest = []
    while eps.pending:
      rest += eps.step()
    assert [f.tag for f in rest] == [0] and rest[0].rewards.tolist() == [3.0, 3.0]
  finally:
    eps._loop.call_soon_threadsafe(gate.set)
    eps.close()


def test_context_budget_clamps_turns_and_ends_episodes():
  # prompt 3 + turn 3 + reply 3 + turn 4 = 13 of a 16-token budget: a 2-token reply leaves a 1-token turn ...
  seen = []
  f, = run(make(), lambda: Scripted(seen, replies=[[7, 8, 9], [11, 12]]), [0], G=1, context_tokens=16)
  assert f.episodes[0]["stop"] == "final_answer" and len(seen[-1].tokens) == 1 and seen[-1].context_left == 0
  assert int(f.out.lengths[0]) == 16 - 3
  # ... and a 3-token reply leaves no room for a turn: the episode ends, unrewarded, its reply not appended
  f, = run(make(), lambda: Scripted(replies=[[7, 8, 9], [11, 12, 13]]), [0], G=1, context_tokens=16)
  assert f.episodes[0]["stop"] == "context_full" and f.rewards.tolist() == [0.0]
  assert int(f.out.lengths[0]) == 3 + 3 + 4


def test_stale_groups_are_cancelled_per_episode_even_while_awaiting_the_environment():
  sm = make()
  gate = asyncio.Event()

  class Slow(Scripted):
    async def step(self, turn):
      await gate.wait()
      return await super().step(turn)

  eps = envs.EpisodeStream(sm.stream(S.Temperature(1.0)), lambda: Slow(), sync=False)
  try:
    eps.submit([0, 1], samples_per_prompt=2, tags=["a", "b"])
    while len(eps._waiting) < 4:  # every row stopped and waits for its environment
      eps.step()
    assert eps.cancel_older(1) in (["a", "b"], ["b", "a"])
    assert not eps.pending and np.all(eps.stream.owner < 0)
  finally:
    eps._loop.call_soon_threadsafe(gate.set)
    eps.close()


def test_bad_environment_prompts_are_one_clear_error():
  class Long(Scripted):
    async def reset(self, record):
      return envs.Observation(list(range(1, 12)))
  with pytest.raises(ValueError, match="max_prompt_len is 8"):
    run(make(), lambda: Long(), [0], G=1)
  k = iter(range(100))

  class Differs(Scripted):
    async def reset(self, record):
      return envs.Observation([1, 2 + next(k)])
  with pytest.raises(ValueError, match="different first prompts"):
    run(make(), lambda: Differs(), [0], G=2)
