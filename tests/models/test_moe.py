"""Mixture-of-experts policies: transformers parity for Qwen3-MoE, Qwen2-MoE and Mixtral (load and export), the
dropless grouped-matmul experts against a dense per-expert reference, and replayed routes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rlax import models as M
from rlax.models import hf, moe
from rlax.models.config import MoEConfig
import hf_testutil as U

_BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)
HF_CASES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig,
                  dict(intermediate_size=48, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                       norm_topk_prob=True)),
    "qwen2_moe": (transformers.Qwen2MoeConfig,
                  dict(intermediate_size=48, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=16, num_local_experts=6, num_experts_per_tok=2)),
}


def _hf_model(arch, seed=0):
  config_cls, extra = HF_CASES[arch]
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config_cls(**_BASE, **extra, attn_implementation="eager"))
  model = model.to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
  return model


@pytest.mark.parametrize("arch", sorted(HF_CASES))
def test_load_matches_transformers_logits(arch, tmp_path):
  model = _hf_model(arch)
  model.save_pretrained(tmp_path)
  cfg, params = hf.load_checkpoint(str(tmp_path))
  want = {"qwen3_moe": MoEConfig(6, 2, 16, True), "qwen2_moe": MoEConfig(6, 2, 16, False, shared_mlp_dim=24),
          "mixtral": MoEConfig(6, 2, 16, True)}[arch]
  assert cfg.arch == arch and cfg.moe == want
  tokens = U.random_tokens()
  ref = U.hf_logits(model, tokens)
  out, _ = M.forward(params, cfg, tokens)
  assert np.abs(ref).max() > 1.0
  assert np.abs(np.asarray(out) - ref).max() <= 1e-5 * np.abs(ref).max()


EXPORT_CFGS = {
    "qwen3_moe": M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch="qwen3_moe", qk_norm=True,
                               moe=MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=16)),
    "qwen2_moe": M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch="qwen2_moe", qkv_bias=True, norm_eps=1e-6,
                               moe=MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=16, norm_topk_prob=False,
                                             shared_mlp_dim=24)),
    "mixtral": M.ModelConfig(96, 32, 2, 4, 2, 8, 16, arch="mixtral", rope_theta=1e6,
                             moe=MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=16)),
}


@pytest.mark.parametrize("arch", sorted(EXPORT_CFGS))
def test_export_reloads_in_transformers(arch, tmp_path):
  cfg = EXPORT_CFGS[arch]
  params = U.scaled_params(cfg, seed=3)
  hf.save_checkpoint(params, cfg, str(tmp_path), max_shard_bytes=40_000)
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["model_type"] == arch
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").float()
  assert type(model).__name__ == hf.config_to_hf(cfg)["architectures"][0]
  tokens = U.random_tokens(seed=1)
  out, _ = M.forward(params, cfg, tokens)
  ref = U.hf_logits(model, tokens)
  assert np.abs(np.asarray(out) - ref).max() <= 1e-5 * np.abs(ref).max()
  cfg2, params2 = hf.load_checkpoint(str(tmp_path))
  assert cfg2 == cfg
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def _dense_reference(w, x, experts, weights):
  """Every expert applied to every token (numpy, f64), combined with the routing weights."""
  x = np.asarray(x, np.float64)
  silu = lambda a: a / (1 + np.exp(-a))
  out = np.zeros_like(x)
  for e in range(w["experts_gate"].shape[0]):
    g, u = x @ np.asarray(w["experts_gate"][e]), x @ np.asarray(w["experts_up"][e])
    y = (silu(g) * u) @ np.asarray(w["experts_down"][e])
    share = (np.asarray(weights) * (np.asarray(experts) == e)).sum(-1)
    out += share[:, None] * y
  return out


def test_grouped_experts_equal_dense_reference():
  """Tokens sorted by expert through ragged_dot == each expert computed densely; an expert no token picked
  (a group of size 0) and one that many picked are both in the batch."""
  rng = np.random.default_rng(0)
  E, D, F, N = 5, 12, 7, 40
  w = {k: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for k, s in
       (("experts_gate", (E, D, F)), ("experts_up", (E, D, F)), ("experts_down", (E, F, D)))}
  x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
  experts = np.stack([rng.choice([0, 1, 3, 4], 2, replace=False, p=[0.55, 0.15, 0.15, 0.15]) for _ in range(N)])
  weights = rng.uniform(0.1, 1.0, (N, 2))
  got = moe.expert_mlp(w, x, jnp.asarray(experts, jnp.int32), jnp.asarray(weights, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), _dense_reference(w, x, experts, weights), atol=1e-5)


def test_replayed_routes_reproduce_and_train_the_router():
  """Replaying the routes a forward chose gives the same output; replaying other routes changes it; the router
  gets gradients through the replayed experts' weights."""
  cfg = EXPORT_CFGS["qwen3_moe"]
  params = U.scaled_params(cfg, seed=1)
  w = jax.tree.map(lambda a: a[0], params["layers"])
  h = jnp.asarray(np.random.default_rng(2).standard_normal((2, 6, cfg.d_model)), jnp.float32)
  out, logits, chosen = moe.routed(cfg, w, h)
  assert logits.shape == (2, 6, 4) and chosen.shape == (2, 6, 2)
  again, _, replayed = moe.routed(cfg, w, h, experts=chosen)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(chosen))
  np.testing.assert_allclose(np.asarray(again), np.asarray(out), atol=1e-6)
  other = (chosen + 1) % 4
  assert np.abs(np.asarray(moe.routed(cfg, w, h, experts=other)[0] - out)).max() > 1e-3
  grad = jax.grad(lambda r: moe.routed(cfg, {**w, "router": r}, h, experts=chosen)[0].sum())(w["router"])
  assert np.abs(np.asarray(grad)).max() > 1e-4


def test_moe_config_rules():
  with pytest.raises(ValueError, match="top_k=3 exceeds n_experts=2"):
    MoEConfig(n_experts=2, top_k=3, expert_mlp_dim=4)
  with pytest.raises(ValueError, match="needs a moe section"):
    M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch="mixtral")
  cfg = EXPORT_CFGS["qwen2_moe"]
  assert cfg.num_params() == sum(int(np.prod(s)) for s in jax.tree.leaves(
      M.param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple)))
  assert cfg.active_mlp_dim == 2 * 16 + 24
  hf_cfg = hf.config_to_hf(EXPORT_CFGS["qwen3_moe"])
  hf_cfg["mlp_only_layers"] = [1]
  with pytest.raises(ValueError, match="mlp_only_layers"):
    hf.config_from_hf(hf_cfg)
  mix = hf.config_to_hf(EXPORT_CFGS["mixtral"])
  assert mix["sliding_window"] is None and hf.config_from_hf(mix) == EXPORT_CFGS["mixtral"]
  with pytest.raises(ValueError, match="sliding_window=4096"):
    hf.config_from_hf({**mix, "sliding_window": 4096})
  with pytest.raises(ValueError, match="qkv_bias=False"):
    hf.config_from_hf({**hf.config_to_hf(EXPORT_CFGS["qwen2_moe"]), "qkv_bias": False})
  q2 = hf.config_to_hf(EXPORT_CFGS["qwen2_moe"])
  del q2["shared_expert_intermediate_size"]
  assert hf.config_from_hf(q2).moe.shared_mlp_dim == 5632  # transformers' default


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_upcycled_model_equals_the_dense_one(arch):
  """Every MLP copied into 4 experts (top-2, renormalized) behind a random router: the same logits."""
  dense = M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch=arch, qk_norm=arch == "qwen3")
  params = U.scaled_params(dense, seed=4)
  cfg, up = moe.upcycle(dense, params, n_experts=4, top_k=2, key=jax.random.key(0), router_std=0.5)
  assert cfg.arch == {"llama": "mixtral", "qwen3": "qwen3_moe"}[arch] and cfg.moe.n_experts == 4
  assert jax.tree.structure(up) == jax.tree.structure(U.scaled_params(cfg))
  tokens = U.random_tokens(seed=2)
  _, _, chosen = moe.routed(cfg, jax.tree.map(lambda a: a[0], up["layers"]),
                            jnp.asarray(np.random.default_rng(0).standard_normal((2, 24, 32)), jnp.float32))
  assert len(np.unique(np.asarray(chosen))) == 4  # the router really spreads tokens over the copies
  np.testing.assert_allclose(np.asarray(M.forward(up, cfg, tokens)[0]), np.asarray(M.forward(params, dense, tokens)[0]),
                             atol=2e-5)
  with pytest.raises(ValueError, match="dense llama or qwen3"):
    moe.upcycle(cfg, up, n_experts=2, top_k=2, key=jax.random.key(0))
  with pytest.raises(ValueError, match="top_k=1"):
    moe.upcycle(dense, params, n_experts=2, top_k=1, key=jax.random.key(0))


def test_trainer_replays_the_routes_the_sampler_recorded():
  """The sampler's prefill records each token's experts per layer; the trainer's forward given those routes
  computes the same logits as routing freely (same numerics), other routes give other logits, and the routes
  reach only a MoE forward without a cache."""
  from rlax.sampler import step
  from rlax.sampler.params import fuse
  cfg = EXPORT_CFGS["qwen3_moe"]
  params = U.scaled_params(cfg, seed=5)
  tokens = jnp.asarray(U.random_tokens(batch=2, length=10, seed=3))
  n = jnp.full((2,), 10, jnp.int32)
  _, _, _, routes = step.forward(fuse(params, cfg, stacked=False), cfg, tokens, jnp.zeros_like(n), n)
  assert routes.shape == (cfg.n_layers, 2, 10, 2) and routes.dtype == jnp.int32
  routes = jnp.moveaxis(routes, 0, 2)  # [B, T, L, k]
  free, _ = M.forward(params, cfg, tokens)
  replayed, _ = M.forward(params, cfg, tokens, routes=routes)
  np.testing.assert_allclose(np.asarray(replayed), np.asarray(free), atol=1e-5)
  other, _ = M.forward(params, cfg, tokens, routes=(routes + 1) % cfg.moe.n_experts)
  assert np.abs(np.asarray(other) - np.asarray(free)).max() > 1e-2
  scanned = cfg.replace(scan_layers=True)
  np.testing.assert_allclose(np.asarray(M.forward(params, scanned, tokens, routes=routes)[0]), np.asarray(free),
                             atol=1e-5)
  dense = cfg.replace(arch="qwen3", moe=None)
  _, _, _, dense_routes = step.forward(fuse(U.scaled_params(dense), dense, stacked=False), dense, tokens,
                                       jnp.zeros_like(n), n)
  assert dense_routes is None
  with pytest.raises(ValueError, match="routes and router_stats are a MoE model"):
    M.forward(params, cfg.replace(arch="qwen3", moe=None), tokens, routes=routes)


def test_replayed_routes_with_a_late_start():
  """start > 0 (the log-prob forward skips the last layer's early queries): the routes are cut the same way."""
  cfg = EXPORT_CFGS["mixtral"]
  params = U.scaled_params(cfg, seed=6)
  tokens = jnp.asarray(U.random_tokens(batch=2, length=9, seed=4))
  from rlax.sampler import step
  from rlax.sampler.params import fuse
  n = jnp.full((2,), 9, jnp.int32)
  routes = jnp.moveaxis(step.forward(fuse(params, cfg, stacked=False), cfg, tokens, jnp.zeros_like(n), n)[3], 0, 2)
  free, _ = M.hidden_states(params, cfg, tokens, start=4)
  replayed, _ = M.hidden_states(params, cfg, tokens, start=4, routes=routes)
  assert free.shape == (2, 5, cfg.d_model)
  np.testing.assert_allclose(np.asarray(replayed), np.asarray(free), atol=1e-5)


@pytest.mark.parametrize("rows,sizes", [(40, [0, 17, 3, 20]), (6, [1, 0, 0, 5]), (300, [299, 0, 1, 0])])
def test_grouped_matmul_equals_ragged_dot(rows, sizes):
  """The blocked grouped matmul (CPU/GPU) == jax.lax.ragged_dot, values and both gradients, with empty groups,
  one-row groups and one group holding almost every row."""
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 6)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 6, 5)), jnp.float32)
  s = jnp.asarray(sizes, jnp.int32)
  np.testing.assert_allclose(np.asarray(moe.grouped_matmul(x, w, s)), np.asarray(jax.lax.ragged_dot(x, w, s)),
                             atol=1e-5)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w, s)))
  for a, b in zip(jax.grad(loss(moe.grouped_matmul), (0, 1))(x, w), jax.grad(loss(jax.lax.ragged_dot), (0, 1))(x, w)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_lora_adapts_attention_and_the_shared_expert_never_the_routed_ones():
  """Qwen2-MoE: adapters on attention and the shared expert; training (attach) and sampling (merge) compute the
  same logits, the adapters get gradients, and asking for the routed experts' MLP is one clear error."""
  from rlax.models import lora as lora_lib
  cfg = EXPORT_CFGS["qwen2_moe"]
  params = M.create_params(cfg, seed=1)
  lo = lora_lib.LoraConfig(rank=4, alpha=8.0, targets=lora_lib.parse_targets("q,k,v,o,shared_gate,shared_up,"
                                                                            "shared_down")).validate()
  ad = lora_lib.init(cfg, lo, jax.random.key(0))
  ad = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(5), x.shape), ad)  # B != 0
  tokens = U.random_tokens()
  attached, _ = M.forward(lora_lib.attach(params, ad, lo), cfg, tokens)
  merged, _ = M.forward(lora_lib.merge(params, ad, lo), cfg, tokens)
  base, _ = M.forward(params, cfg, tokens)
  np.testing.assert_allclose(attached, merged, atol=1e-4 * float(jnp.abs(merged).max()))
  assert float(jnp.abs(attached - base).max()) > 1e-3
  grads = jax.grad(lambda a: jnp.sum(M.forward(lora_lib.attach(params, a, lo), cfg, tokens)[0] ** 2))(ad)
  assert all(float(jnp.abs(grads["layers"][t]["b"]).max()) > 0 for t in lo.targets)
  assert "shared_expert.gate_proj" in lora_lib.peft_config(lo)["target_modules"]
  with pytest.raises(ValueError, match="not the routed experts"):
    lora_lib.shapes(cfg, lora_lib.LoraConfig(rank=4, targets=("gate",)))
