"""LoRA: step 0 is the base model exactly; adapters are the only trained leaves (and the only AdamW moments);
the KL reference is the base with the adapters off; merged and attached adapters give the same logits after
several versions; a push carries the adapters only; PEFT loads the exported adapters onto the transformers
base with rlax's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A
from rlax import models as M
from rlax.models import lora as L
from rlax.trainer import OptimizerConfig, Trainer
from rlax.weights import AdapterTransport, DevicePutTransport, WeightsService
from trainer_testlib import CFG, make_batch

LORA = L.LoraConfig(rank=4, alpha=8.0)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)), jnp.int32)


def _random_adapters(seed):
  """Adapters with B != 0 (as after training)."""
  ad = L.create(CFG, LORA, seed=seed)
  return jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(seed + 1), x.shape), ad)


def test_adapter_shapes_and_count():
  ad = L.create(CFG, LORA)
  s = ad["layers"]
  assert s["q"]["a"].shape == (2, 16, 4) and s["q"]["b"].shape == (2, 4, 4, 4)
  assert s["o"]["a"].shape == (2, 4, 4, 4) and s["o"]["b"].shape == (2, 4, 16)
  assert s["down"]["a"].shape == (2, 32, 4) and s["down"]["b"].shape == (2, 4, 16)
  assert all(np.all(np.asarray(x["b"]) == 0) for x in s.values())
  smol = M.ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                       mlp_dim=1536)
  n = L.count(L.abstract(smol, L.LoraConfig(rank=8)))
  assert n == 2_442_240  # SmolLM2-135M at rank 8 on every linear layer: 2.44 M parameters, 9.8 MB in f32


def test_step_zero_logits_equal_the_base_exactly():
  params = M.create_params(CFG, seed=0)
  attached = L.attach(params, L.create(CFG, LORA), LORA)
  np.testing.assert_array_equal(np.asarray(M.forward(attached, CFG, TOKENS)[0]),
                                np.asarray(M.forward(params, CFG, TOKENS)[0]))


def test_merged_equals_attached_after_several_versions():
  params = M.create_params(CFG, seed=0)
  for v in range(3):  # every version merges into the pristine base, never into the previous merge
    ad = _random_adapters(v)
    merged = L.merge(params, ad, LORA)
    got = np.asarray(M.forward(merged, CFG, TOKENS)[0])
    want = np.asarray(M.forward(L.attach(params, ad, LORA), CFG, TOKENS)[0])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.abs(want - np.asarray(M.forward(params, CFG, TOKENS)[0])).max() > 1e-3  # the adapters matter


@pytest.mark.parametrize("targets", [L.TARGETS, ("q", "v", "up")])
def test_adapter_gradients_equal_those_through_the_merged_weights(targets):
  """The attached forward (q|k|v and gate|up adapters sharing one x @ [A..] matmul) differentiates to the same
  adapter gradients as the plain formulation, a forward over W + A @ B * scale."""
  lora = L.LoraConfig(rank=4, alpha=8.0, targets=targets)
  params = M.create_params(CFG, seed=0)
  ad = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(5), x.shape), L.create(CFG, lora, seed=4))
  loss = lambda full: jnp.sum(jax.nn.log_softmax(M.forward(full, CFG, TOKENS)[0])[..., 3])
  got = jax.grad(lambda a: loss(L.attach(params, a, lora)))(ad)
  want = jax.grad(lambda a: loss(L.merge(params, a, lora)))(ad)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5 * float(np.abs(w).max())), got, want)
  assert all(float(np.abs(g).max()) > 0 for g in jax.tree.leaves(got))


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_only_adapters_train_and_the_base_is_the_reference(name):
  params = M.create_params(CFG, seed=0)
  base_copy = jax.tree.map(np.asarray, params)
  algo = A.get_algorithm(name)
  mesh = M.make_mesh(jax.devices()[:2], fsdp=2)
  tr = Trainer(CFG, algo, OptimizerConfig(lr=1e-2), mesh, group_size=4, lora=LORA, micro_batches=2)
  state = tr.init_state(params)
  assert jax.tree.structure(state.params) == jax.tree.structure(L.abstract(CFG, LORA))
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  adapter_shapes = sorted(x.shape for x in jax.tree.leaves(state.params))
  assert sorted(x.shape for x in moments) == sorted(adapter_shapes * 2)  # AdamW's mu and nu, adapters only
  batch = make_batch(params)
  full = Trainer(CFG, algo, mesh=mesh, group_size=4)
  ref = tr.ref_logprobs(tr.base, batch)  # the KL reference: the base with the adapters off
  np.testing.assert_array_equal(np.asarray(ref), np.asarray(full.ref_logprobs(params, batch)))
  batch = batch.replace(ref_logprobs=ref)
  before = jax.tree.map(np.asarray, state.params)
  for _ in range(2):
    state, metrics = tr.step(state, batch)
  assert float(metrics["finite"]) == 1.0
  changed = [not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
  assert any(changed)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, tr.base), base_copy)  # frozen, bitwise
  merged = tr.merged_params(state.params)
  assert jax.tree.structure(merged) == jax.tree.structure(params)


def test_a_push_carries_the_adapters_and_the_sampler_merges_them():
  params = M.create_params(CFG, seed=0)
  mesh = M.make_mesh(jax.devices()[:2], fsdp=2)
  tr = Trainer(CFG, A.get_algorithm("grpo"), mesh=mesh, group_size=4, lora=LORA)
  tr.init_state(params)
  sampler_mesh = M.make_mesh(jax.devices()[2:4], fsdp=2)
  adapters_t = DevicePutTransport(L.adapter_shardings(CFG, LORA, sampler_mesh), None)
  base_t = DevicePutTransport(M.param_shardings(CFG, sampler_mesh), None)
  service = WeightsService(AdapterTransport(adapters_t, base_t, lambda: tr.base, LORA, jnp.float32))
  full_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  adapter_bytes = L.count(L.abstract(CFG, LORA)) * 4
  for v in range(3):
    ad = jax.device_put(_random_adapters(v), tr.state_shardings().params)
    stats = service.push(ad, v)
    assert stats["sync_bytes"] == adapter_bytes and stats.get("base_sync_bytes", full_bytes) == full_bytes
    assert ("base_sync_bytes" in stats) == (v == 0)  # the base crosses once
    got, version = service.latest()
    assert version == v and {d for x in jax.tree.leaves(got) for d in x.devices()} == set(jax.devices()[2:4])
    want = L.merge(params, _random_adapters(v), LORA)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), got, want)


def test_peft_loads_the_exported_adapters_onto_the_transformers_base(tmp_path):
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  transformers = pytest.importorskip("transformers")
  from harness import hf_models
  from rlax import export
  from rlax.models import hf
  src = tmp_path / "base"
  hf_models.make_dir(src, "llama", True)
  cfg, params = hf.load_checkpoint(str(src), cfg=None)
  cfg = cfg.replace(dtype="float32")
  lora = L.LoraConfig(rank=4, alpha=8.0)
  ad = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(3), x.shape), L.create(cfg, lora, seed=1))
  files = export.export_peft(ad, lora, str(tmp_path / "adapter"), base_model=str(src))
  assert files == ["adapter_config.json", "adapter_model.safetensors"]
  base = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7))
  plain = hf_models.logits(base, tokens)
  model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()  # wraps `base` in place
  ref = hf_models.logits(model, tokens)
  ours = np.asarray(M.forward(L.attach(params, ad, lora), cfg, jnp.asarray(tokens, jnp.int32))[0])
  assert np.abs(ref - plain).max() > 1e-3  # the adapters change the model
  np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())
