"""The trainer's objective against the papers: REINFORCE++'s KL from the old policy, Dr. GRPO's normalizer.

Expected values come from float64 numpy written from the formulas, never from rlax.
"""

import jax
import jax.numpy as jnp
import numpy as np

from rlax import algorithms as A
from rlax import models as M
from rlax.trainer import OptimizerConfig, Trainer, batch_advantages
from trainer_testlib import B, CFG, G, PROMPT, T, logprobs, make_batch


def reinforce_pp_reference(r, mask, kl, beta, eps=1e-6):
  """Hu et al. 2025 eq. 4 + sec. 3.2: A_t = r - beta * sum_{i>=t} KL_i, normalized over all batch tokens."""
  r, mask, kl = (np.asarray(x, np.float64) for x in (r, mask, kl))
  to_go = np.cumsum((kl * mask)[:, ::-1], axis=1)[:, ::-1]
  adv = r[:, None] - beta * to_go
  vals = adv[mask > 0]
  return np.where(mask > 0, (adv - vals.mean()) / (vals.std() + eps), 0.0)


def test_reinforce_pp_batch_advantages_per_token_from_old_policy():
  params = M.create_params(CFG)
  b = make_batch(params, rewards=np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float32))
  old = np.asarray(b.behaviour_logprobs)
  ref = old - np.random.default_rng(1).uniform(0.0, 1.0, old.shape).astype(np.float32)
  stale = b.replace(behaviour_logprobs=b.behaviour_logprobs - 0.7, ref_logprobs=jnp.asarray(ref))
  algo = A.get_algorithm("reinforce_pp", kl_coef=0.2, kl_in_reward=True, kl_estimator="k1")
  got = batch_advantages(algo, stale, G, jnp.asarray(old))
  assert got.shape == (B, T - 1)
  np.testing.assert_allclose(got, reinforce_pp_reference(b.rewards, b.loss_mask, old - ref, 0.2), rtol=1e-4,
                             atol=1e-5)


def test_kl_in_reward_is_measured_from_the_trainers_old_policy_not_the_sampler():
  # With old_policy="recompute" and no IS correction the sampler's log-probs enter nothing but metrics, so
  # stale behaviour log-probs must leave the update unchanged.
  params = M.create_params(CFG)
  b = make_batch(params)
  b = b.replace(ref_logprobs=b.behaviour_logprobs - 0.3 * b.loss_mask)
  algo = A.get_algorithm("reinforce_pp", kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")
  trainer = Trainer(CFG, algo, OptimizerConfig(lr=1e-2), group_size=G)
  fresh, _ = trainer.step(trainer.init_state(params), b)
  stale, _ = trainer.step(trainer.init_state(params), b.replace(behaviour_logprobs=b.behaviour_logprobs - 0.5))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), fresh.params, stale.params)


def test_dr_grpo_normalizer_is_the_generation_budget():
  params = M.create_params(CFG)
  rewards = np.array([1, 0, 0, 0, 1, 1, 0, 1], np.float32)
  b = make_batch(params, rewards=rewards).replace(prompt_len=PROMPT)
  trainer = Trainer(CFG, A.get_algorithm("dr_grpo"), OptimizerConfig(lr=1e-3), group_size=G)
  _, metrics = trainer.step(trainer.init_state(params), b)
  # Ratio 1 at the first update: per-token loss -A_i; sum over scored tokens / (B * (T - PROMPT)) with
  # T - PROMPT = 5 response slots (the budget), not T - 1 = 9.
  adv = rewards.reshape(-1, G) - rewards.reshape(-1, G).mean(1, keepdims=True)
  lengths = np.asarray(b.loss_mask, np.float64).sum(1)
  want = -(adv.reshape(-1) * lengths).sum() / (B * (T - PROMPT))
  np.testing.assert_allclose(metrics["pg_loss"], want, rtol=1e-5)
  # A configured budget wins.
  trainer = Trainer(CFG, A.get_algorithm("dr_grpo", max_len=16), OptimizerConfig(lr=1e-3), group_size=G)
  _, metrics = trainer.step(trainer.init_state(params), b)
  np.testing.assert_allclose(metrics["pg_loss"], want * (T - PROMPT) / 16, rtol=1e-5)
