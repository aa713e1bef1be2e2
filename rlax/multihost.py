"""Multi-host runs without Pathways: process start-up and the cross-process trainer → sampler weight push.

When every role lives in one process (the single controller), `jax.device_put` moves weights between the
trainer and sampler submeshes. Across processes it cannot: each process only addresses its own devices, so
the push must be a collective program that both sides run. `CrossMeshPush` is that program, in three parts:

  1. trainer mesh (ICI): cast to the sampler dtype and reshard every leaf into a *transport* layout: its
     sampler sharding, split further over the axes that sharding leaves unused (`transport_spec`), on the
     trainer devices arranged in the sampler mesh's shape (each unique byte once);
  2. global mesh ('role', *sampler axes) over trainer + sampler devices: one `ppermute` role 0 → role 1,
     so each byte crosses the slow link (DCN between slices / hosts) exactly once;
  3. sampler mesh (ICI): all-gather over those axes into the sampler's own shardings (the copies of the
     weights across sampler data-parallel replicas).

Each process runs the parts whose devices it owns (part 2 everywhere), so the same code serves one
controller process and N processes started by `launch.multihost`. Needs equal device counts per role.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlax.models.sharding import entry_axes, entry_size


def init_distributed(coordinator_address: str, num_processes: int, process_id: int,
                     cpu_devices: Optional[int] = None) -> None:
  """Joins a multi-process JAX job; call before any other JAX operation.

  On CPU (`cpu_devices` given) each process gets that many fake devices and collectives use gloo, so a
  job of N processes on 127.0.0.1 behaves like N hosts. On TPU/GPU hosts leave `cpu_devices` None.
  """
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} is outside [0, num_processes={num_processes})")
  if cpu_devices is not None:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id)


def barrier(name: str, timeout_s: float = 3600.0) -> None:
  """Waits until every process reaches `name` (the coordination service's barrier; a no-op in one process).

  Gloo gives a new collective 30 s for every peer to arrive; a collective that one role reaches minutes
  after the other (a long SFT, a slow step) fails with "Gloo context initialization failed". A barrier
  first, with a long timeout, lines the processes up. Names must be unique per use.
  """
  if jax.process_count() == 1:
    return
  from jax._src import distributed  # the public API has no non-collective barrier in jax 0.10
  distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


class Channel:
  """Host-side messages between the processes of one job, over the coordination service's key-value store.

  For what is not a device array or is small next to the weights: rollouts (numpy), version numbers, the
  start position, evaluation results. Every key is written once per job attempt (a restarted job gets a
  fresh coordinator, hence a fresh store). Byte values are split into `chunk_bytes` pieces.
  """

  def __init__(self, prefix: str = "rlax", timeout_s: float = 3600.0, chunk_bytes: int = 1 << 20):
    from jax._src import distributed  # the public API exposes no key-value store in jax 0.10
    self.client = distributed.global_state.client
    if self.client is None:
      raise RuntimeError("Channel needs a multi-process job (jax.distributed.initialize)")
    self.prefix, self.timeout_ms, self.chunk = prefix, int(timeout_s * 1000), chunk_bytes

  def set(self, key: str, value: str) -> None:
    self.client.key_value_set(f"{self.prefix}/{key}", value)

  def get(self, key: str) -> str:
    """Blocks until `key` is set."""
    return self.client.blocking_key_value_get(f"{self.prefix}/{key}", self.timeout_ms)

  def set_json(self, key: str, value: Any) -> None:
    self.set(key, json.dumps(value))

  def get_json(self, key: str) -> Any:
    return json.loads(self.get(key))

  def set_bytes(self, key: str, data: bytes) -> None:
    n = max(1, -(-len(data) // self.chunk))
    for i in range(n):
      self.client.key_value_set_bytes(f"{self.prefix}/{key}/{i}", data[i * self.chunk:(i + 1) * self.chunk])
    self.set(f"{key}/n", str(n))  # last: a reader that sees the count finds every piece

  def get_bytes(self, key: str) -> bytes:
    n = int(self.get(f"{key}/n"))
    return b"".join(self.client.blocking_key_value_get_bytes(f"{self.prefix}/{key}/{i}", self.timeout_ms)
                    for i in range(n))


def local_roles(trainer_mesh: Mesh, sampler_mesh: Mesh) -> tuple[bool, bool]:
  """(holds the trainer, holds the sampler) for this process; each role's devices all in one process.

  One process (or Pathways) holds both. A multi-process job without Pathways runs each role in the process
  that owns all of its mesh's devices; a mesh split across processes is an error naming the role.
  """
  me = jax.process_index()
  out = []
  for role, mesh in (("trainer", trainer_mesh), ("sampler", sampler_mesh)):
    owners = {d.process_index for d in mesh.devices.flat}
    if len(owners) > 1:
      raise ValueError(f"the {role} mesh spans processes {sorted(owners)}; without Pathways each role must "
                       "live in one process (set topology.slice_size to the devices per process)")
    out.append(me in owners)
  return out[0], out[1]


def maybe_init_pathways() -> bool:
  """Initializes Pathways when the optional `pathwaysutils` extra is installed; returns whether it did.

  Under Pathways one controller process addresses every slice (the single-controller model rlax is written
  for) and `jax.device_put` between slices works, so `CrossMeshPush` is not needed there. Call it first
  thing in the controller's main. `RLAX_NO_PATHWAYS=1` skips it even when installed.
  """
  if os.environ.get("RLAX_NO_PATHWAYS") == "1":
    return False
  try:
    import pathwaysutils  # pytype: disable=import-error
  except ImportError:
    return False
  pathwaysutils.initialize()
  return True


def transport_spec(shape: tuple[int, ...], mesh_shape: dict[str, int], spec: P = P()) -> P:
  """The layout a push sends a leaf in: `spec` (the leaf's sharding on the sampler mesh) with each mesh axis it
  leaves unused (size > 1, in mesh order) added to the dim it divides with the largest pieces, so every device
  holds a unique piece (an axis that divides no dim stays replicated). The sampler's side is then an
  all-gather over the added axes and the trainer's a reshard between two fully split layouts: XLA moves those
  piece by piece, where moving a split from one dim to another falls back to replicating the whole leaf
  (measured: 6 GiB of temporaries for a 3 GiB expert leaf on 512 v5p chips)."""
  dims = [list(entry_axes(e)) for e in _pad_spec(spec, len(shape))]
  split = lambda i: entry_size(mesh_shape, dims[i])
  used = {a for d in dims for a in d}
  for axis in [a for a in mesh_shape if mesh_shape[a] > 1 and a not in used]:
    fits = [i for i in range(len(shape)) if shape[i] % (split(i) * mesh_shape[axis]) == 0]
    if fits:
      dims[max(fits, key=lambda i: (shape[i] // split(i), -i))].append(axis)
  return P(*[tuple(d) if d else None for d in dims])


def _pad_spec(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


class CrossMeshPush:
  """Moves a pytree of arrays from `src_mesh` to `dst_shardings` (on `dst_mesh`) through collectives.

  Works within one process and across processes (see the module docstring). `dst_shardings`: pytree of
  NamedSharding on `dst_mesh`, with the same structure as the pushed tree; `dtype`: the sampler's dtype
  (cast on the source side, so fewer bytes cross). Both meshes need the same device count. `name`: unique
  per instance and equal across processes (it names the barrier before each push).
  """

  def __init__(self, src_mesh: Mesh, dst_mesh: Mesh, dst_shardings: Any, dtype: Any = None, name: str = "push"):
    if src_mesh.devices.size != dst_mesh.devices.size:
      raise ValueError(f"CrossMeshPush needs equal device counts per role, got trainer {src_mesh.devices.size} "
                       f"and sampler {dst_mesh.devices.size}; use as many sampler slices as trainer slices")
    if set(src_mesh.devices.flat) & set(dst_mesh.devices.flat):
      raise ValueError("CrossMeshPush needs disjoint meshes; colocated roles move weights with jax.device_put")
    self.src_mesh, self.dst_mesh, self.dtype, self.name = src_mesh, dst_mesh, dtype, name
    self.dst_shardings = dst_shardings
    names = dst_mesh.axis_names
    # Trainer devices in the sampler mesh's shape: device (i, j, k) of the mirror sends to (i, j, k) of dst.
    self.mirror = Mesh(np.asarray(list(src_mesh.devices.flat), dtype=object).reshape(dst_mesh.devices.shape),
                       names)
    self.global_mesh = Mesh(np.stack([self.mirror.devices, dst_mesh.devices]), ("role",) + tuple(names))
    self._leaves_sh, self._treedef = jax.tree.flatten(dst_shardings)
    self._local = {d for d in jax.local_devices()}
    self._compiled: dict = {}
    self._calls = 0

  # -- layouts ---------------------------------------------------------------------------------------------
  def _specs(self, shapes):
    mesh_shape = dict(self.dst_mesh.shape)
    return [_pad_spec(transport_spec(tuple(s), mesh_shape, sh.spec), len(s)) for s, sh in zip(shapes, self._leaves_sh)]

  def _src_split(self, shapes, src_sh) -> list:
    """Each leaf's trainer sharding split over the trainer axes it leaves unused (transport_spec on the trainer
    mesh: a local slice), the step before the move to the mirror: between two fully split layouts XLA moves
    pieces (Qwen3-235B's q on 512 v5p chips: 12 MiB of temporaries; straight from the replicated layout:
    11.75 GiB). None for a leaf not on the trainer's devices."""
    devices = set(self.src_mesh.devices.flat)
    on_trainer = lambda sh: (isinstance(sh, NamedSharding) and isinstance(sh.mesh, Mesh)
                             and set(sh.mesh.devices.flat) == devices)
    return [NamedSharding(sh.mesh, transport_spec(tuple(s), dict(sh.mesh.shape), sh.spec)) if on_trainer(sh) else None
            for s, sh in zip(shapes, src_sh)]

  def _fns(self, shapes, dtypes, src_sh=None):
    """The three jitted parts for leaves of `shapes`/`dtypes` on trainer shardings `src_sh` (None where this
    process holds no trainer device: it never runs the first part), cached per signature."""
    split = self._src_split(shapes, src_sh) if src_sh is not None else [None] * len(shapes)
    key = (tuple(map(tuple, shapes)), tuple(map(str, dtypes)), tuple(map(str, split)))
    if key in self._compiled:
      return self._compiled[key]
    specs = self._specs(shapes)
    mirror_sh = [NamedSharding(self.mirror, P(*s)) for s in specs]
    dst_t_sh = [NamedSharding(self.dst_mesh, P(*s)) for s in specs]
    glob_specs = [P("role", *s) for s in specs]
    out_dt = [jnp.dtype(self.dtype) if self.dtype is not None and jnp.issubdtype(d, jnp.floating) else
              jnp.dtype(d) for d in dtypes]

    def to_mirror(xs):
      xs = [x.astype(t) for x, t in zip(xs, out_dt)]
      return [x if sh is None else jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(xs, split)]

    to_transport = jax.jit(to_mirror, out_shardings=mirror_sh)

    def hop(xs):
      return [jax.lax.ppermute(x, "role", [(0, 1)]) for x in xs]
    cross = jax.jit(jax.shard_map(hop, mesh=self.global_mesh, in_specs=(glob_specs,), out_specs=glob_specs,
                                  check_vma=False), donate_argnums=0)
    to_dst = jax.jit(lambda xs: xs, out_shardings=list(self._leaves_sh))
    fns = dict(specs=specs, mirror_sh=mirror_sh, dst_t_sh=dst_t_sh, out_dt=out_dt, to_transport=to_transport,
               cross=cross, to_dst=to_dst,
               glob_sh=[NamedSharding(self.global_mesh, s) for s in glob_specs])
    self._compiled[key] = fns
    return fns

  # -- the push -----------------------------------------------------------------------------------------------
  def __call__(self, tree: Any, shapes: Any = None) -> Optional[Any]:
    """Pushes `tree` (on the trainer mesh; None in processes that own no trainer device).

    Returns the tree on `dst_shardings` in processes that own sampler devices, else None. Processes that
    hold neither role's devices still call it with `shapes` (a tree of ShapeDtypeStruct) so the collective
    runs everywhere; sampler-only processes pass `shapes` too.
    """
    ref = tree if tree is not None else shapes
    if ref is None:
      raise ValueError("CrossMeshPush: give the tree (trainer side) or its `shapes` (other processes)")
    leaves, treedef = jax.tree.flatten(ref)
    if treedef != self._treedef:
      raise ValueError(f"CrossMeshPush: pushed tree {treedef} does not match the sampler shardings' tree")
    shapes_l = [tuple(x.shape) for x in leaves]
    f = self._fns(shapes_l, [x.dtype for x in leaves],
                  None if tree is None else [getattr(x, "sharding", None) for x in leaves])
    src_here = any(d in self._local for d in self.mirror.devices.flat)
    dst_here = any(d in self._local for d in self.dst_mesh.devices.flat)
    if src_here:
      if tree is None:
        raise ValueError("CrossMeshPush: this process owns trainer devices, so it must pass the tree")
      with jax.set_mesh(self.mirror):
        transport = f["to_transport"](leaves)
    globs = []
    for k, shape in enumerate(shapes_l):
      gsh = f["glob_sh"][k]
      bufs = []
      if src_here:
        bufs += [s.data.reshape((1,) + s.data.shape) for s in transport[k].addressable_shards]
      if dst_here:
        shard = f["dst_t_sh"][k].shard_shape(shape)
        bufs += [jax.device_put(np.zeros((1,) + shard, f["out_dt"][k]), d)
                 for d in self.dst_mesh.devices.flat if d in self._local]
      globs.append(jax.make_array_from_single_device_arrays((2,) + shape, gsh, bufs))
    self._calls += 1
    barrier(f"rlax_{self.name}_{self._calls}")
    with jax.set_mesh(self.global_mesh):
      out = f["cross"](globs)
    if not dst_here:
      jax.block_until_ready(out)
      return None
    dst_leaves = []
    dst_ids = {d.id for d in self.dst_mesh.devices.flat}
    for k, shape in enumerate(shapes_l):
      bufs = [s.data.reshape(s.data.shape[1:]) for s in out[k].addressable_shards if s.device.id in dst_ids]
      dst_leaves.append(jax.make_array_from_single_device_arrays(shape, f["dst_t_sh"][k], bufs))
    with jax.set_mesh(self.dst_mesh):
      result = f["to_dst"](dst_leaves)
    return jax.tree.unflatten(self._treedef, result)

  def lowered(self, shapes: Any, compile_mesh=None) -> dict[str, Any]:
    """The three parts lowered for abstract `shapes` (a tree of ShapeDtypeStruct): for AOT planning.

    `compile_mesh(mesh) -> mesh` may move the sampler-only part to an equivalent mesh (same shape and
    specs) that the compiler accepts; see rlax.planning.on_first_slices.
    """
    leaves = jax.tree.leaves(shapes)
    shapes_l = [tuple(x.shape) for x in leaves]
    sds = lambda sh, dts, lead=(): [jax.ShapeDtypeStruct(lead + s, d, sharding=h)
                                    for s, d, h in zip(shapes_l, dts, sh)]
    src_sh = [NamedSharding(self.mirror, P()) for _ in leaves]
    if all(hasattr(x, "sharding") and x.sharding is not None for x in leaves):
      src_sh = [x.sharding for x in leaves]
    f = self._fns(shapes_l, [x.dtype for x in leaves], src_sh)
    with jax.set_mesh(self.mirror):
      a = f["to_transport"].lower(sds(src_sh, [x.dtype for x in leaves]))
    with jax.set_mesh(self.global_mesh):
      b = f["cross"].lower(sds(f["glob_sh"], f["out_dt"], (2,)))
    dst = compile_mesh(self.dst_mesh) if compile_mesh is not None else self.dst_mesh
    move = lambda shs: [NamedSharding(dst, s.spec) for s in shs]
    to_dst = jax.jit(lambda xs: xs, out_shardings=move(self._leaves_sh))
    with jax.set_mesh(dst):
      c = to_dst.lower(sds(move(f["dst_t_sh"]), f["out_dt"]))
    return {"push_to_transport": a, "push_cross": b, "push_to_sampler": c}


ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "RLAX_COORDINATOR", "RLAX_NUM_PROCESSES", "RLAX_PROCESS_ID"


def init_from_env(cpu_devices: Optional[int] = None) -> tuple[int, int]:
  """`init_distributed` from the variables `launch.multihost` sets; returns (process_id, num_processes)."""
  missing = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if k not in os.environ]
  if missing:
    raise ValueError(f"multi-process run without {missing}: start it with `python -m launch.multihost`")
  pid, n = int(os.environ[ENV_PROCESS_ID]), int(os.environ[ENV_NUM_PROCESSES])
  init_distributed(os.environ[ENV_COORDINATOR], n, pid, cpu_devices=cpu_devices)
  return pid, n
