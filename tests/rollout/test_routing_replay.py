"""Rollout routing replay (MoE): the sampler records every fed token's experts, the batches carry them
(padded, packed, multi-turn rows, split rows) and the trainer's forward routes each token to them.

The probe: a top-1 router with renormalized weights gives its expert weight p / p = 1, so the model's output
depends on which experts tokens go to and not on the router's values. The trainer scores with a *different*
router than the sampler had: with the recorded routes it reproduces every behaviour log-prob exactly (each
route aligned with its token), without them it does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import envs
from rlax import models as M
from rlax import sampler as S
from rlax.models import moe
from rlax.models.config import MoEConfig
from rlax.rollout import packing
from rlax.trainer import layouts

PROMPTS = [[1, 5, 9], [1, 7, 3, 22, 40, 41, 13], [1, 60], [1, 2, 3, 4, 5]]
CFG = M.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=32,
                    arch="mixtral", moe=MoEConfig(n_experts=4, top_k=1, expert_mlp_dim=32))


def _params(seed, router_seed):
  p = M.create_params(CFG, seed=seed)
  router = jax.random.normal(jax.random.key(router_seed), p["layers"]["router"].shape)
  experts = {k: 8.0 * p["layers"][k] for k in ("experts_gate", "experts_up", "experts_down")}  # experts that differ
  return {**p, "lm_head": p["lm_head"] * 30.0, "layers": {**p["layers"], **experts, "router": router}}


SAMPLER_P, TRAINER_P = _params(0, 1), _params(0, 2)  # the same experts, different routers


def _make(**kw):
  return S.Sampler(CFG, **{**dict(max_prompt_len=8, max_new_tokens=16, slots=4, decode_chunk=3, params=SAMPLER_P),
                          **kw})


def _scores(batch, packed: bool, params=TRAINER_P, replay: bool = True):
  """Trainer log-probs of `batch`'s slots ([B, T-1]), replaying its routes or not."""
  b = packing.pack_tokens(batch, 64) if packed else batch
  if not replay:
    b = b.replace(routes=None)
  layout = layouts.of(b)
  got = np.asarray(layout.logprobs(params, CFG, layout.inputs(jax.tree.map(jnp.asarray, b)), chunk=256,
                                   temperature=1.0))
  return packing.unpack_slots(got, b, batch) if packed else got


def _assert_replay_reproduces(batch, packed, mask=None):
  lm = np.asarray(batch.loss_mask) * (1 if mask is None else mask)
  assert lm.sum() > 0
  want = np.asarray(batch.behaviour_logprobs) * lm
  np.testing.assert_allclose(_scores(batch, packed) * lm, want, atol=1e-4)
  assert np.abs(_scores(batch, packed, replay=False) * lm - want).max() > 0.1  # the routers do disagree


@pytest.fixture(scope="module")
def plain():
  out = jax.device_get(_make().generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=3))
  return out, packing.pack(out, np.zeros(8, np.float32), 8)


def test_every_fed_token_has_its_experts_and_only_the_last_has_none(plain):
  out, batch = plain
  L, k = moe.replayed_routes(CFG)
  assert batch.routes.shape == (8, 8 + 16, L, k) and batch.routes.dtype == np.uint8
  routes, mask = np.asarray(batch.routes), np.asarray(batch.input_mask)
  for b in range(8):
    real = np.flatnonzero(mask[b])
    assert np.all(routes[b, real[:-1]] < CFG.moe.n_experts)  # prompt and every token a forward fed
    assert np.all(routes[b, real[-1]] == moe.NO_ROUTE)       # the last token: drawn, never fed
    assert np.all(routes[b, ~mask[b]] == moe.NO_ROUTE)
  # The sampler's routes are its own model's: an f32 forward of the whole sequence chooses them too.
  seq = np.asarray(batch.tokens[0])[mask[0]]
  _, _, _, chosen = S.step.forward(SAMPLER_P, CFG, jnp.asarray(seq)[None], jnp.zeros(1, jnp.int32),
                                   jnp.asarray([len(seq)]))
  np.testing.assert_array_equal(np.moveaxis(np.asarray(chosen)[:, 0], 0, 1)[:-1], routes[0][mask[0]][:-1])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_trainer_replays_the_sampler_routes(plain, packed):
  _assert_replay_reproduces(plain[1], packed)


class Scripted(envs.Environment):
  """Two appended replies (the row goes on in its slot), then the end."""

  async def reset(self, record):
    return envs.Observation(PROMPTS[record], max_new_tokens=3)

  async def step(self, turn):
    if turn.index < 2:  # the second answer spans two of the extension's blocks (8 fed tokens each)
      return envs.StepResult(tokens=[50, 51] if turn.index == 0 else list(range(40, 50)), max_new_tokens=3)
    return envs.StepResult(reward=1.0, done=True, stop_reason="final_answer")


class Rerender(envs.Environment):
  """Turn 0 is answered with a re-rendered prompt (record 0: the first prompt plus two tokens; record 1: a prompt
  of its own): the episode goes on in a new row."""

  async def reset(self, record):
    self.record = record
    return envs.Observation(PROMPTS[record], max_new_tokens=3)

  async def step(self, turn):
    if turn.index == 0:
      return envs.StepResult(prompt=PROMPTS[0] + [7, 8] if self.record == 0 else [1, 30, 31, 32], max_new_tokens=4)
    return envs.StepResult(reward=1.0, done=True, stop_reason="final_answer")


def _episodes(env):
  with envs.EpisodeStream(_make(max_new_tokens=24).stream(S.Temperature(1.0)), env) as eps:
    done = eps.run([0, 1], samples_per_prompt=2, seed=3, step=1)
  out = S.concat_outputs([f.out for f in done])
  forks = np.concatenate([f.forks for f in done]) if done[0].forks is not None else None
  return packing.pack(out, np.concatenate([f.rewards for f in done]), 8, forks)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_multi_turn_rows_replay_their_appended_tokens_routes(packed):
  _assert_replay_reproduces(_episodes(Scripted), packed)


def test_split_rows_replay_each_rows_routes():
  batch = _episodes(Rerender)
  assert np.any(np.asarray(batch.forks))
  _assert_replay_reproduces(batch, packed=True)


def test_after_a_weight_swap_the_recomputed_routes_are_replayed():
  """A swap recomputes the cache under the new weights: later tokens follow the new routes of the prefix, which
  replace the recorded ones, so the tokens drawn after the swap replay exactly."""
  sm = _make(slots=4, decode_chunk=3, max_new_tokens=9)

  def on_chunk(i, _):
    if i == 1:
      sm.update_weights(_params(0, 5), version=1)  # a new router, the same experts

  out = jax.device_get(sm.generate(PROMPTS, samples_per_prompt=2, strategy=S.Temperature(1.0), seed=2,
                                   on_chunk=on_chunk))
  batch = packing.pack(out, np.zeros(8, np.float32), 8)
  after = np.zeros(batch.loss_mask.shape, np.float32)
  after[:, 7:] = np.asarray(out.versions) == 1
  assert 0 < after.sum() < np.asarray(batch.loss_mask).sum()
  _assert_replay_reproduces(batch, packed=True, mask=after)


def test_routes_are_off_for_dense_models_and_with_replay_none():
  assert moe.replayed_routes(CFG.replace(arch="llama", moe=None)) is None
  off = CFG.replace(moe=MoEConfig(n_experts=4, top_k=1, expert_mlp_dim=32, routing_replay="none"))
  out = S.Sampler(off, max_prompt_len=8, max_new_tokens=4, slots=4, params=SAMPLER_P).generate(PROMPTS[:2])
  assert out.routes is None
  with pytest.raises(ValueError, match="routing_replay"):
    MoEConfig(n_experts=4, top_k=1, expert_mlp_dim=8, routing_replay="later")
  with pytest.raises(ValueError, match="n_experts=300 must be <= 255"):
    MoEConfig(n_experts=300, top_k=2, expert_mlp_dim=8)


def test_host_rows_fetch_rows_from_the_devices_holding_them():
  """The stream's collect takes finished rows' routes from each row's own shard (split by rows, or by rows and
  another dim: then whole), in the order asked."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from rlax.sampler.stream import host_rows
  mesh = jax.make_mesh((4, 2), ("data", "tensor"))
  x = np.arange(8 * 4 * 2, dtype=np.uint8).reshape(8, 4, 2)
  rows = np.asarray([5, 0, 7, 5])
  for spec in (P("data"), P("data", "tensor"), P()):
    np.testing.assert_array_equal(host_rows(jax.device_put(x, NamedSharding(mesh, spec)), rows), x[rows])
