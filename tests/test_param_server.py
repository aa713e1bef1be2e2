"""Parameter server: trainer→sampler reshard across disjoint submeshes, dtype cast, versions, buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax import models as M
from rlax import param_server as ps_lib
from rlax.param_server import ParameterServer, apply_bucket

CFG = M.ModelConfig(vocab_size=128, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
# On CPU 'auto' picks the host transport; 'device' (the accelerator path) is forced to keep it tested here.
TRANSPORTS = ["host", "device"]


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


@pytest.mark.parametrize("transport", ["auto", "device"])
def test_push_reshards_and_casts_on_disjoint_meshes(meshes, transport):
  tmesh, smesh = meshes
  params, host = _params(tmesh, 0)
  targets = M.param_shardings(CFG, smesh)
  ps = ParameterServer(targets, jnp.bfloat16, transport=transport)
  stats = ps.push(params, version=1)
  out, version = ps.pull()
  assert version == 1 and stats.version == 1 and stats.n_buckets == 1 and stats.mode == "whole"
  assert stats.transport == ("host" if transport == "auto" else "device")
  _check_on_sampler(out, host, targets, jnp.bfloat16)
  n = sum(x.size for x in jax.tree.leaves(host))
  assert stats.bytes == 2 * n and stats.source_bytes == 4 * n
  assert stats.gb_per_s == pytest.approx(stats.bytes / stats.seconds / 1e9)
  assert stats.as_dict()["sync/bytes"] == 2 * n and "sync/transport" not in stats.as_dict()
  # The trainer's copy is untouched and still lives on the trainer mesh.
  assert {d.id for d in params["embed"].sharding.device_set} == {0, 1, 2, 3}
  assert params["embed"].dtype == jnp.float32


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_cast_keeps_dtype(meshes, transport):
  tmesh, smesh = meshes
  params, host = _params(tmesh, 1)
  targets = M.param_shardings(CFG, smesh)
  ps = ParameterServer(targets, sampler_dtype=None, transport=transport)
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


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kw,n_buckets", [(dict(mode="per_layer"), CFG.n_layers + 1),
                                          (dict(bucket_bytes=6000), None)])
def test_bucketed_push_equals_unbucketed(meshes, kw, n_buckets, transport):
  tmesh, smesh = meshes
  params, host = _params(tmesh, 3)
  targets = M.param_shardings(CFG, smesh)
  whole = ParameterServer(targets, jnp.bfloat16, transport="device")
  whole.push(params, 1)
  ps = ParameterServer(targets, jnp.bfloat16, transport=transport, **kw)
  before = dict(ps_lib.TRACE_COUNTS)
  buckets = list(ps.push_iter(params, 1))
  stats = ps.last_stats
  assert stats.n_buckets == len(buckets) > 1 and stats.transport == transport
  if n_buckets:
    assert len(buckets) == n_buckets
    # Never a compile per layer. Device: one for the layer buckets (the index is traced), one for the rest;
    # host: at most one cast per leaf.
    if transport == "device":
      assert ps_lib.TRACE_COUNTS["extract"] - before.get("extract", 0) <= 2
    else:
      assert ps_lib.TRACE_COUNTS["cast"] - before.get("cast", 0) <= len(jax.tree.leaves(params))
  else:
    for b in buckets:
      assert b.nbytes <= 6000 or len(b.units) == 1, b.units
  assert sum(b.nbytes for b in buckets) == stats.bytes == whole.last_stats.bytes
  out = ps.pull()[0]
  _check_on_sampler(out, host, targets, jnp.bfloat16)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(whole.pull()[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("transport,donate_first", [("host", False), ("host", True), ("device", False)])
def test_in_flight_bucket_swap(meshes, transport, donate_first):
  """The sampler swaps per-layer buckets of v2 into its live v1 weights between decode chunks."""
  tmesh, smesh = meshes
  targets = M.param_shardings(CFG, smesh)
  p1, host1 = _params(tmesh, 4)
  p2, host2 = _params(tmesh, 5)
  ps = ParameterServer(targets, jnp.bfloat16, mode="per_layer", transport=transport)
  ps.push(p1, 1)
  live, _ = ps.pull()
  it = ps.push_iter(p2, 2)
  first = next(it)
  assert first.units and all(layer == 0 for _, layer in first.units)
  # Donating the adopted v1 buffers (host transport) must copy, never write into memory v1 shares.
  live = apply_bucket(live, first, donate=donate_first)
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


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_colocated_push_same_devices_new_layout(transport):
  """Colocated roles: same 8 devices, trainer fsdp=8 → sampler data=2 × tensor=4."""
  devs = jax.devices()
  tmesh, smesh = M.make_mesh(devs, fsdp=8), M.make_mesh(devs, data=2, tensor=4)
  params, host = _params(tmesh, 6)
  targets = M.param_shardings(CFG, smesh)
  ps = ParameterServer(targets, jnp.bfloat16, mode="per_layer", transport=transport)
  ps.push(params, 1)
  out, _ = ps.pull()
  for a, h, t in zip(jax.tree.leaves(out), jax.tree.leaves(host), jax.tree.leaves(targets)):
    np.testing.assert_array_equal(np.asarray(a), h.astype(jnp.bfloat16))
    assert a.sharding == t
  assert out["layers"]["q"].sharding.spec != params["layers"]["q"].sharding.spec


def _pointers(tree) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["whole", "per_layer"])
def test_colocated_push_does_not_alias_donated_trainer_buffers(meshes, mode, transport):
  """Same mesh, same shardings, same dtype: the sampler must still get its own buffers."""
  tmesh, _ = meshes
  params, host = _params(tmesh, 5)
  shardings = M.param_shardings(CFG, tmesh)
  ps = ParameterServer(shardings, mode=mode, transport=transport)
  buckets = list(ps.push_iter(params, version=1))
  out, _ = ps.pull()
  assert not _pointers(out) & _pointers(params)
  assert not _pointers([a for b in buckets for a in b.arrays]) & _pointers(params)
  jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(params)  # the trainer's next step
  for a, h in zip(jax.tree.leaves(out), jax.tree.leaves(host)):
    np.testing.assert_array_equal(np.asarray(a), h)


def _special_values(shape, seed):
  """Normal values plus the f32 → bf16 corner cases: NaNs with payloads, infinities, signed zeros,
  subnormals, rounding ties and values that overflow bf16."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32).ravel()
  bits = np.array([0x7FC00000, 0x7F800001, 0xFFC00123, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
                   0x00000001, 0x807FFFFF, 0x00400000, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x3F80FFFF],
                  np.uint32).view(np.float32)
  x[:len(bits)] = bits
  return x.reshape(shape)


@pytest.mark.parametrize("mode", ["whole", "per_layer", "bytes"])
def test_host_transport_equals_cast_and_device_put_bit_for_bit(meshes, mode):
  """Any source/target layout pair (sharded, replicated, single device, scalar, integer): the host
  transport delivers exactly the bits of `device_put(jit(astype)(x), target)`, on the target sharding."""
  tmesh, smesh = meshes
  devs = jax.devices()
  S = lambda mesh, *spec: NamedSharding(mesh, P(*spec))
  src = {
      "layers": {"w": jax.device_put(_special_values((4, 8, 6), 0), S(tmesh, None, "fsdp", None)),
                 "b": jax.device_put(_special_values((4, 6), 1), S(tmesh))},
      "embed": jax.device_put(_special_values((16, 4), 2), S(tmesh, "fsdp", None)),
      "one_device": jax.device_put(_special_values((6, 4), 3), devs[0]),
      "scalar": jax.device_put(np.float32(np.nan), S(tmesh)),
      "ids": jax.device_put(np.arange(12, dtype=np.int32).reshape(4, 3), S(tmesh, "fsdp", None)),
  }
  targets = {"layers": {"w": S(smesh, None, "data", "tensor"), "b": S(smesh, None, "tensor")},
             "embed": S(smesh, None, ("data", "tensor")), "one_device": S(smesh),
             "scalar": jax.sharding.SingleDeviceSharding(devs[5]), "ids": S(smesh, "tensor", None)}
  ps = ParameterServer(targets, jnp.bfloat16, mode=mode, bucket_bytes=64 if mode == "bytes" else None,
                       transport="host")
  ps.push(src, 1)
  out, _ = ps.pull()
  cast = jax.jit(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x)
  ref = jax.device_put(jax.tree.map(cast, src), targets)
  for (path, a), r, t in zip(jax.tree_util.tree_flatten_with_path(out)[0], jax.tree.leaves(ref),
                             jax.tree.leaves(targets)):
    name = jax.tree_util.keystr(path)
    assert a.dtype == r.dtype and a.shape == r.shape and a.sharding == t, name
    for sa, sr in zip(a.addressable_shards, r.addressable_shards):
      assert sa.device == sr.device and sa.index == sr.index, name
      u = np.dtype(f"uint{8 * a.dtype.itemsize}")
      np.testing.assert_array_equal(np.asarray(sa.data).view(u), np.asarray(sr.data).view(u), err_msg=name)


def test_host_transport_adopts_buffers_and_does_not_retrace(meshes):
  """Replicas share one adopted buffer (no copy per device); a second push traces and compiles nothing."""
  tmesh, smesh = meshes
  targets = M.param_shardings(CFG, smesh)
  ps = ParameterServer(targets, jnp.bfloat16, mode="per_layer")
  p1, _ = _params(tmesh, 7)
  p2, host2 = _params(tmesh, 8)
  ps.push(p1, 1)
  before = dict(ps_lib.TRACE_COUNTS)
  stats = ps.push(p2, 2)
  assert stats.transport == "host" and dict(ps_lib.TRACE_COUNTS) == before
  out, _ = ps.pull()
  _check_on_sampler(out, host2, targets, jnp.bfloat16)
  q = out["layers"]["q"]  # P(None, None, 'tensor', None) on data=2 × tensor=2: two replicas per block
  by_index = {}
  for s in q.addressable_shards:
    by_index.setdefault(str(s.index), set()).add(s.data.unsafe_buffer_pointer())
  assert len(by_index) == 2 and all(len(ptrs) == 1 for ptrs in by_index.values())


def test_donating_host_delivered_weights_keeps_other_holders_intact(meshes):
  """Bucket arrays and replicas share the adopted buffers: donating one holder must not change the others."""
  tmesh, smesh = meshes
  targets = M.param_shardings(CFG, smesh)
  params, host = _params(tmesh, 9)
  ps = ParameterServer(targets, jnp.bfloat16, mode="per_layer")
  buckets = list(ps.push_iter(params, 1))
  out, _ = ps.pull()
  zeroed = jax.jit(lambda x: x.at[0].set(0), donate_argnums=0)(out["layers"]["q"])
  assert not np.asarray(zeroed[0]).any()
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
  q0 = buckets[0].arrays[buckets[0].units.index((names.index("['layers']['q']"), 0))]  # layer 0 of q
  np.testing.assert_array_equal(np.asarray(q0), host["layers"]["q"][0].astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(out["layers"]["k"]), host["layers"]["k"].astype(jnp.bfloat16))


def test_bad_transport():
  with pytest.raises(ValueError, match="transport='nccl'"):
    ParameterServer({}, transport="nccl")
