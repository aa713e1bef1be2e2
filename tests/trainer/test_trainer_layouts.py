"""The layouts the planner lowers are the runtime's: abstract state/batch vs init_state/place, one host crossing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A
from rlax import models as M
from rlax.models import sharding as shd
from rlax.trainer import OptimizerConfig, Trainer
from trainer_testlib import B, CFG, G, PROMPT, T, host, make_batch

ALGO = A.get_algorithm("grpo", kl_coef=0.04)


@pytest.fixture(scope="module")
def host_batch():
  """A rollout as the host packs it: numpy arrays, ref_logprobs still to fill."""
  return host(make_batch(M.create_params(CFG)).replace(prompt_len=PROMPT))


def _same_layout(abstract, real):
  """Same tree, shapes, dtypes and (exactly equal) shardings."""
  assert jax.tree.structure(abstract) == jax.tree.structure(real)
  for (path, a), r in zip(jax.tree.flatten_with_path(abstract)[0], jax.tree.leaves(real)):
    where = jax.tree_util.keystr(path)
    assert (a.shape, a.dtype) == (r.shape, r.dtype), where
    assert a.sharding == r.sharding, (where, a.sharding, r.sharding)


def test_row_shards_is_the_batch_sharding():
  mesh = M.make_mesh(jax.devices()[:8], data=2, fsdp=2, tensor=2)
  assert shd.batch_sharding(mesh, 8, 2).spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
  assert shd.row_shards(mesh, 8) == 4 and shd.row_shards(mesh, 6) == 2 and shd.row_shards(mesh, 3) == 1
  assert shd.row_shards(None, 8) == 1


def test_abstract_state_and_batch_are_the_runtime_layouts(host_batch):
  """On 8 devices: abstract_state == init_state's layout, abstract_batch == place's, and the step lowered
  from them is the program `step` runs (a Compiled accepts exactly its input shardings)."""
  mesh = M.make_mesh(jax.devices()[:8], data=2, fsdp=2, tensor=2)
  trainer = Trainer(CFG, ALGO, OptimizerConfig(lr=1e-3), mesh, group_size=G)
  abstract = trainer.abstract_state()
  state = trainer.init_state(M.create_params(CFG, seed=0))  # single-device params are placed by init_state
  _same_layout(abstract, state)
  assert tuple(abstract.params["layers"]["gate"].sharding.spec) == (None, "fsdp", "tensor")
  batch = host_batch.replace(ref_logprobs=np.asarray(host_batch.behaviour_logprobs))
  placed = trainer.place(batch)
  _same_layout(trainer.abstract_batch(B, T, with_ref=True, prompt_len=PROMPT), placed)
  assert all(a is b for a, b in zip(jax.tree.leaves(trainer.place(placed)), jax.tree.leaves(placed)))
  compiled = trainer.lower_step(abstract, trainer.abstract_batch(B, T, with_ref=True, prompt_len=PROMPT)).compile()
  new_state, metrics = compiled(trainer.init_state(M.create_params(CFG, seed=0)), placed)
  _, expected = trainer.step(state, batch)
  np.testing.assert_allclose(jax.device_get(metrics["loss"]), jax.device_get(expected["loss"]), rtol=1e-6)
  _same_layout(abstract, new_state)
  with pytest.raises(ValueError, match=r"init_state: \['embed'\] is bfloat16"):
    trainer.init_state(jax.tree.map(lambda x: x.astype(jnp.bfloat16), M.create_params(CFG)))


def test_one_host_crossing_per_rollout(host_batch):
  """A numpy batch crosses once (explicit device_put); ref_logprobs + step then run without any implicit transfer."""
  mesh = M.make_mesh(jax.devices()[:2], data=1, fsdp=2)
  trainer = Trainer(CFG, ALGO, OptimizerConfig(lr=1e-3), mesh, group_size=G)
  ref_params = M.create_params(CFG, mesh, seed=0)
  state = trainer.init_state(M.create_params(CFG, mesh, seed=0))
  with jax.transfer_guard("disallow"):
    batch = trainer.place(host_batch)
    ref = trainer.ref_logprobs(ref_params, batch)
    assert ref.sharding == trainer.batch_sharding(ref.shape)
    batch = batch.replace(ref_logprobs=ref)
    assert all(a is b for a, b in zip(jax.tree.leaves(trainer.place(batch)), jax.tree.leaves(batch)))
    state, metrics = trainer.step(state, batch)
    metrics = jax.device_get(metrics)
    # A numpy batch handed straight to step is placed by it (one device_put), too.
    state, _ = trainer.step(state, host(batch))
  assert np.isfinite(metrics["loss"]) and int(jax.device_get(state.step)) == 2
  # Equal weights: the reference log-probs are the behaviour ones.
  np.testing.assert_allclose(jax.device_get(ref)[:, PROMPT - 1:], host_batch.behaviour_logprobs[:, PROMPT - 1:],
                             atol=1e-5)
