"""Slices, roles and meshes: which devices train, which sample, and what happens when a slice is lost.

A *slice* is the unit of preemption: a TPU slice (grouped by `device.slice_index`), or on CPU and
single-host GPU a simulated group of `slice_size` consecutive devices. Slices are assigned to two
roles: the trainer (reference and critic models live with it) and the sampler fleet. Colocated
(both roles time-share the same slices) and disaggregated (disjoint slices) runs are the same code
with different configs. When slices are lost, `reassign` keeps the trainer whole first, shrinking the
sampler fleet, and falls back to colocation when no sampler slice is left; returning slices rejoin
as samplers. A third role, the *service* slices (`service_slices`), holds frozen models beside the run (a
distilling run's teacher, a judge: `placement="own"`); losing them moves the services beside the sampler
until a slice returns. Everything here except mesh building is pure logic on slice indices, so it also works
on abstract TPU topology devices (`jax.experimental.topologies.get_topology_desc(...).devices`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh

from rlax.models import sharding as msharding


class SliceLostError(RuntimeError):
  """Code touched devices of a slice that is marked lost (preempted)."""

  def __init__(self, slice_index: int, what: str = "devices"):
    super().__init__(f"slice {slice_index} is lost (preempted); refusing to touch its {what}")
    self.slice_index = slice_index


class NoHealthySlicesError(RuntimeError):
  """Every slice is lost: there is nothing left to train on."""


@dataclasses.dataclass(frozen=True)
class TopologyConfig:
  """How to cut devices into slices and slices into roles.

  `slice_size`: devices per simulated slice; None groups by `device.slice_index` (TPU multi-slice,
  or one slice when devices have no such attribute). `sampler_slices=-1` gives the sampler every slice
  the trainer does not take. With `colocated`, both roles use all `trainer_slices` slices. `service_slices`:
  the last slices, kept for the run's frozen models (teacher, judge) when their placement is "own". Mesh axis
  dicts map 'data'/'fsdp'/'tensor' to sizes; one may be -1, the axis that absorbs a change in device
  count after a reassignment.
  """
  slice_size: int | None = None
  trainer_slices: int = 1
  sampler_slices: int = -1
  colocated: bool = False
  trainer_mesh: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {"data": 1, "fsdp": -1, "tensor": 1})
  sampler_mesh: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {"data": -1, "fsdp": 1, "tensor": 1})
  service_slices: int = 0
  service_mesh: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {"data": -1, "fsdp": 1, "tensor": 1})

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "TopologyConfig":
    """From a dict or ml_collections ConfigDict; unknown keys are an error."""
    d = dict(d.to_dict() if hasattr(d, "to_dict") else d)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"unknown topology config keys {unknown}; expected a subset of {sorted(names)}")
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class Slice:
  """One preemptible group of devices."""
  index: int
  devices: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Assignment:
  """Slice indices per role.

  `colocated`: the sampler time-shares the trainer's slices, either by config (`want_colocated`) or
  because preemption left no slice for it. `target_trainer`: the trainer size the config asked for.
  `service`: the services' own slices (none: they share the sampler's); `target_service` the size asked for.
  """
  trainer: tuple[int, ...]
  sampler: tuple[int, ...]
  colocated: bool
  target_trainer: int
  lost: tuple[int, ...] = ()
  want_colocated: bool = False
  service: tuple[int, ...] = ()
  target_service: int = 0


def discover_slices(devices: Sequence[Any] | None = None, slice_size: int | None = None) -> tuple[Slice, ...]:
  """Group `devices` (default `jax.devices()`) into slices, ordered by slice index then device id.

  With `slice_size`, consecutive devices (by id) form simulated slices of that size; otherwise devices
  are grouped by their `slice_index` attribute (missing ⇒ all in slice 0).
  """
  devs = sorted(jax.devices() if devices is None else devices, key=lambda d: d.id)
  if not devs:
    raise ValueError("no devices to build slices from")
  if slice_size is not None:
    if slice_size <= 0 or len(devs) % slice_size:
      raise ValueError(f"slice_size={slice_size} does not divide {len(devs)} devices into whole slices")
    return tuple(Slice(i, tuple(devs[i * slice_size:(i + 1) * slice_size]))
                 for i in range(len(devs) // slice_size))
  groups: dict[int, list[Any]] = {}
  for d in devs:
    groups.setdefault(int(getattr(d, "slice_index", 0) or 0), []).append(d)
  return tuple(Slice(i, tuple(groups[i])) for i in sorted(groups))


def assign_roles(slice_indices: Sequence[int], config: TopologyConfig) -> Assignment:
  """Initial role assignment: the first `trainer_slices` slices train, the next ones sample, the last
  `service_slices` serve the run's frozen models."""
  nv, every = config.service_slices, tuple(sorted(slice_indices))
  if not 0 <= nv < len(every):
    raise ValueError(f"topology.service_slices must be >= 0 and leave a slice to train on, got {nv} of "
                     f"{len(every)} slices")
  idx, service = every[:len(every) - nv], every[len(every) - nv:]
  nt = config.trainer_slices
  if nt <= 0:
    raise ValueError(f"trainer_slices must be positive, got {nt}")
  if config.colocated:
    if nt > len(idx):
      raise ValueError(f"colocated run asks for {nt} slices (+ {nv} service) but only {len(every)} exist")
    return Assignment(idx[:nt], idx[:nt], True, nt, (), True, service, nv)
  ns = len(idx) - nt if config.sampler_slices == -1 else config.sampler_slices
  if ns <= 0 or nt + ns > len(idx):
    raise ValueError(f"trainer_slices={nt} + sampler_slices={config.sampler_slices} + service_slices={nv} does not "
                     f"fit {len(every)} slices (disaggregated needs at least one sampler slice)")
  return Assignment(idx[:nt], idx[nt:nt + ns], False, nt, service=service, target_service=nv)


def reassign_roles(assignment: Assignment, lost: Iterable[int] = (), returned: Iterable[int] = ()) -> Assignment:
  """New roles after slices are `lost` and/or `returned`.

  Rules, in order: lost slices leave every role; a trainer that lost slices refills up to `target_trainer`
  by taking surviving sampler slices (lowest index first), then returned ones, then service slices, so the
  trainer stays whole and the sampler fleet shrinks; other returned slices refill the service slices up to
  `target_service`, the rest rejoin as samplers; with no sampler slice left the sampler colocates on the
  trainer's slices, with no service slice the services share the sampler's.
  A run configured as colocated stays colocated, returned slices refilling it up to its size.
  """
  lost, back = set(lost), set(returned)
  if back & lost:
    raise ValueError(f"slices {sorted(back & lost)} are both lost and returned")
  lost_now = (set(assignment.lost) | lost) - back
  lost_t = tuple(sorted(lost_now))
  trainer = [s for s in assignment.trainer if s not in lost_now]
  service = [s for s in assignment.service if s not in lost_now]
  tv = assignment.target_service
  if assignment.want_colocated:
    spare = sorted(back - set(trainer))
    take = max(0, assignment.target_trainer - len(trainer))
    trainer, spare = trainer + spare[:take], spare[take:]
    if not trainer and service:  # the last slices left serve: training goes first
      trainer.append(service.pop(0))
    if not trainer:
      raise NoHealthySlicesError(f"all slices are lost ({sorted(lost_now)}); nothing left to train on")
    t = tuple(sorted(trainer))
    return Assignment(t, t, True, assignment.target_trainer, lost_t, True, _refill(service, spare, tv), tv)
  degraded = assignment.colocated  # sampler was time-sharing the trainer's slices
  sampler = [] if degraded else [s for s in assignment.sampler if s not in lost_now]
  spare = sorted(back - set(trainer))
  if len(trainer) < len(assignment.trainer):  # training goes first
    while len(trainer) < assignment.target_trainer and (sampler or spare or service):
      trainer.append((sampler or spare or service).pop(0))
  service_t = _refill(service, spare, tv)
  sampler = sorted(set(sampler) | (set(spare) - set(service_t)))
  if not trainer:
    raise NoHealthySlicesError(f"all slices are lost ({sorted(lost_now)}); nothing left to train on")
  t = tuple(sorted(trainer))
  if not sampler:
    return Assignment(t, t, True, assignment.target_trainer, lost_t, False, service_t, tv)
  return Assignment(t, tuple(sampler), False, assignment.target_trainer, lost_t, False, service_t, tv)


def _refill(service: list[int], spare: list[int], target: int) -> tuple[int, ...]:
  """The service slices after returned `spare` ones refill them up to `target` (lowest index first)."""
  return tuple(sorted(service + spare[:max(0, target - len(service))]))


def _mesh(devices: Sequence[Any], axes: Mapping[str, int], role: str) -> Mesh:
  bad = set(axes) - set(msharding.MESH_AXES)
  if bad:
    raise ValueError(f"{role} mesh has unknown axes {sorted(bad)}; use {msharding.MESH_AXES}")
  sizes = {"data": 1, "fsdp": 1, "tensor": 1, **dict(axes)}
  try:
    return msharding.make_mesh(devices, **sizes)
  except ValueError as e:
    raise ValueError(f"{role} mesh {sizes} does not fit its {len(devices)} devices: {e}") from None


def abstract_mesh(axes: Mapping[str, int], devices: int, role: str) -> AbstractMesh:
  """The ('data', 'fsdp', 'tensor') mesh `topology.<role>_mesh` gives on `devices` devices (no devices needed)."""
  sizes = {"data": 1, "fsdp": 1, "tensor": 1, **dict(axes)}
  free = [k for k, v in sizes.items() if v == -1]
  known = math.prod(v for v in sizes.values() if v != -1)
  if devices < 1 or len(free) > 1 or devices % known or (not free and known != devices):
    raise ValueError(f"topology.{role}_mesh={dict(axes)} does not fit {devices} {role} device(s)")
  if free:
    sizes[free[0]] = devices // known
  return AbstractMesh(tuple(sizes[a] for a in msharding.MESH_AXES), msharding.MESH_AXES)


def role_meshes(config, trainer_devices: int, sampler_devices: int) -> tuple[AbstractMesh, AbstractMesh]:
  """The trainer's and the sampler's abstract meshes (`abstract_mesh`) of topology config `config`."""
  return (abstract_mesh(config.trainer_mesh, trainer_devices, "trainer"),
          abstract_mesh(config.sampler_mesh, sampler_devices, "sampler"))


@dataclasses.dataclass(frozen=True)
class Topology:
  """Slices, their role assignment and one mesh per role. `service_mesh`: where the run's frozen models with
  placement "own" run: their own slices, else (none configured, or all lost) the sampler's mesh."""
  config: TopologyConfig
  slices: tuple[Slice, ...]
  assignment: Assignment
  trainer_mesh: Mesh
  sampler_mesh: Mesh
  service_mesh: Mesh

  @property
  def colocated(self) -> bool:
    return self.assignment.colocated

  def devices_of(self, slice_indices: Iterable[int]) -> list[Any]:
    by_index = {s.index: s for s in self.slices}
    return [d for i in sorted(slice_indices) for d in by_index[i].devices]


def _build(config: TopologyConfig, slices: tuple[Slice, ...], assignment: Assignment) -> Topology:
  by_index = {s.index: s for s in slices}
  devs = lambda idx: [d for i in idx for d in by_index[i].devices]
  trainer_mesh = _mesh(devs(assignment.trainer), config.trainer_mesh, "trainer")
  sampler_mesh = _mesh(devs(assignment.sampler), config.sampler_mesh, "sampler")
  service_mesh = (_mesh(devs(assignment.service), config.service_mesh, "service") if assignment.service
                  else sampler_mesh)
  return Topology(config, slices, assignment, trainer_mesh, sampler_mesh, service_mesh)


def build_topology(config: TopologyConfig | Mapping[str, Any], devices: Sequence[Any] | None = None) -> Topology:
  """Discover slices on `devices` (default all), assign roles and build the trainer and sampler meshes."""
  if not isinstance(config, TopologyConfig):
    config = TopologyConfig.from_dict(config)
  slices = discover_slices(devices, config.slice_size)
  return _build(config, slices, assign_roles([s.index for s in slices], config))


def reassign(topology: Topology, lost_slices: Iterable[int] = (), returned_slices: Iterable[int] = ()) -> Topology:
  """A new Topology after preemption/return, with meshes rebuilt over the surviving slices."""
  known = {s.index for s in topology.slices}
  unknown = sorted((set(lost_slices) | set(returned_slices)) - known)
  if unknown:
    raise ValueError(f"unknown slice indices {unknown}; this topology has slices {sorted(known)}")
  assignment = reassign_roles(topology.assignment, lost_slices, returned_slices)
  return _build(topology.config, topology.slices, assignment)


class FaultInjector:
  """Registry of slice health: mark simulated slices lost or returned, and guard device access.

  `ensure_alive(x)` accepts a Mesh, a jax.Array, a pytree of arrays or an iterable of devices, and
  raises SliceLostError naming the first lost slice whose devices it touches.
  """

  def __init__(self, slices: Sequence[Slice]):
    self._slice_of = {d.id: s.index for s in slices for d in s.devices}
    self._indices = {s.index for s in slices}
    self._lost: set[int] = set()

  @property
  def lost(self) -> frozenset[int]:
    return frozenset(self._lost)

  def lose(self, slice_index: int) -> None:
    self._check(slice_index)
    self._lost.add(slice_index)

  def restore(self, slice_index: int) -> None:
    self._check(slice_index)
    self._lost.discard(slice_index)

  def is_alive(self, slice_index: int) -> bool:
    self._check(slice_index)
    return slice_index not in self._lost

  def _check(self, slice_index: int) -> None:
    if slice_index not in self._indices:
      raise ValueError(f"unknown slice {slice_index}; known slices {sorted(self._indices)}")

  def ensure_alive(self, x: Any) -> None:
    """Raise SliceLostError if `x` (mesh, array, pytree of arrays, devices) lives on a lost slice."""
    if isinstance(x, Mesh):
      devices, what = list(x.devices.flat), "mesh devices"
    elif isinstance(x, (list, tuple)) and x and all(hasattr(d, "platform") and hasattr(d, "id") for d in x):
      devices, what = list(x), "devices"
    else:
      devices, what = [], "arrays"
      for leaf in jax.tree.leaves(x):
        if isinstance(leaf, jax.Array):
          devices.extend(leaf.sharding.device_set)
    for d in sorted(devices, key=lambda d: d.id):
      s = self._slice_of.get(d.id)
      if s in self._lost:
        raise SliceLostError(s, what)
