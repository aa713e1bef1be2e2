"""Batch layout checks, the optimizer schedule, and the step's advantage inputs (PPO/GAE, KL-in-reward, IS)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A
from rlax import models as M
from rlax.trainer import (OptimizerConfig, RolloutBatch, SFTBatch, Trainer, batch_advantages, make_schedule,
                          response_loss_mask)
from trainer_testlib import B, CFG, G, T, host, make_batch


def test_response_loss_mask_alignment():
  mask = np.array([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], bool)
  # Prompt = slots 0..2; loss_mask[t] scores token t+1, so response tokens 3, 4 (and 5) map to t = 2, 3 (4).
  np.testing.assert_array_equal(response_loss_mask(mask, 3), [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])


def test_batch_check_names_the_bad_field():
  params = M.create_params(CFG)
  b = make_batch(params)
  assert b.check(G) is b
  with pytest.raises(ValueError, match=r"RolloutBatch.rewards has shape \(7,\), expected \(8,\)"):
    b.replace(rewards=b.rewards[:7]).check()
  with pytest.raises(ValueError, match="RolloutBatch.advantages has shape"):
    b.replace(advantages=jnp.zeros((B, T))).check()
  with pytest.raises(ValueError, match="RolloutBatch.tokens has dtype float32, expected int32"):
    b.replace(tokens=b.tokens.astype(jnp.float32)).check()
  with pytest.raises(ValueError, match="RolloutBatch.rewards has dtype int32, expected float32"):
    b.replace(rewards=b.rewards.astype(jnp.int32)).check()
  with pytest.raises(ValueError, match="RolloutBatch.input_mask has dtype float32, expected bool"):
    b.replace(input_mask=b.input_mask.astype(jnp.float32)).check()
  with pytest.raises(ValueError, match="SFTBatch.loss_mask"):
    SFTBatch(tokens=b.tokens, input_mask=b.input_mask, loss_mask=b.input_mask).check()
  with pytest.raises(ValueError, match="SFTBatch.tokens has dtype int64"):
    SFTBatch(tokens=np.asarray(b.tokens, np.int64), input_mask=b.input_mask, loss_mask=b.loss_mask).check()


def test_batch_check_reads_values_only_on_the_host():
  """A prompt position scored: caught on a numpy batch; a device batch is not pulled back to look."""
  b = make_batch(M.create_params(CFG)).replace(prompt_len=6)  # loss_mask[:, 4] scores the first response token
  with pytest.raises(ValueError, match="scores a position before prompt_len=6"):
    host(b).check()
  with jax.transfer_guard("disallow"):
    assert b.check(G) is b
  ok = host(b).replace(prompt_len=5, ref_logprobs=np.zeros((B, T - 1), np.float32))
  assert ok.check(G) is ok
  abstract = RolloutBatch.abstract(B, T, with_ref=True, prompt_len=5)
  assert abstract.check(G) is abstract


def test_schedules():
  warm_const = make_schedule(OptimizerConfig(lr=1.0, warmup_steps=4))
  np.testing.assert_allclose([warm_const(i) for i in (0, 2, 4, 100)], [0.0, 0.5, 1.0, 1.0], rtol=1e-6)
  cos = make_schedule(OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=2, total_steps=12,
                                      min_lr_ratio=0.1))
  # Halfway through the 10 decay steps: 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55.
  np.testing.assert_allclose([cos(1), cos(2), cos(7), cos(12)], [0.5, 1.0, 0.55, 0.1], rtol=1e-5)
  with pytest.raises(ValueError, match="cosine schedule needs total_steps"):
    OptimizerConfig(schedule="cosine", warmup_steps=5, total_steps=5)
  with pytest.raises(ValueError, match="schedule='linear'"):
    OptimizerConfig(schedule="linear")


def test_advantage_inputs():
  params = M.create_params(CFG)
  b = make_batch(params, rewards=np.array([1, 0, 0, 0, 3, 3, 3, 3], np.float32))
  np.testing.assert_allclose(batch_advantages(A.get_algorithm("dr_grpo"), b, G), [0.75, -0.25, -0.25, -0.25,
                                                                                 0, 0, 0, 0], rtol=1e-6)
  given = jnp.arange(B * (T - 1), dtype=jnp.float32).reshape(B, T - 1)
  np.testing.assert_array_equal(batch_advantages(A.get_algorithm("ppo"), b.replace(advantages=given), G), given)
  # KL in the reward: Dr. GRPO's sequence reward r - beta * sum_t k1(old, ref), with ref = old - 0.5 on every
  # scored token and the old policy's log-probs given separately from the sampler's.
  algo = A.get_algorithm("dr_grpo", kl_coef=0.1, kl_in_reward=True, kl_estimator="k1")
  old = b.behaviour_logprobs + 0.25
  shaped = b.replace(ref_logprobs=old - 0.5)
  r = np.asarray(b.rewards) - 0.1 * 0.5 * np.asarray(b.loss_mask).sum(1)
  np.testing.assert_allclose(batch_advantages(algo, shaped, G, old),
                             A.dr_grpo_advantages(jnp.asarray(r), G), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="kl_in_reward needs batch.ref_logprobs"):
    batch_advantages(algo, b, G, old)
  with pytest.raises(ValueError, match="needs the old policy's log-probs"):
    batch_advantages(algo, shaped, G)


def test_ppo_step_with_gae_advantages_and_stale_rollouts():
  params = M.create_params(CFG)
  b = make_batch(params)
  m = b.loss_mask
  adv, _ = A.gae_advantages(m * jnp.arange(T - 1.0), jnp.zeros_like(m), m, 1.0, 0.95)
  # Stale behaviour log-probs: the sampler's policy gave the last half of each row's tokens 3x less mass.
  stale = b.behaviour_logprobs - jnp.where(jnp.arange(T - 1) >= (T - 1) // 2, np.log(3.0), 0.0)
  b = b.replace(advantages=adv, behaviour_logprobs=stale)
  trainer = Trainer(CFG, A.get_algorithm("ppo", off_policy="tis_token", is_cap=2.0), OptimizerConfig(lr=1e-3),
                    group_size=G)
  state = trainer.init_state(params)
  state, metrics = trainer.step(state, b)
  n = np.asarray(m).sum()
  frac = np.asarray(m)[:, (T - 1) // 2:].sum() / n
  np.testing.assert_allclose(metrics["is_frac_truncated"], frac, rtol=1e-5)
  np.testing.assert_allclose(metrics["is_ratio_max"], 3.0, rtol=1e-4)
  np.testing.assert_allclose(metrics["logp_diff_max"], np.log(3.0), rtol=1e-4)
  assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
