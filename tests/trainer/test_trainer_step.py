"""The jitted RL/SFT steps: sharding invariance, accumulation, on-policy identities, learning, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A
from rlax import models as M
from rlax.trainer import (OptimizerConfig, Trainer, accumulate_gradients, loss_inputs, rl_loss)
from trainer_testlib import B, CFG, G, PROMPT, T, host, logprobs, make_batch, sft_batch


@pytest.fixture(scope="module")
def params():
  return M.create_params(CFG, seed=0)


@pytest.fixture(scope="module")
def batch(params):
  b = make_batch(params)
  return b.replace(ref_logprobs=b.behaviour_logprobs - 0.05)


def _run(trainer, params, batch, steps=1):
  state = trainer.init_state(jax.tree.map(jnp.copy, params))
  out = []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    out.append(host(metrics))
  return state, out


def test_sharded_step_equals_single_device(params, batch):
  algo = A.get_algorithm("grpo")
  opt = OptimizerConfig(lr=1e-2)
  single, m1 = _run(Trainer(CFG, algo, opt, group_size=G), params, batch)
  mesh = M.make_mesh(jax.devices()[:8], fsdp=4, tensor=2)
  sharded_trainer = Trainer(CFG, algo, opt, mesh, group_size=G)
  sharded, m2 = _run(sharded_trainer, params, batch)
  spec = sharded.params["layers"]["gate"].sharding.spec
  assert tuple(spec) == (None, "fsdp", "tensor"), spec
  assert sharded.opt_state[1][0].mu["layers"]["gate"].sharding.spec == spec
  for k in ("loss", "kl", "entropy", "grad_norm", "tokens"):
    np.testing.assert_allclose(m2[0][k], m1[0][k], rtol=1e-4, atol=1e-7, err_msg=k)
  # AdamW's first step moves each weight by ~lr * g / |g|, so a near-zero gradient entry turns float
  # reassociation noise into up to ~1e-4 * lr of parameter difference: compare at 1e-3 * lr.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3 * opt.lr), host(sharded.params),
               host(single.params))
  ref = sharded_trainer.ref_logprobs(params, batch)
  np.testing.assert_allclose(ref, batch.behaviour_logprobs, rtol=1e-5, atol=1e-5)


def test_micro_batches_equal_one_big_batch(params, batch):
  # Every aggregation mode adds up over micro-batches (tests/algorithms); here the gradient (GRPO's
  # seq-mean-token-mean + KL) and then the whole step (DAPO's token mean) do.
  algo = A.get_algorithm("grpo", kl_coef=0.04)
  inputs = loss_inputs(algo, batch, G)
  tok, seqs = A.denominators(inputs.loss_mask)
  loss_fn = lambda p, mb: rl_loss(p, CFG, algo, mb, num_tokens=tok, num_seqs=seqs, num_rows=8)
  g1, l1, _ = jax.jit(lambda p: accumulate_gradients(loss_fn, p, inputs, 1))(params)
  g2, l2, _ = jax.jit(lambda p: accumulate_gradients(loss_fn, p, inputs, 2))(params)
  np.testing.assert_allclose(l2, l1, rtol=1e-5, atol=1e-7)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g2, g1)
  algo = A.get_algorithm("dapo", kl_coef=0.04)
  _, m1 = _run(Trainer(CFG, algo, group_size=G), params, batch)
  _, m2 = _run(Trainer(CFG, algo, group_size=G, micro_batches=2), params, batch)
  for k in ("loss", "kl", "entropy", "grad_norm", "clip_frac", "ratio_mean", "tokens"):
    np.testing.assert_allclose(m2[0][k], m1[0][k], rtol=1e-4, atol=1e-7, err_msg=k)


def test_prompt_len_and_micro_batch_tokens_do_not_change_the_step(params, batch):
  # prompt_len lets the step skip the unscored prompt positions; micro_batch_tokens picks the fewest
  # micro-batches under a per-device token budget. Neither changes the update.
  algo = A.get_algorithm("grpo", kl_coef=0.04)
  opt = OptimizerConfig(lr=1e-2)
  base = Trainer(CFG, algo, opt, group_size=G)
  s1, m1 = _run(base, params, batch)
  fast = Trainer(CFG, algo, opt, group_size=G, micro_batch_tokens=2 * T)
  assert fast.num_micro_batches(B, T) == 4 and base.num_micro_batches(B, T) == 1
  assert Trainer(CFG, algo, group_size=G, micro_batch_tokens=1).num_micro_batches(B, T) == B
  pb = batch.replace(prompt_len=PROMPT)
  np.testing.assert_allclose(fast.ref_logprobs(params, pb)[:, PROMPT - 1:], pb.behaviour_logprobs[:, PROMPT - 1:],
                             atol=1e-5)
  # 4 micro-batches run unrolled, 8 (one row each) as a scan.
  for trainer in (fast, Trainer(CFG, algo, opt, group_size=G, micro_batch_tokens=1)):
    s2, m2 = _run(trainer, params, pb)
    for k in ("loss", "kl", "entropy", "grad_norm", "ratio_mean", "logp_diff_max", "tokens"):
      np.testing.assert_allclose(m2[0][k], m1[0][k], rtol=1e-4, atol=1e-6, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3 * opt.lr), host(s2.params),
                 host(s1.params))  # tolerance: see test_sharded_step_equals_single_device
  mesh = M.make_mesh(jax.devices()[:2], data=2, fsdp=1)
  assert Trainer(CFG, algo, opt, mesh, group_size=G, micro_batch_tokens=2 * T).num_micro_batches(B, T) == 2
  with pytest.raises(ValueError, match="scores a position before prompt_len=6"):
    host(batch).replace(prompt_len=PROMPT + 1).check()


def test_zero_staleness_ratio_is_one_and_gradient_is_policy_gradient(params, batch):
  b = batch.replace(ref_logprobs=None)
  algo = A.get_algorithm("grpo", kl_coef=0.0, off_policy="tis_token")
  inputs = loss_inputs(algo, b, G)
  tok, seqs = A.denominators(inputs.loss_mask)
  loss_fn = lambda p: rl_loss(p, CFG, algo, inputs, num_tokens=tok, num_seqs=seqs, num_rows=8)
  (_, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  assert float(metrics["ratio_max"]) == 1.0 and float(metrics["ratio_min"]) == 1.0
  # The sampler's log-probs came from the same function: the IS weight is 1 up to rounding.
  np.testing.assert_allclose([metrics["is_ratio_max"], metrics["is_ratio_min"]], 1.0, atol=1e-5)

  def reinforce(p):
    # On-policy estimate: -mean_i A_i * (1/|y_i|) sum_t log p(y_it), written out independently.
    lp = M.token_logprobs(p, CFG, b.tokens, input_mask=b.input_mask)
    m = b.loss_mask
    adv = A.grpo_advantages(b.rewards, G)
    per_seq = jnp.sum(lp * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1)
    return -jnp.sum(adv * per_seq) / jnp.sum(jnp.sum(m, axis=1) > 0)

  pg = jax.jit(jax.grad(reinforce))(params)
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6), grads, pg)


def test_rl_training_moves_policy_towards_advantage(params):
  rewards = np.array([1, 0, 0, 1, 0, 1, 1, 0], np.float32)
  b = make_batch(params, seed=3, rewards=rewards)
  algo = A.get_algorithm("grpo", kl_coef=0.0, old_policy="behaviour", eps_low=0.5, eps_high=0.5)
  trainer = Trainer(CFG, algo, OptimizerConfig(lr=3e-3), group_size=G)
  state, metrics = _run(trainer, params, b, steps=6)
  losses = [m["loss"] for m in metrics]
  assert losses[-1] < losses[0] - 1e-3, losses
  lp0 = np.asarray(b.behaviour_logprobs * b.loss_mask).sum(1)
  lp1 = np.asarray(logprobs(state.params, b.tokens, b.input_mask) * b.loss_mask).sum(1)
  assert np.all((lp1 - lp0)[rewards == 1] > 0) and np.all((lp1 - lp0)[rewards == 0] < 0), lp1 - lp0
  assert metrics[-1]["clip_frac"] >= 0 and np.isfinite(metrics[-1]["grad_norm"])


def test_sft_loss_decreases(params):
  trainer = Trainer(CFG, A.get_algorithm("grpo"), OptimizerConfig(lr=1e-2, warmup_steps=2), group_size=G)
  state = trainer.init_state(jax.tree.map(jnp.copy, params))
  b = sft_batch()
  losses, lrs = [], []
  for _ in range(8):
    state, m = trainer.sft_step(state, b)
    losses.append(float(m["loss"]))
    lrs.append(float(m["lr"]))
  assert losses[-1] < losses[0] - 0.2, losses
  np.testing.assert_allclose(lrs[:3], [0.0, 5e-3, 1e-2], rtol=1e-6)
  assert int(state.step) == 8
  expected = -np.sum(np.asarray(logprobs(params, b.tokens, b.input_mask))
                     * np.asarray(b.loss_mask)) / np.sum(np.asarray(b.loss_mask))
  np.testing.assert_allclose(losses[0], expected, rtol=1e-5)


def test_clear_errors(params, batch):
  t = Trainer(CFG, A.get_algorithm("grpo"), group_size=G)
  state = t.init_state(jax.tree.map(jnp.copy, params))
  with pytest.raises(ValueError, match="fill batch.ref_logprobs"):
    t.step(state, batch.replace(ref_logprobs=None))
  with pytest.raises(ValueError, match="loss_mask has shape"):
    t.step(state, batch.replace(loss_mask=batch.loss_mask[:, 1:]))
  with pytest.raises(ValueError, match="not a whole number of groups of group_size=3"):
    Trainer(CFG, A.get_algorithm("grpo"), group_size=3).step(state, batch)
  ppo = Trainer(CFG, A.get_algorithm("ppo"), group_size=G)
  with pytest.raises(ValueError, match="the state has none"):
    ppo.step(state, batch)
  with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
    Trainer(CFG, A.get_algorithm("grpo"), group_size=G, micro_batches=3).step(state, batch)
