"""The parameter server's move (rlax.weights.reshard): trainer→sampler reshard across disjoint submeshes, dtype
cast, no aliasing of donated trainer buffers, bit-exact host transport; and the WeightsService that owns the
versions (one check per push, the trainer-side history a rebuilt sampler replays)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax import models as M
from rlax.weights import DevicePutTransport, WeightsService
from rlax.weights import reshard as rs_lib
from rlax.weights.reshard import reshard

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
def test_reshard_casts_on_disjoint_meshes(meshes, transport):
  tmesh, smesh = meshes
  params, host = _params(tmesh, 0)
  targets = M.param_shardings(CFG, smesh)
  out, stats = reshard(params, targets, jnp.bfloat16, transport=transport)
  assert stats.transport == ("host" if transport == "auto" else "device")
  _check_on_sampler(out, host, targets, jnp.bfloat16)
  n = sum(x.size for x in jax.tree.leaves(host))
  assert stats.bytes == 2 * n and stats.source_bytes == 4 * n
  assert stats.gb_per_s == pytest.approx(stats.bytes / stats.seconds / 1e9)
  assert stats.as_dict() == {"sync_s": stats.seconds, "sync_bytes": 2 * n, "sync_gb_per_s": stats.gb_per_s}
  # The trainer's copy is untouched and still lives on the trainer mesh.
  assert {d.id for d in params["embed"].sharding.device_set} == {0, 1, 2, 3}
  assert params["embed"].dtype == jnp.float32


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_cast_keeps_dtype(meshes, transport):
  tmesh, smesh = meshes
  params, host = _params(tmesh, 1)
  targets = M.param_shardings(CFG, smesh)
  _check_on_sampler(reshard(params, targets, None, transport=transport)[0], host, targets, jnp.float32)


def test_service_owns_versions_with_one_check_per_push(meshes):
  tmesh, smesh = meshes
  svc = WeightsService(DevicePutTransport(M.param_shardings(CFG, smesh), jnp.bfloat16))
  with pytest.raises(ValueError, match="no weights have been published yet"):
    svc.latest()
  p1, _ = _params(tmesh, 1)
  p2, host2 = _params(tmesh, 2)
  assert svc.push(p1, 1)["sync_bytes"] > 0
  svc.push(p2, 2)
  out, v = svc.latest()
  assert v == svc.version == svc.pushed == 2
  np.testing.assert_array_equal(np.asarray(out["final_norm"]), host2["final_norm"].astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="push version 2 is not newer than the last pushed version 2"):
    svc.push(p1, 2)
  with pytest.raises(ValueError, match="weights version 1 is not newer than the newest published, 2"):
    svc.publish(out, 1)
  with pytest.raises(ValueError, match="differing leaves"):
    svc.push({"embed": p1["embed"]}, 3)


def test_history_is_replayed_into_a_rebuilt_service(meshes):
  """Deterministic failover: the trainer-side copies of the last k pushes (copied: the trainer donates its
  params) are taken over by the new service, which pushes exactly the versions batch `first` needs."""
  tmesh, smesh = meshes
  svc = WeightsService(DevicePutTransport(M.param_shardings(CFG, smesh), None), history=2)
  pushed = {}
  for v in range(4):
    pushed[v] = _params(tmesh, 10 + v)
    svc.push(pushed[v][0], v)
  assert sorted(svc.kept) == [2, 3]
  jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(pushed[2][0])  # the trainer's next step
  new = WeightsService(DevicePutTransport(M.param_shardings(CFG, smesh), None), keep=3, history=2)
  new.adopt_history(svc)
  step_params, _ = _params(tmesh, 20)
  plan = new.replay(first=6, step=4, params=step_params, staleness=2, exact=True)
  assert [v for _, v in plan] == [4] and plan[0][0] is step_params  # batch 6 needs version 4: the trainer's
  plan = new.replay(first=4, step=4, params=step_params, staleness=2, exact=True)
  assert [v for _, v in plan] == [2, 3, 4]
  np.testing.assert_array_equal(np.asarray(plan[0][0]["embed"]), pushed[2][1]["embed"])  # the copy, intact
  for params, v in plan:
    new.push(params, v)
  assert new.version == 4 and new.wait_for(2, exact=True)[1] == 2
  with pytest.raises(RuntimeError, match=r"needs weight versions \[1, 2\]"):
    new.replay(first=3, step=4, params=step_params, staleness=2, exact=True)
  assert [v for _, v in new.replay(first=3, step=4, params=step_params, staleness=2, exact=False)] == [4]
  new.forget_history()
  assert new.kept == {}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_colocated_push_same_devices_new_layout(transport):
  """Colocated roles: same 8 devices, trainer fsdp=8 → sampler data=2 × tensor=4."""
  devs = jax.devices()
  tmesh, smesh = M.make_mesh(devs, fsdp=8), M.make_mesh(devs, data=2, tensor=4)
  params, host = _params(tmesh, 6)
  targets = M.param_shardings(CFG, smesh)
  out, _ = reshard(params, targets, jnp.bfloat16, transport=transport)
  for a, h, t in zip(jax.tree.leaves(out), jax.tree.leaves(host), jax.tree.leaves(targets)):
    np.testing.assert_array_equal(np.asarray(a), h.astype(jnp.bfloat16))
    assert a.sharding == t
  assert out["layers"]["q"].sharding.spec != params["layers"]["q"].sharding.spec


def _pointers(tree) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_colocated_push_does_not_alias_donated_trainer_buffers(meshes, transport):
  """Same mesh, same shardings, same dtype: the sampler must still get its own buffers."""
  tmesh, _ = meshes
  params, host = _params(tmesh, 5)
  out, _ = reshard(params, M.param_shardings(CFG, tmesh), transport=transport)
  assert not _pointers(out) & _pointers(params)
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


def test_host_transport_equals_cast_and_device_put_bit_for_bit(meshes):
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
  out, _ = reshard(src, targets, jnp.bfloat16, transport="host")
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
  p1, _ = _params(tmesh, 7)
  p2, host2 = _params(tmesh, 8)
  reshard(p1, targets, jnp.bfloat16)
  before = dict(rs_lib.TRACE_COUNTS)
  out, stats = reshard(p2, targets, jnp.bfloat16)
  assert stats.transport == "host" and dict(rs_lib.TRACE_COUNTS) == before
  _check_on_sampler(out, host2, targets, jnp.bfloat16)
  q = out["layers"]["q"]  # P(None, None, 'tensor', None) on data=2 × tensor=2: two replicas per block
  by_index = {}
  for s in q.addressable_shards:
    by_index.setdefault(str(s.index), set()).add(s.data.unsafe_buffer_pointer())
  assert len(by_index) == 2 and all(len(ptrs) == 1 for ptrs in by_index.values())
  # Donating one holder of an adopted buffer must not change the others.
  zeroed = jax.jit(lambda x: x.at[0].set(0), donate_argnums=0)(q)
  assert not np.asarray(zeroed[0]).any()
  np.testing.assert_array_equal(np.asarray(out["layers"]["k"]), host2["layers"]["k"].astype(jnp.bfloat16))


def test_bad_transport():
  with pytest.raises(ValueError, match="transport='nccl'"):
    reshard({}, {}, transport="nccl")
