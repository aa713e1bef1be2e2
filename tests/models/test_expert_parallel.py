"""Expert parallelism on 8 fake CPU devices: the experts split over the rules table's 'experts' axes, tokens
exchanged inside a shard_map; the sharded forward, its gradients and a replayed forward equal one device's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax import models as M
from rlax.models import expert_parallel, moe
from rlax.models.config import MoEConfig

CFGS = {
    "qwen3_moe": M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch="qwen3_moe", qk_norm=True,
                               moe=MoEConfig(n_experts=8, top_k=2, expert_mlp_dim=16)),
    "qwen2_moe": M.ModelConfig(96, 32, 2, 4, 2, 8, 48, arch="qwen2_moe", qkv_bias=True,
                               moe=MoEConfig(n_experts=8, top_k=4, expert_mlp_dim=16, norm_topk_prob=False,
                                             shared_mlp_dim=24)),
}


def _params(cfg):
  p = M.create_params(cfg, seed=3)
  scale = {k: 6.0 for k in ("router", "experts_gate", "experts_up", "experts_down")}
  return {**p, "layers": {k: v * scale.get(k, 1.0) for k, v in p["layers"].items()}}


def _loss(cfg, routes=None):
  def f(p, t):
    h, _ = M.hidden_states(p, cfg, t, routes=routes)
    return jnp.sum(jnp.tanh(h) * jnp.arange(h.shape[-1]) / h.shape[-1])
  return f


@pytest.mark.parametrize("axes", [dict(fsdp=4, tensor=2), dict(data=2, fsdp=2, tensor=2), dict(fsdp=8)],
                         ids=["ep4_tp2", "dp2_ep2_tp2", "ep8"])
@pytest.mark.parametrize("name", sorted(CFGS))
def test_sharded_forward_and_gradients_equal_one_device(name, axes):
  cfg = CFGS[name]
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.vocab_size)
  ref = jax.jit(lambda p, t: M.forward(p, cfg, t)[0])(params, tokens)
  ref_loss, ref_grad = jax.jit(jax.value_and_grad(_loss(cfg)))(params, tokens)
  mesh = M.make_mesh(jax.devices(), **axes)
  sharded = jax.device_put(params, M.param_shardings(cfg, mesh))
  ep = expert_parallel.expert_axes(dict(mesh.shape), cfg.moe.n_experts)
  assert ep == ("fsdp",)
  assert sharded["layers"]["experts_gate"].addressable_shards[0].data.shape[1] == 8 // axes["fsdp"]
  toks = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
  with jax.set_mesh(mesh):
    fwd = jax.jit(lambda p, t: M.forward(p, cfg, t)[0])
    hlo = fwd.lower(sharded, toks).compile().as_text()
    out = fwd(sharded, toks)
    loss, grad = jax.jit(jax.value_and_grad(_loss(cfg)))(sharded, toks)
  assert "all-gather" in hlo and "reduce-scatter" in hlo  # tokens exchanged, not the experts gathered
  np.testing.assert_allclose(out, ref, atol=2e-5 * float(jnp.abs(ref).max()))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grad), jax.tree.leaves(ref_grad)):
    np.testing.assert_allclose(g, r, atol=1e-5 * max(1.0, float(jnp.abs(r).max())), err_msg=str(path))


def test_replayed_routes_under_expert_parallelism():
  cfg = CFGS["qwen3_moe"]
  params = _params(cfg)
  tokens = jax.random.randint(jax.random.key(2), (8, 10), 0, cfg.vocab_size)
  routes = jax.random.randint(jax.random.key(3), (8, 10, cfg.n_layers, 2), 0, 8).astype(moe.ROUTE_DTYPE)
  routes = routes.at[:, :, :, 1].set((routes[:, :, :, 0] + 1) % 8)  # two distinct experts a token
  routes = routes.at[0, :3].set(moe.NO_ROUTE)  # a few tokens route themselves
  ref_loss, ref_grad = jax.value_and_grad(_loss(cfg, routes))(params, tokens)
  mesh = M.make_mesh(jax.devices(), fsdp=4, tensor=2)
  with jax.set_mesh(mesh):
    loss, grad = jax.jit(lambda p, t, r: jax.value_and_grad(_loss(cfg, r))(p, t))(
        jax.device_put(params, M.param_shardings(cfg, mesh)), tokens, routes)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  r = ref_grad["layers"]["router"]
  np.testing.assert_allclose(grad["layers"]["router"], r, atol=1e-5 * float(jnp.abs(r).max()))
  assert float(jnp.abs(ref_grad["layers"]["router"]).max()) > 0  # the router learns under replay


def test_rows_past_the_groups_are_zero_as_ragged_dot():
  x = jax.random.normal(jax.random.key(0), (37, 6))
  w = jax.random.normal(jax.random.key(1), (3, 6, 5))
  sizes = jnp.array([5, 0, 20], jnp.int32)  # 12 rows past the groups
  got = moe.grouped_matmul(x, w, sizes)
  np.testing.assert_allclose(got, jax.lax.ragged_dot(x, w, sizes), atol=1e-5)
  assert float(jnp.abs(got[25:]).max()) == 0.0
