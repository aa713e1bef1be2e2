"""Topology: slices, role assignment, meshes, reassignment after preemption, slice-loss guard."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax import topology as T


def _ids(mesh):
  return sorted(d.id for d in mesh.devices.flat)


def _disagg(**kw):
  cfg = dict(slice_size=2, trainer_slices=2, trainer_mesh={"fsdp": -1},
             sampler_mesh={"data": -1, "tensor": 2})
  return T.build_topology({**cfg, **kw})


def test_discover_simulated_slices():
  slices = T.discover_slices(jax.devices(), slice_size=2)
  assert [s.index for s in slices] == [0, 1, 2, 3]
  assert [[d.id for d in s.devices] for s in slices] == [[0, 1], [2, 3], [4, 5], [6, 7]]
  with pytest.raises(ValueError, match="slice_size=3 does not divide 8 devices"):
    T.discover_slices(jax.devices(), slice_size=3)


def test_disaggregated_roles_and_meshes():
  topo = _disagg()
  assert topo.assignment.trainer == (0, 1) and topo.assignment.sampler == (2, 3)
  assert not topo.colocated
  assert _ids(topo.trainer_mesh) == [0, 1, 2, 3] and _ids(topo.sampler_mesh) == [4, 5, 6, 7]
  assert dict(topo.trainer_mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
  assert dict(topo.sampler_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}


def test_colocated_roles_share_devices():
  topo = T.build_topology(T.TopologyConfig(slice_size=2, trainer_slices=4, colocated=True,
                                           sampler_mesh={"data": -1, "tensor": 4}))
  assert topo.colocated and topo.assignment.trainer == topo.assignment.sampler == (0, 1, 2, 3)
  assert _ids(topo.trainer_mesh) == _ids(topo.sampler_mesh) == list(range(8))
  assert dict(topo.sampler_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}


def test_bad_configs_are_clear_errors():
  with pytest.raises(ValueError, match="does not fit 4 slices"):
    T.build_topology({"slice_size": 2, "trainer_slices": 4})
  with pytest.raises(ValueError, match="unknown topology config keys \\['trainer'\\]"):
    T.build_topology({"trainer": 1})
  with pytest.raises(ValueError, match="sampler mesh .* does not fit its 4 devices"):
    _disagg(sampler_mesh={"data": 3, "tensor": 1})


def test_sampler_loss_shrinks_fleet():
  topo = T.reassign(_disagg(), lost_slices=[3])
  assert topo.assignment.trainer == (0, 1) and topo.assignment.sampler == (2,)
  assert _ids(topo.sampler_mesh) == [4, 5] and dict(topo.sampler_mesh.shape)["tensor"] == 2


def test_trainer_loss_steals_sampler_slice():
  topo = T.reassign(_disagg(), lost_slices=[0])
  assert topo.assignment.trainer == (1, 2) and topo.assignment.sampler == (3,)
  assert _ids(topo.trainer_mesh) == [2, 3, 4, 5] and dict(topo.trainer_mesh.shape)["fsdp"] == 4
  assert topo.assignment.lost == (0,)


def test_no_sampler_left_colocates_then_return_rejoins_as_sampler():
  topo = T.reassign(_disagg(), lost_slices=[0, 3])
  assert topo.assignment.trainer == (1, 2) and topo.colocated
  assert _ids(topo.sampler_mesh) == _ids(topo.trainer_mesh) == [2, 3, 4, 5]
  back = T.reassign(topo, returned_slices=[0])
  assert back.assignment.trainer == (1, 2) and back.assignment.sampler == (0,) and not back.colocated
  assert back.assignment.lost == (3,)
  again = T.reassign(back, returned_slices=[3])
  assert again.assignment.sampler == (0, 3) and again.assignment.lost == ()


def test_down_to_one_slice_then_all_lost():
  topo = T.reassign(_disagg(), lost_slices=[0, 1, 2])
  assert topo.assignment.trainer == (3,) and topo.colocated
  assert dict(topo.trainer_mesh.shape)["fsdp"] == 2
  with pytest.raises(T.NoHealthySlicesError, match=r"all slices are lost \(\[0, 1, 2, 3\]\)"):
    T.reassign(topo, lost_slices=[3])


def test_colocated_run_stays_colocated():
  topo = T.build_topology({"slice_size": 2, "trainer_slices": 4, "colocated": True})
  lost = T.reassign(topo, lost_slices=[1])
  assert lost.assignment.trainer == lost.assignment.sampler == (0, 2, 3) and lost.colocated
  assert dict(lost.trainer_mesh.shape)["fsdp"] == 6
  back = T.reassign(lost, returned_slices=[1])
  assert back.assignment.trainer == (0, 1, 2, 3)


def test_reassign_rejects_unknown_or_conflicting_slices():
  with pytest.raises(ValueError, match=r"unknown slice indices \[9\]"):
    T.reassign(_disagg(), lost_slices=[9])
  with pytest.raises(ValueError, match=r"slices \[1\] are both lost and returned"):
    T.reassign_roles(_disagg().assignment, lost=[1], returned=[1])


def test_fault_injector_guards_lost_slice():
  topo = _disagg()
  fi = T.FaultInjector(topo.slices)
  x = jax.device_put(jnp.ones((4, 4)), NamedSharding(topo.sampler_mesh, P("data", "tensor")))
  fi.ensure_alive(topo.sampler_mesh)
  fi.lose(3)
  assert fi.lost == {3} and not fi.is_alive(3)
  with pytest.raises(T.SliceLostError, match="slice 3 is lost") as e:
    fi.ensure_alive(topo.sampler_mesh)
  assert e.value.slice_index == 3
  with pytest.raises(T.SliceLostError, match="slice 3 is lost .* arrays"):
    fi.ensure_alive({"w": x})
  with pytest.raises(T.SliceLostError, match="slice 3"):
    fi.ensure_alive(list(topo.sampler_mesh.devices.flat))
  fi.ensure_alive(topo.trainer_mesh)  # untouched slices stay usable
  fi.restore(3)
  fi.ensure_alive(x)
  with pytest.raises(ValueError, match="unknown slice 7"):
    fi.lose(7)


@dataclasses.dataclass(frozen=True)
class _TpuDevice:
  """Stand-in for an abstract TPU topology device (get_topology_desc(...).devices)."""
  id: int
  slice_index: int
  platform: str = "tpu"


def test_multislice_grouping_by_slice_index():
  devs = [_TpuDevice(i, i // 4) for i in reversed(range(16))]  # 4 slices of 4 chips
  topo = T.build_topology({"trainer_slices": 1, "trainer_mesh": {"fsdp": -1, "tensor": 2}}, devs)
  assert [len(s.devices) for s in topo.slices] == [4, 4, 4, 4]
  assert topo.assignment.sampler == (1, 2, 3)
  assert dict(topo.trainer_mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
  assert _ids(topo.sampler_mesh) == list(range(4, 16))
  moved = T.reassign(topo, lost_slices=[0])
  assert moved.assignment.trainer == (1,) and _ids(moved.trainer_mesh) == [4, 5, 6, 7]
  fi = T.FaultInjector(topo.slices)
  fi.lose(2)
  with pytest.raises(T.SliceLostError, match="slice 2"):
    fi.ensure_alive(topo.sampler_mesh)


def _with_service(**kw):
  """Slices 0 train, 1-2 sample, 3 serves the run's frozen models."""
  return T.build_topology({"slice_size": 2, "trainer_slices": 1, "service_slices": 1, **kw})


def test_service_slices_are_the_last_and_have_their_own_mesh():
  topo = _with_service(service_mesh={"tensor": 2})
  a = topo.assignment
  assert (a.trainer, a.sampler, a.service, a.target_service) == ((0,), (1, 2), (3,), 1)
  assert _ids(topo.service_mesh) == [6, 7] and dict(topo.service_mesh.shape)["tensor"] == 2
  plain = T.build_topology(dict(slice_size=2, trainer_slices=1))
  assert plain.assignment.service == () and plain.service_mesh is plain.sampler_mesh  # nothing of its own
  colo = _with_service(colocated=True, trainer_slices=3)
  assert colo.assignment.trainer == colo.assignment.sampler == (0, 1, 2) and colo.assignment.service == (3,)
  with pytest.raises(ValueError, match="service_slices=3 does not fit 4 slices"):
    T.build_topology(dict(slice_size=2, trainer_slices=1, service_slices=3))
  with pytest.raises(ValueError, match="service_slices must be >= 0"):
    T.build_topology(dict(slice_size=2, service_slices=-1))


def test_lost_service_slices_move_the_services_beside_the_sampler_until_they_return():
  lost = T.reassign(_with_service(), lost_slices=[3])
  assert lost.assignment.service == () and lost.assignment.sampler == (1, 2)
  assert lost.service_mesh is lost.sampler_mesh
  back = T.reassign(lost, returned_slices=[3])
  assert back.assignment.service == (3,) and back.assignment.sampler == (1, 2) and _ids(back.service_mesh) == [6, 7]
  # A returned slice refills the service first; one more than it needs rejoins the samplers.
  both = T.reassign(T.reassign(_with_service(), lost_slices=[2, 3]), returned_slices=[2, 3])
  assert both.assignment.service == (2,) and both.assignment.sampler == (1, 3)


def test_the_trainer_takes_a_sampler_slice_before_a_service_slice():
  topo = T.reassign(_with_service(), lost_slices=[0])
  assert (topo.assignment.trainer, topo.assignment.sampler, topo.assignment.service) == ((1,), (2,), (3,))
  last = T.reassign(_with_service(), lost_slices=[0, 1, 2])  # no sampler slice left: the service's goes
  assert last.assignment.trainer == (3,) and last.colocated and last.assignment.service == ()
  assert _ids(last.service_mesh) == _ids(last.trainer_mesh) == [6, 7]


def test_a_trainer_left_with_nothing_takes_a_returned_or_service_slice_first():
  topo = T.reassign(T.reassign(_with_service(), lost_slices=[1]), lost_slices=[2])
  again = T.reassign(topo, lost_slices=[0], returned_slices=[1])  # the returned slice trains; the service stays
  assert (again.assignment.trainer, again.assignment.service, again.colocated) == ((1,), (3,), True)
  colo = _with_service(colocated=True, trainer_slices=1)  # slices 0 (both roles) and 3 (service)
  last = T.reassign(colo, lost_slices=[0])
  assert last.assignment.trainer == (3,) and last.assignment.service == ()
  with pytest.raises(ValueError, match="service_slices must be >= 0 and leave a slice to train on, got 4 of 4"):
    _with_service(service_slices=4)
