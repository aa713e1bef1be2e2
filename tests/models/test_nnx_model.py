"""The NNX `Transformer`: built (sharded too) and applied as the pure functions are, its state the parameter
tree that the trainer, sampler and orbax use, and an nnx.jit / nnx.grad step equal to the pure-tree step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlax import models as M
from rlax.checkpoint import Checkpointer
import hf_testutil as U

CFG = M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="qwen2", qkv_bias=True)
TOKENS = jnp.asarray(U.random_tokens(batch=4, length=12, seed=1))


def _equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_build_and_apply_equal_pure_functions():
  model = M.Transformer(CFG, rngs=nnx.Rngs(0))
  params = model.params
  _equal(params, M.create_params(CFG, seed=nnx.Rngs(0).params()))
  logits, cache = model(TOKENS)
  ref, _ = M.forward(params, CFG, TOKENS)
  assert cache is None
  np.testing.assert_array_equal(logits, ref)
  np.testing.assert_array_equal(model.token_logprobs(TOKENS, chunk=4), M.token_logprobs(params, CFG, TOKENS, chunk=4))
  # The module's state is the tree itself (same arrays), each Param tagged with its logical axes.
  wrapped = M.Transformer.from_params(CFG, params)
  assert all(a is b for a, b in zip(jax.tree.leaves(wrapped.params), jax.tree.leaves(params)))
  axes = nnx.to_pure_dict(nnx.state(wrapped, nnx.Param), lambda v: v.logical_axes)
  assert axes == M.param_axes(CFG)


def test_nnx_train_step_equals_pure_step():
  params = U.scaled_params(CFG, seed=2)
  tx = optax.adamw(1e-2)
  loss = lambda lp: -jnp.mean(lp)

  model = M.Transformer.from_params(CFG, params)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, opt, tokens):
    value, grads = nnx.value_and_grad(lambda m: loss(m.token_logprobs(tokens, chunk=4)))(model)
    opt.update(model, grads)
    return value

  @jax.jit
  def pure_step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(lambda p: loss(M.token_logprobs(p, CFG, tokens, chunk=4)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return value, optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for _ in range(2):
    v_nnx = nnx_step(model, opt, TOKENS)
    v_pure, params, opt_state = pure_step(params, opt_state, TOKENS)
    np.testing.assert_allclose(v_nnx, v_pure, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), model.params, params)
  assert float(jnp.abs(params["layers"]["q"] - U.scaled_params(CFG, seed=2)["layers"]["q"]).max()) > 1e-3


def test_sharded_build_and_orbax_round_trip(tmp_path):
  mesh = M.make_mesh(jax.devices(), fsdp=4, tensor=2)
  build = lambda: M.Transformer(CFG, rngs=nnx.Rngs(0), mesh=mesh)
  # Shape first: the abstract model allocates nothing and knows every parameter's sharding.
  abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(build), nnx.Param))
  shardings = M.param_shardings(CFG, mesh)
  assert jax.tree.map(lambda s: s.sharding, abstract) == shardings
  model = build()
  assert jax.tree.map(lambda x: x.sharding, model.params) == shardings
  assert model.params["layers"]["gate"].addressable_shards[0].data.shape == (2, 32 // 4, 64 // 2)
  _equal(model.params, M.Transformer(CFG, rngs=nnx.Rngs(0)).params)

  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(0, model.params, force=True)
    ckpt.wait()
    _, restored, _ = ckpt.restore(0, abstract)
  again = M.Transformer.from_params(CFG, restored)
  _equal(again.params, model.params)
  assert nnx.to_pure_dict(nnx.get_named_sharding(nnx.state(again, nnx.Param), mesh)) == shardings
  with jax.set_mesh(mesh):
    logits, _ = nnx.jit(lambda m, t: m(t))(again, TOKENS)
  np.testing.assert_allclose(logits, M.forward(M.Transformer(CFG, rngs=nnx.Rngs(0)).params, CFG, TOKENS)[0],
                             atol=1e-5)


def test_from_params_rejects_a_mismatched_tree():
  params = U.scaled_params(CFG)
  with pytest.raises(ValueError, match="does not match"):
    M.Transformer.from_params(CFG.replace(qkv_bias=False), params)
  bad = {**params, "layers": {**params["layers"], "q": params["layers"]["q"][:, :16]}}
  with pytest.raises(ValueError, match=r"\['layers'\]\['q'\] has shape \[2, 16, 4, 8\]"):
    M.Transformer.from_params(CFG, bad)
