"""A MoE policy's auxiliary router losses: the load-balancing loss against transformers' own
(`load_balancing_loss_func`) on the routers of a transformers Qwen3-MoE model, the z-loss against numpy, and the
trainer's loss carrying them only when their coefficients ask for it (logged either way)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_moe import modeling_qwen3_moe

from rlax import algorithms
from rlax import models as M
from rlax import trainer as T
from rlax.models import hf, moe
from rlax.trainer import layouts
import hf_testutil as U

E, K = 6, 2


def _hf_qwen3_moe(tmp_path):
  torch.manual_seed(0)
  config = transformers.Qwen3MoeConfig(
      vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
      rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False, intermediate_size=48,
      num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, norm_topk_prob=True,
      attn_implementation="eager")
  model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
  model.save_pretrained(tmp_path)
  return model


def test_router_stats_match_transformers_per_layer(tmp_path):
  """Per layer, transformers' Switch loss counts f_e over the k slots (it sums to k), so it is k times ours;
  ours is the mean over layers of each layer's. Right padding (mask 0 at the end) so both compute the valid
  tokens alike; the padding is left out of both."""
  model = _hf_qwen3_moe(tmp_path)
  cfg, params = hf.load_checkpoint(str(tmp_path))
  tokens = U.random_tokens(batch=2, length=12, seed=1)
  mask = np.ones((2, 12), bool)
  mask[1, 7:] = False
  with torch.no_grad():
    out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)), output_router_logits=True)
  per_layer = [float(modeling_qwen3_moe.load_balancing_loss_func((g,), E, K, torch.tensor(mask))) / K
               for g in out.router_logits]
  valid = mask.reshape(-1)
  z = [np.mean(np.square(np.log(np.sum(np.exp(g.double().numpy()), axis=-1)))[valid]) for g in out.router_logits]
  _, _, stats = M.hidden_states(params, cfg, jnp.asarray(tokens), input_mask=jnp.asarray(mask), router_stats=True)
  assert min(per_layer) > 1.0  # an unbalanced router: the loss is above its balanced value
  np.testing.assert_allclose(float(stats.balance), np.mean(per_layer), rtol=1e-5)
  np.testing.assert_allclose(float(stats.z), np.mean(z), rtol=1e-5)
  scanned = M.hidden_states(params, cfg.replace(scan_layers=True, remat=True), jnp.asarray(tokens),
                            input_mask=jnp.asarray(mask), router_stats=True)[2]
  np.testing.assert_allclose(np.asarray(scanned), np.asarray(stats), rtol=1e-6)


def test_router_stats_by_hand():
  """Two experts, top-1, three tokens of which one is padding: f = (1/2, 1/2), P = the valid tokens' mean."""
  logits = jnp.asarray([[2.0, 0.0], [0.0, 1.0], [5.0, -5.0]])
  experts = jnp.asarray([[0], [1], [0]])
  stats = moe.router_stats(logits, experts, jnp.asarray([1.0, 1.0, 0.0]))
  p = np.exp([[2.0, 0.0], [0.0, 1.0]])
  p /= p.sum(-1, keepdims=True)
  assert float(stats.balance) == pytest.approx(2 * np.sum(np.array([0.5, 0.5]) * p.mean(0)), rel=1e-6)
  lse = np.log(np.exp([2.0, 0.0]).sum()), np.log(np.exp([0.0, 1.0]).sum())
  assert float(stats.z) == pytest.approx(np.mean(np.square(lse)), rel=1e-6)
  balanced = moe.router_stats(jnp.zeros((4, 4)), jnp.asarray([[0, 1], [2, 3], [0, 2], [1, 3]]), jnp.ones(4))
  assert float(balanced.balance) == pytest.approx(1.0)  # perfect balance is 1 at any k
  with pytest.raises(ValueError, match="load_balance_coef must be >= 0"):
    M.MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=8, load_balance_coef=-1.0)


def _rl_loss(cfg, params, x):
  algo = algorithms.get_algorithm("grpo")
  mb = T.LossInputs(model=x, loss_mask=jnp.asarray(x["input_mask"][:, 1:], jnp.float32),
                    behaviour_logprobs=jnp.zeros(x["tokens"][:, 1:].shape, jnp.float32),
                    advantages=jnp.asarray([1.0, -1.0]))
  fn = lambda p: T.rl_loss(p, cfg, algo, mb, num_tokens=jnp.sum(mb.loss_mask), num_seqs=2, num_rows=2)
  return jax.value_and_grad(fn, has_aux=True)(params)


def test_rl_loss_adds_the_router_losses_only_when_asked():
  """Coefficients 0 (the RL default): the loss is the policy's alone and the router statistics are logged.
  Set: the loss grows by exactly coef · statistic and the router's gradient changes."""
  cfg = M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch="qwen3_moe", qk_norm=True,
                      moe=M.MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=16))
  params = U.scaled_params(cfg, seed=3)
  tokens = U.random_tokens(batch=2, length=10, seed=5)
  x = {"tokens": jnp.asarray(tokens), "input_mask": jnp.ones((2, 10), jnp.int32)}
  (base, metrics), g0 = _rl_loss(cfg, params, x)
  assert {"router_balance_sum", "router_z_sum", "router_inputs"} <= set(metrics)
  reduced = T.reduce_metrics(jax.tree.map(lambda a: a[None], dict(metrics, active=jnp.ones(()))), base,
                             jnp.ones(()), jnp.ones(()))
  lb, z = float(reduced["router_balance"]), float(reduced["router_z"])
  assert lb > 1.0 and z > 0.0
  aux = cfg.replace(moe=dataclasses.replace(cfg.moe, load_balance_coef=0.1, router_z_coef=0.01))
  (loss, _), g1 = _rl_loss(aux, params, x)
  np.testing.assert_allclose(float(loss), float(base) + 0.1 * lb + 0.01 * z, rtol=1e-5)
  router = lambda g: np.asarray(g["layers"]["router"])
  assert np.abs(router(g1) - router(g0)).max() > 1e-4
  assert "router_balance" not in T.reduce_metrics(
      jax.tree.map(lambda a: a[None], {k: v for k, v in metrics.items() if not k.startswith("router")}
                   | {"active": jnp.ones(())}), base, jnp.ones(()), jnp.ones(()))


def test_router_losses_over_micro_batches_weigh_each_by_its_real_tokens():
  """Two micro-batches with different amounts of padding: the loss adds coef x each micro-batch's statistic x
  its share of the batch's real tokens, so the shares sum to 1 and the added loss is coef x the logged
  (token-weighted) statistic; a packed batch's real tokens are its nonzero segment ids."""
  cfg = M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch="qwen3_moe", qk_norm=True,
                      moe=M.MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=16, load_balance_coef=0.5))
  params = U.scaled_params(cfg, seed=3)
  mask = np.ones((4, 10), np.int32)
  mask[2:, 6:] = 0  # the second micro-batch has 12 real tokens, the first 20
  x = {"tokens": jnp.asarray(U.random_tokens(batch=4, length=10, seed=6)), "input_mask": jnp.asarray(mask)}
  layout = layouts.Layout(packed=False)
  mb = T.LossInputs(model=x, loss_mask=jnp.asarray(mask[:, 1:], jnp.float32),
                    behaviour_logprobs=jnp.zeros((4, 9), jnp.float32), advantages=jnp.asarray([1.0, -1.0, 0.5, 0.0]))
  algo = algorithms.get_algorithm("grpo")

  def total(c):
    fn = lambda p, m: T.rl_loss(p, c, algo, m, num_tokens=jnp.sum(mb.loss_mask), num_seqs=4, num_rows=4,
                                layout=layout, num_inputs=layout.input_tokens(x))
    _, loss, stacked = T.accumulate_gradients(fn, params, mb, 2)
    return float(loss), T.reduce_metrics(stacked, loss, jnp.ones(()), jnp.ones(()))

  plain, _ = total(cfg.replace(moe=dataclasses.replace(cfg.moe, load_balance_coef=0.0)))
  with_aux, metrics = total(cfg)
  assert float(layout.input_tokens(x)) == 32
  np.testing.assert_allclose(with_aux - plain, 0.5 * float(metrics["router_balance"]), rtol=1e-5)
  packed = layouts.Layout(packed=True, seqs=2)
  assert float(packed.input_tokens({"segment_ids": jnp.asarray([[1, 1, 2, 0], [3, 0, 0, 0]])})) == 4


def test_router_stats_need_a_moe_forward_without_a_cache():
  cfg = M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch="qwen3", qk_norm=True)
  with pytest.raises(ValueError, match="router_stats are a MoE model's"):
    M.hidden_states(U.scaled_params(cfg), cfg, jnp.asarray(U.random_tokens()), router_stats=True)
  layout = layouts.Layout(packed=False)
  assert len(layout.per_slot(lambda h, t: (t,), U.scaled_params(cfg), cfg,
                             {"tokens": jnp.asarray(U.random_tokens()), "input_mask": jnp.ones((2, 24))})) == 1


def test_a_run_sets_how_experts_train_over_a_checkpoint(tmp_path):
  """Routing replay and the auxiliary coefficients are the run's to choose (configs/smollm2_moe.py:no_replay);
  the expert count is the checkpoint's."""
  _hf_qwen3_moe(tmp_path)
  own = hf.read_config(str(tmp_path))
  run = own.replace(moe=dataclasses.replace(own.moe, routing_replay="none", load_balance_coef=0.01), remat=True)
  cfg, _ = hf.load_checkpoint(str(tmp_path), cfg=run)
  assert cfg.moe.routing_replay == "none" and cfg.moe.load_balance_coef == 0.01
  with pytest.raises(ValueError, match="differs from config.json in moe"):
    hf.load_checkpoint(str(tmp_path), cfg=own.replace(moe=dataclasses.replace(own.moe, top_k=3)))
