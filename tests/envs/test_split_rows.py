"""Episodes split into rows where the template is not append-only: the environment re-renders the
conversation (`StepResult.prompt`), the episode goes on in a new row after it, and trains as one sequence of
its rows in order. The trainer's recomputed log-probs equal the sampler's on every sampled token of both rows;
an episode stays one sequence (group baselines count episodes, REINFORCE++'s KL to go runs across its rows);
renderers and environments re-render exactly what the template writes."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms
from rlax import envs
from rlax import sampler as S
from rlax.envs import episodes as episodes_lib
from rlax.envs import renderers
from rlax.rollout import packing
from rlax.trainer import layouts

from chat_tokenizers import DROPS_REASONING, chat, ids, tokenizer
from harness.sampling_ref import CFG, P0, PROMPTS

FIRST, THEN, X = 3, 4, [7, 8]
ALONE_PROMPT = [1, 30, 31, 32]


class Rerender(envs.Environment):
  """Turn 0 is answered with a re-rendered prompt: the first prompt plus X (record 0) or a prompt of its own
  (record 1); turn 1 ends the episode with reward = sample index."""

  def __init__(self, seen):
    self.seen = seen

  async def reset(self, record):
    self.record = record
    return envs.Observation(PROMPTS[record], max_new_tokens=FIRST)

  async def step(self, turn):
    self.seen.append((self.record, turn))
    if turn.index == 0:
      new = PROMPTS[self.record] + X if self.record == 0 else ALONE_PROMPT
      return envs.StepResult(prompt=new, max_new_tokens=THEN)
    return envs.StepResult(reward=float(len(self.seen)), done=True, stop_reason="final_answer")


def run_split(sync=True):
  sm = S.Sampler(CFG, max_prompt_len=8, max_new_tokens=24, slots=4, decode_chunk=3, params=P0)
  seen = []
  with envs.EpisodeStream(sm.stream(S.Temperature(1.0)), lambda: Rerender(seen), sync=sync) as eps:
    done = eps.run([0, 1], samples_per_prompt=2, seed=3, step=1)
  return done, seen


@pytest.fixture(scope="module")
def split():
  return run_split()


def test_an_episode_is_its_rows_in_order_with_the_new_prompt_between(split):
  done, seen = split
  assert len(seen) == 8  # two turns of four episodes
  sm = S.Sampler(CFG, max_prompt_len=8, max_new_tokens=24, slots=4, decode_chunk=3, params=P0)
  for rec, f in enumerate(done):
    extra = X if rec == 0 else ALONE_PROMPT
    new = PROMPTS[rec] + X if rec == 0 else ALONE_PROMPT
    kind = episodes_lib.AFTER_PROMPT if rec == 0 else episodes_lib.ALONE
    assert f.out.tokens.shape[0] == 2 and f.forks.shape == f.out.tokens.shape  # one training row per episode
    for i in range(2):
      n = FIRST + len(extra) + THEN
      toks, smp, lp = (np.asarray(a)[i] for a in (f.out.tokens, f.out.sampled, f.out.logprobs))
      assert int(f.out.lengths[i]) == n and f.episodes[i]["rows"] == 2 and f.episodes[i]["turns"] == 2
      np.testing.assert_array_equal(toks[FIRST:FIRST + len(extra)], extra)
      assert smp[:FIRST].all() and not smp[FIRST:FIRST + len(extra)].any() and smp[FIRST + len(extra):n].all()
      assert np.all(lp[FIRST:FIRST + len(extra)] == 0) and not smp[n:].any()
      assert f.forks[i].tolist() == [kind if j == FIRST else 0 for j in range(f.forks.shape[1])]
      assert f.episodes[i]["appended"] == len(extra)
      # The new row is plain sampling after the new prompt, under the row key of sample G + i of the prompt.
      st = sm.stream(S.Temperature(1.0))
      st.submit([new], seed=3, step=1, prompt_ids=[rec], max_new_tokens=THEN, first_sample=2 + i)
      outs = [g.out for _ in range(20) if st.pending for g in st.step()]
      np.testing.assert_array_equal(np.asarray(outs[0].tokens)[0, :THEN], toks[FIRST + len(extra):n])


def test_split_runs_give_the_same_tokens_sync_or_not(split):
  done, _ = split
  again, _ = run_split(sync=False)
  for a, b in zip(done, again):
    np.testing.assert_array_equal(a.out.tokens, b.out.tokens)


def _packed(done):
  out = S.concat_outputs([f.out for f in done])
  batch = packing.pack(out, np.concatenate([f.rewards for f in done]), 8, np.concatenate([f.forks for f in done]))
  return batch, packing.pack_tokens(batch, 64)


def test_trainer_logprobs_equal_sampler_on_both_rows(split):
  """The packed row gives each new row its own segment (after the first prompt, or alone), so every sampled
  token is scored in the context it was sampled in."""
  batch, b = _packed(split[0])
  lm = np.asarray(batch.loss_mask)
  assert lm.sum() == 4 * (FIRST + THEN)  # exactly the sampled tokens of both rows
  layout = layouts.of(b)
  got = np.asarray(layout.logprobs(P0, CFG, layout.inputs(jax.tree.map(jnp.asarray, b)), chunk=256,
                                   temperature=1.0))
  got = packing.unpack_slots(got, b, batch)
  np.testing.assert_allclose(got * lm, np.asarray(batch.behaviour_logprobs) * lm, atol=1e-4)
  assert b.batch_size == 4  # four episodes, four sequences: group baselines count episodes


def test_an_episode_is_one_sequence_for_returns_and_advantages(split):
  batch, b = _packed(split[0])
  seq = np.asarray(b.seq)
  for e in range(4):
    r, k = np.nonzero(seq == e)
    assert len(set(r.tolist())) == 1 and np.all(np.diff(k) == 1)  # contiguous slots of one row
  # KL to go (REINFORCE++) runs across an episode's rows: the reverse cumsum over its slots equals numpy's
  # over the whole training row of the episode.
  kl = np.random.default_rng(0).random(seq.shape).astype(np.float32) * (seq < 4)
  seg = algorithms.Segments(jnp.asarray(seq), 4)
  got = np.asarray(seg.reverse_cumsum(jnp.asarray(kl)))
  for e in range(4):
    r, k = np.nonzero(seq == e)
    np.testing.assert_allclose(got[r, k], np.cumsum(kl[r, k][::-1])[::-1], rtol=1e-5)
  adv = np.asarray(algorithms.grpo_advantages(jnp.asarray(b.rewards), 2))
  assert adv.shape == (4,)


def test_split_batches_train_packed_only(split):
  batch, _ = _packed(split[0])

  class Trainer:
    model_cfg = CFG

    def packed_rows_multiple(self):
      return 1

    def num_micro_batches(self, rows, length):
      return 1

  with pytest.raises(ValueError, match="optimizer.pack_tokens"):
    packing.for_trainer(batch, Trainer(), ())
  out = packing.for_trainer(batch, Trainer(), (32, 64))
  assert out.segment_ids.max() > 0
  # a batch of episodes that never split trains as before, padded when that is cheaper
  flat = batch.replace(forks=np.zeros_like(batch.forks))
  assert packing.for_trainer(flat, Trainer(), ()).forks is None


def test_cancelling_a_group_with_a_new_row_in_flight_frees_every_slot():
  sm = S.Sampler(CFG, max_prompt_len=8, max_new_tokens=24, slots=4, decode_chunk=1, params=P0)
  gate = asyncio.Event()

  class Slow(Rerender):
    async def step(self, turn):
      if turn.index == 1:
        await gate.wait()
      return await super().step(turn)

  eps = envs.EpisodeStream(sm.stream(S.Temperature(1.0)), lambda: Slow([]), sync=False)
  try:
    eps.submit([0], samples_per_prompt=2, tags=["a"])
    group = next(iter(eps._groups.values()))
    for _ in range(20):  # until the first rows ended and their new rows are queued or decoding
      eps.step()
      if all(ep.parts for ep in group.episodes):
        break
    assert eps.stream.pending and all(ep.parts and ep.row < 0 for ep in group.episodes)
    assert eps.cancel_older(10**6) == ["a"] and not eps.pending
    for _ in range(40):
      if not eps.stream.pending:
        break
      eps.step()
    assert np.all(eps.stream.owner < 0)
  finally:
    eps._loop.call_soon_threadsafe(gate.set)
    eps.close()


def test_bad_re_rendered_results_are_one_clear_error():
  with pytest.raises(ValueError, match="re-rendered `prompt`"):
    envs.StepResult(prompt=[1, 2], tokens=[3])
  with pytest.raises(ValueError, match="re-rendered `prompt`"):
    envs.StepResult(prompt=[1, 2], stop=[3])


# -- renderers and environments ---------------------------------------------------------------------------------
QUERY = [{"role": "user", "content": "What is 23 * 47?"}]
THOUGHT = "<think>23*47 is 1081</think>The answer is 1081."


def test_next_turn_re_renders_where_the_template_drops_reasoning():
  tok = tokenizer("chatml", DROPS_REASONING)
  r = renderers.renderer("chatml", tok)
  convo = QUERY + [r.message(THOUGHT + r.end)]
  assert r.next_turn(convo, ["1081"], "tool") == {"tokens": r.env_turn("1081")}  # tool turns keep it
  nxt = r.next_turn(convo, ["Try again."], "user")
  assert list(nxt) == ["prompt"]
  assert nxt["prompt"] == chat(tok, convo + [{"role": "user", "content": "Try again."}])
  assert "23*47 is 1081" not in tok.decode(nxt["prompt"])  # the reasoning was dropped, as the template does


class _Ctx:
  def __init__(self, tok, reward, **cfg):
    self.tokenizer, self.pool, self.journal, self.render = tok, None, None, None
    self.reward_fn = None
    self.config = envs.EnvConfig(renderer="chatml", **cfg)
    self.grade = lambda fn, texts, records: [(reward, {})] * len(texts)


def _turn(tok, text, index=0):
  t = np.array(ids(tok, text) + [tok.backend.token_to_id("<|im_end|>")])
  return envs.Turn(t, np.zeros(len(t)), np.zeros(len(t), np.int32), "eos", index, 100)


class _Rec:
  prompt, messages = "What is 23 * 47?", None


def test_retry_env_re_renders_on_a_template_that_drops_reasoning():
  tok = tokenizer("chatml", DROPS_REASONING)
  env = envs.RetryEnv(_Ctx(tok, 0.0, max_turns=2, retry_message="No."))
  first = asyncio.run(env.reset(_Rec()))
  assert first.tokens == chat(tok, QUERY)
  res = asyncio.run(env.step(_turn(tok, THOUGHT)))
  want = QUERY + [{"role": "assistant", "content": THOUGHT}, {"role": "user", "content": "No."}]
  assert not res.done and res.prompt == chat(tok, want) and not res.tokens
  end = asyncio.run(env.step(_turn(tok, "1081", 1)))
  assert end.done and end.stop_reason == "max_turns" and end.reward == 0.0
  # on an append-only template the retry is appended; a right answer ends the episode
  tok2 = tokenizer("chatml")
  env2 = envs.RetryEnv(_Ctx(tok2, 0.0, max_turns=2, retry_message="No."))
  asyncio.run(env2.reset(_Rec()))
  res2 = asyncio.run(env2.step(_turn(tok2, THOUGHT)))
  assert not res2.prompt and list(res2.tokens) == renderers.renderer("chatml", tok2).env_turn("No.", "user")
  right = envs.RetryEnv(_Ctx(tok2, 1.0))
  asyncio.run(right.reset(_Rec()))
  done = asyncio.run(right.step(_turn(tok2, THOUGHT)))
  assert done.done and done.reward == 1.0 and done.stop_reason == "final_answer"


def test_tool_env_re_renders_where_a_tool_turn_drops_the_policy_turn():
  tok = tokenizer("chatml", DROPS_REASONING.replace("m.role == 'assistant' and loop.index0 < ns.last",
                                                    "m.role == 'assistant'"))  # drops reasoning always
  ctx = _Ctx(tok, 0.0)
  env = envs.ToolEnv(ctx, [envs.Tool.from_function(envs.calculator)],
                     calls=envs.TagCalls({"calc": "calculator"}))
  assert not env.render.append_only
  asyncio.run(env.reset(_Rec()))
  env.runner.run = lambda calls, key=None: asyncio.sleep(0, [envs.ToolResult("1081", "ok")])
  res = asyncio.run(env.step(_turn(tok, "<think>use it</think><calc>23*47</calc>")))
  want = QUERY + [{"role": "assistant", "content": "<think>use it</think><calc>23*47</calc>"},
                  {"role": "tool", "content": "1081"}]
  assert res.prompt == chat(tok, want) and list(res.calls) == ["ok"]
