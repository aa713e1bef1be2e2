"""PPO's value model: token rewards, GAE targets and the clipped value loss against float64 numpy written from
the papers (Schulman et al. 2016 / 2017), value warm-up, and a critic that learns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A
from rlax import models as M
from rlax.trainer import OptimizerConfig, Trainer
from rlax.trainer import critic as C
from trainer_testlib import B, CFG, G, PROMPT, T, make_batch


def gae_reference(rewards, values, mask, gamma, lam):
  """Float64 GAE by the paper's definition, A_t = sum_l (gamma lam)^l delta_{t+l}, over scored tokens only."""
  adv = np.zeros_like(np.asarray(rewards, np.float64))
  for b in range(adv.shape[0]):
    idx = [t for t in range(adv.shape[1]) if mask[b, t]]
    v = [float(values[b, t]) for t in idx] + [0.0]
    deltas = [float(rewards[b, t]) + gamma * v[k + 1] - v[k] for k, t in enumerate(idx)]
    for k, t in enumerate(idx):
      adv[b, t] = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(idx) - k))
  return adv, (adv + np.asarray(values, np.float64)) * mask


def test_token_rewards_put_the_reward_on_the_last_token_and_the_kl_on_every_token():
  m = jnp.array([[0, 1, 1, 1, 0], [0, 1, 0, 0, 0]], jnp.float32)
  kl = jnp.full(m.shape, 0.5)
  got = C.token_rewards(jnp.array([2.0, -1.0]), m, kl, 0.1)
  np.testing.assert_allclose(got, [[0, -0.05, -0.05, 1.95, 0], [0, -1.05, 0, 0, 0]], rtol=1e-6)


def test_values_are_the_head_on_the_final_hidden_state():
  params = M.create_params(CFG)
  critic = C.init_params(params)
  critic["head"] = {"w": jnp.linspace(-1, 1, CFG.d_model), "b": jnp.asarray(0.25)}
  b = make_batch(params)
  h, _ = M.hidden_states(params, CFG, b.tokens, input_mask=b.input_mask)
  want = np.asarray(h, np.float64)[:, :-1] @ np.linspace(-1, 1, CFG.d_model) + 0.25
  np.testing.assert_allclose(C.values(critic, CFG, b.tokens, b.input_mask), want, rtol=1e-4, atol=1e-5)
  # start skips the prompt's positions (0 there), the rest unchanged.
  got = np.asarray(C.values(critic, CFG, b.tokens, b.input_mask, start=PROMPT - 1))
  np.testing.assert_allclose(got[:, PROMPT - 1:], want[:, PROMPT - 1:], rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(got[:, :PROMPT - 1], 0.0)


def test_gae_targets_and_whitened_advantages_match_the_paper():
  rng = np.random.default_rng(0)
  m = np.array([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]], np.float32)
  r = rng.normal(size=m.shape).astype(np.float32) * m
  v = rng.normal(size=m.shape).astype(np.float32) * m
  adv, ret = C.advantages(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), 0.99, 0.9)
  ref_adv, ref_ret = gae_reference(r, v, m, 0.99, 0.9)
  vals = ref_adv[m > 0]
  np.testing.assert_allclose(adv, np.where(m > 0, (ref_adv - vals.mean()) / vals.std(), 0.0), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-6)
  # Explained variance 1 - Var[R - V] / Var[R] over the scored tokens.
  ev = 1 - np.var((ref_ret - v)[m > 0]) / np.var(ref_ret[m > 0])
  np.testing.assert_allclose(C.explained_variance(jnp.asarray(v), ret, jnp.asarray(m)), ev, rtol=1e-4)


def _ppo(**kw):
  return Trainer(CFG, A.get_algorithm("ppo", **kw), OptimizerConfig(lr=1e-3), group_size=G)


def test_first_ppo_step_value_loss_and_metrics_by_hand():
  params = M.create_params(CFG)
  rewards = np.array([1, 0, 2, 0, 1, 1, 0, 3], np.float32)
  b = make_batch(params, rewards=rewards).replace(prompt_len=PROMPT)
  trainer = _ppo(gamma=1.0, lam=0.9, value_clip=0.2)
  _, metrics = trainer.step(trainer.init_state(params), b)
  # The head starts at 0: every old value is 0, so the return of token t is lam^(tokens after t) * r and the
  # value loss is 0.5 * mean(R^2) over scored tokens; explained variance 1 - Var[R]/Var[R] = 0.
  m = np.asarray(b.loss_mask, np.float64)
  after = np.cumsum(m[:, ::-1], axis=1)[:, ::-1] - 1
  ret = np.where(m > 0, 0.9 ** after * rewards[:, None], 0.0)
  np.testing.assert_allclose(metrics["value_loss"], 0.5 * (ret ** 2).sum() / m.sum(), rtol=1e-5)
  np.testing.assert_allclose(metrics["return_mean"], ret.sum() / m.sum(), rtol=1e-5)
  np.testing.assert_allclose(metrics["explained_variance"], 0.0, atol=1e-6)
  assert float(metrics["value_clip_frac"]) == 0.0  # V == V_old at the first step: nothing clipped


def test_value_warmup_trains_only_the_critic_then_both():
  params = M.create_params(CFG)
  b = make_batch(params, rewards=np.array([1, 0, 1, 0, 1, 1, 0, 0], np.float32)).replace(prompt_len=PROMPT)
  trainer = _ppo(value_warmup_steps=2)
  state = trainer.init_state(params)
  same = lambda x, y: all(np.array_equal(a, c) for a, c in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
  before = jax.device_get(state)
  for step in range(3):
    state, metrics = trainer.step(state, b)
    now = jax.device_get(state)
    assert float(metrics["value_warmup"]) == (step < 2)
    assert same(now.params, before.params) == (step < 2)
    assert same(now.opt_state, before.opt_state) == (step < 2)
    assert not same(now.critic.params, before.critic.params)
    before = now
  assert int(state.step) == 3 and int(state.critic.step) == 3


def test_a_non_finite_policy_update_skips_the_critic_update_too():
  params = M.create_params(CFG)
  b = make_batch(params, rewards=np.array([1, 0, 1, 0, 1, 1, 0, 0], np.float32)).replace(prompt_len=PROMPT)
  adv = np.ones(b.loss_mask.shape, np.float32)  # given advantages feed the policy loss only
  adv[tuple(np.argwhere(np.asarray(b.loss_mask))[0])] = np.nan
  bad = b.replace(advantages=jnp.asarray(adv))
  trainer = _ppo()
  state = trainer.init_state(params)
  before = jax.device_get(state)
  state, metrics = trainer.step(state, bad)
  now = jax.device_get(state)
  assert float(metrics["finite"]) == 0.0 and np.isfinite(float(metrics["value_loss"]))  # the critic's own was fine
  for x, y in zip(jax.tree.leaves(now), jax.tree.leaves(before)):
    np.testing.assert_array_equal(x, y)  # policy, critic, both optimizers and both step counters
  state, metrics = trainer.step(state, b)  # a good batch then trains both
  assert float(metrics["finite"]) == 1.0 and int(state.step) == 1 and int(state.critic.step) == 1


def test_critic_fits_the_returns_of_a_fixed_batch():
  params = M.create_params(CFG)
  b = make_batch(params, rewards=np.array([1, 0, 1, 0, 1, 1, 0, 0], np.float32)).replace(prompt_len=PROMPT)
  trainer = _ppo(critic_lr=3e-3, value_warmup_steps=100, value_clip=10.0)
  state = trainer.init_state(params)
  losses, ev = [], []
  for _ in range(40):
    state, metrics = trainer.step(state, b)
    losses.append(float(metrics["value_loss"]))
    ev.append(float(metrics["explained_variance"]))
  assert losses[-1] < 0.2 * losses[0], losses
  assert ev[-1] > 0.8, ev


def test_ppo_state_layouts_and_config_errors():
  mesh = M.make_mesh(jax.devices()[:4], fsdp=-1)
  trainer = Trainer(CFG, A.get_algorithm("ppo"), OptimizerConfig(lr=1e-3), mesh, group_size=G)
  state = trainer.init_state(M.create_params(CFG, mesh))
  abstract = trainer.abstract_state()
  assert jax.tree.structure(abstract) == jax.tree.structure(state)
  for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(state)):
    assert a.shape == x.shape and a.dtype == x.dtype and a.sharding == x.sharding
  # The critic's trunk is sharded exactly as the policy's.
  assert jax.tree.map(lambda x: x.sharding, state.critic.params["trunk"]) == jax.tree.map(lambda x: x.sharding,
                                                                                          state.params)
  with pytest.raises(ValueError, match="critic_init='gs://x'"):
    A.get_algorithm("ppo", critic_init="gs://x")
  with pytest.raises(ValueError, match="critic_lr=0"):
    A.get_algorithm("ppo", critic_lr=0)
  with pytest.raises(ValueError, match="has_value_model=True goes with advantage='gae'"):
    A.get_algorithm("grpo", has_value_model=True)
  assert B % G == 0 and T > PROMPT


def test_critic_init_from_a_hf_directory(tmp_path):
  from harness import hf_models  # pylint: disable=g-import-not-at-top
  from rlax.models import hf  # pylint: disable=g-import-not-at-top
  hf_models.make_dir(tmp_path, "llama", tie=True)
  cfg, hf_params = hf.load_checkpoint(str(tmp_path))
  trainer = Trainer(cfg, A.get_algorithm("ppo", critic_init=f"hf:{tmp_path}"), OptimizerConfig(), group_size=1)
  state = trainer.init_state(M.create_params(cfg, seed=3))
  leaves = lambda t: [np.asarray(x) for x in jax.tree.leaves(jax.device_get(t))]
  trunk = leaves(state.critic.params["trunk"])
  for got, want in zip(trunk, leaves(hf_params)):
    np.testing.assert_array_equal(got, want)
  assert not all(np.array_equal(a, b) for a, b in zip(trunk, leaves(state.params)))  # not the policy's weights
  other = Trainer(CFG, A.get_algorithm("ppo", critic_init=f"hf:{tmp_path}"), OptimizerConfig(), group_size=G)
  with pytest.raises(ValueError, match="parameter tree differs from the policy's"):
    other.init_state(M.create_params(CFG))
