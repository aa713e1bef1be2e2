"""Parameter server: trainer→sampler reshard across disjoint submeshes, dtype cast, versions, buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
from rlax import param_server as ps_lib
from rlax.param_server import ParameterServer, apply_bucket

CFG = M.ModelConfig(vocab_size=128, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)


@pytest.fixture(scope="module")
def meshes():
  devs = jax.devices()
  return M.make_mesh(devs[:4], fsdp=4), M.make_mesh(devs[4:], data=2, tensor=2)


def _params(mesh, seed):
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: M.init_params(CFG, jax.random.key(0)))
  host = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
  return jax.device_put(host, M.param_shardings(CFG, mesh)), host


def _check_on_sampler(out, host, targets, dtype):
  """Values equal the host copy cast to `dtype`, on the sampler's devices with the target shardings."""
  flat_out = jax.tree_util.tree_flatten_with_path(out)[0]
  for (path, a), h, t in zip(flat_out, jax.tree.leaves(host), jax.tree.leaves(targets)):
    name = jax.tree_util.keystr(path)
    assert a.dtype == dtype, name
    np.testing.assert_array_equal(np.asarray(a), h.astype(dtype), err_msg=name)
    assert a.sharding == t, f"{name}: {a.sharding} != {t}"
    assert {d.id for d in a.sharding.device_set} == {4, 5, 6, 7}, name


def test_push_reshards_and_casts_on_disjoint_meshes(meshes):
  tmesh, smesh = meshes
  params, host = _params(tmesh, 0)
  targets = M.param_shardings(CFG, smesh)
  ps = ParameterServer(targets, jnp.bfloat16)
  stats = ps.push(params, version=1)
  out, version = ps.pull()
  assert version == 1 and stats.version == 1 and stats.n_buckets == 1 and stats.mode == "whole"
  _check_on_sampler(out, host, targets, jnp.bfloat16)
  n = sum(x.size for x in jax.tree.leaves(host))
  assert stats.bytes == 2 * n and stats.source_bytes == 4 * n
  assert stats.gb_per_s == pytest.approx(stats.bytes / stats.seconds / 1e9)
  assert stats.as_dict()["sync/bytes"] == 2 * n
  # The trainer's copy is untouched and still lives on the trainer mesh.
  assert {d.id for d in params["embed"].sharding.device_set} == {0, 1, 2, 3}
  assert params["embed"].dtype == jnp.float32


def test_no_cast_keeps_dtype(meshes):
  tmesh, smesh = meshes
  params, host = _params(tmesh, 1)
  targets = M.param_shardings(CFG, smesh)
  ps = ParameterServer(targets, sampler_dtype=None)
  ps.push(params, 0)
  _check_on_sampler(ps.pull()[0], host, targets, jnp.float32)


def test_versions(meshes):
  tmesh, smesh = meshes
  ps = ParameterServer(M.param_shardings(CFG, smesh), jnp.bfloat16)
  with pytest.raises(ValueError, match="no weights have been pushed yet"):
    ps.pull()
  p1, _ = _params(tmesh, 1)
  p2, host2 = _params(tmesh, 2)
  ps.push(p1, 1)
  ps.push(p2, 2)
  out, v = ps.pull()
  assert v == ps.version == 2
  np.testing.assert_array_equal(np.asarray(out["final_norm"]), host2["final_norm"].astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="push version 2 is not newer than the current version 2"):
    ps.push(p1, 2)


@pytest.mark.parametrize("kw,n_buckets", [(dict(mode="per_layer"), CFG.n_layers + 1),
                                          (dict(bucket_bytes=6000), None)])
def test_bucketed_push_equals_unbucketed(meshes, kw, n_buckets):
  tmesh, smesh = meshes
  params, host = _params(tmesh, 3)
  targets = M.param_shardings(CFG, smesh)
  whole = ParameterServer(targets, jnp.bfloat16)
  whole.push(params, 1)
  ps = ParameterServer(targets, jnp.bfloat16, **kw)
  before = ps_lib.TRACE_COUNTS["extract"]
  buckets = list(ps.push_iter(params, 1))
  stats = ps.last_stats
  assert stats.n_buckets == len(buckets) > 1
  if n_buckets:
    assert len(buckets) == n_buckets
    # One compile for the layer buckets (the index is traced), one for the rest: no recompile per layer.
    assert ps_lib.TRACE_COUNTS["extract"] - before <= 2
  else:
    for b in buckets:
      assert b.nbytes <= 6000 or len(b.units) == 1, b.units
  assert sum(b.nbytes for b in buckets) == stats.bytes == whole.last_stats.bytes
  out = ps.pull()[0]
  _check_on_sampler(out, host, targets, jnp.bfloat16)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(whole.pull()[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_in_flight_bucket_swap(meshes):
  """The sampler swaps per-layer buckets of v2 into its live v1 weights between decode chunks."""
  tmesh, smesh = meshes
  targets = M.param_shardings(CFG, smesh)
  p1, host1 = _params(tmesh, 4)
  p2, host2 = _params(tmesh, 5)
  ps = ParameterServer(targets, jnp.bfloat16, mode="per_layer")
  ps.push(p1, 1)
  live, _ = ps.pull()
  it = ps.push_iter(p2, 2)
  first = next(it)
  assert first.units and all(layer == 0 for _, layer in first.units)
  live = apply_bucket(live, first)
  q = np.asarray(live["layers"]["q"])
  np.testing.assert_array_equal(q[0], host2["layers"]["q"][0].astype(jnp.bfloat16))  # swapped
  np.testing.assert_array_equal(q[1], host1["layers"]["q"][1].astype(jnp.bfloat16))  # not yet
  assert ps.pull()[1] == 1  # v2 is not published until every bucket has arrived
  for bucket in it:
    live = apply_bucket(live, bucket, donate=True)
  assert ps.pull()[1] == 2
  _check_on_sampler(live, host2, targets, jnp.bfloat16)


def test_generic_pytree_and_mismatch(meshes):
  tmesh, smesh = meshes
  from jax.sharding import NamedSharding, PartitionSpec as P
  src = {"a": jax.device_put(jnp.arange(8.0), NamedSharding(tmesh, P("fsdp"))),
         "b": [jax.device_put(jnp.arange(4, dtype=jnp.int32), NamedSharding(tmesh, P()))]}
  targets = {"a": NamedSharding(smesh, P("tensor")), "b": [NamedSharding(smesh, P("data"))]}
  ps = ParameterServer(targets, jnp.bfloat16, bucket_bytes=8)
  stats = ps.push(src, 1)
  out, _ = ps.pull()
  assert out["b"][0].dtype == jnp.int32  # only floating leaves are cast
  np.testing.assert_array_equal(np.asarray(out["a"]), np.arange(8.0))
  assert out["a"].sharding == targets["a"] and stats.n_buckets == 2
  with pytest.raises(ValueError, match=r"differing leaves: \['c'\]"):
    ps.push({**src, "c": src["a"]}, 2)
  with pytest.raises(ValueError, match="mode='bytes' needs a positive bucket_bytes"):
    ParameterServer(targets, mode="bytes")


def test_colocated_push_same_devices_new_layout():
  """Colocated roles: same 8 devices, trainer fsdp=8 → sampler data=2 × tensor=4."""
  devs = jax.devices()
  tmesh, smesh = M.make_mesh(devs, fsdp=8), M.make_mesh(devs, data=2, tensor=4)
  params, host = _params(tmesh, 6)
  targets = M.param_shardings(CFG, smesh)
  ps = ParameterServer(targets, jnp.bfloat16, mode="per_layer")
  ps.push(params, 1)
  out, _ = ps.pull()
  for a, h, t in zip(jax.tree.leaves(out), jax.tree.leaves(host), jax.tree.leaves(targets)):
    np.testing.assert_array_equal(np.asarray(a), h.astype(jnp.bfloat16))
    assert a.sharding == t
  assert out["layers"]["q"].sharding.spec != params["layers"]["q"].sharding.spec


@pytest.mark.parametrize("mode", ["whole", "per_layer"])
def test_colocated_push_does_not_alias_donated_trainer_buffers(meshes, mode):
  """Same mesh, same shardings, same dtype: the sampler must still get its own buffers."""
  tmesh, _ = meshes
  params, host = _params(tmesh, 5)
  shardings = M.param_shardings(CFG, tmesh)
  ps = ParameterServer(shardings, mode=mode)
  ps.push(params, version=1)
  jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(params)  # the trainer's next step
  out, _ = ps.pull()
  for a, h in zip(jax.tree.leaves(out), jax.tree.leaves(host)):
    np.testing.assert_array_equal(np.asarray(a), h)
