"""The parameter variation (rlax.models.variation): what trains, what a forward uses, the merged weights, the
reference and what a push carries, for full fine-tuning and for LoRA, from the one object."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
from rlax.models import lora as L
from rlax.models import variation

CFG = M.ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, mlp_dim=32)

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)), jnp.int32)


def test_full_fine_tuning_trains_the_params_themselves():
  v = variation.of(CFG, L.LoraConfig(rank=0))
  params = M.create_params(CFG, seed=0)
  assert not v.frozen_base and v.backward_passes == 2 and v.step_args(None) == ()
  assert v.init(params) is params and v.forward(params, None) is params and v.merge(params, None) is params
  ref = v.reference(params, None)  # a copy: the step donates the params
  assert all(r is not p for r, p in zip(jax.tree.leaves(ref), jax.tree.leaves(params)))
  assert jax.tree.structure(v.abstract()) == jax.tree.structure(params)
  assert v.push_dtype(jnp.bfloat16) == jnp.bfloat16


def test_lora_trains_adapters_over_the_frozen_base():
  lora = L.LoraConfig(rank=4, alpha=8.0)
  v = variation.of(CFG, lora, seed=3)
  base = M.create_params(CFG, seed=0)
  ad = v.init(base)
  assert v.frozen_base and v.backward_passes == 1 and v.push_dtype(jnp.bfloat16) is None
  assert jax.tree.structure(ad) == jax.tree.structure(v.abstract())
  # B = 0: step 0's forward is the base model's exactly, and so are the merged weights
  logits = lambda p: np.asarray(M.forward(p, CFG, TOKENS)[0])
  np.testing.assert_array_equal(logits(v.forward(ad, base)), logits(base))
  np.testing.assert_array_equal(logits(v.merge(ad, base)), logits(base))
  trained = jax.tree.map(lambda x: x + 0.1, ad)
  np.testing.assert_allclose(logits(v.merge(trained, base)), logits(v.forward(trained, base)), atol=1e-5, rtol=1e-5)
  assert v.reference(trained, base) is base  # frozen: no copy
  assert v.step_args(base) == (base,)
  with pytest.raises(ValueError, match="needs its base weights"):
    v.step_args(None)
  mesh = M.make_mesh(jax.devices()[:1], data=1, fsdp=1, tensor=1)
  pushed = v.pushed(None, mesh)  # the adapters cross, not the weights
  assert jax.tree.structure(pushed) == jax.tree.structure(ad) and "rank-4" in v.describe()
