"""Ahead-of-time plan: compile the real trainer, sampler and weight-push programs for a target topology.

    plan = make_plan(config)          # config: configs/paper_qwq32b.py's get_config()
    print(format_table(plan))

The devices come from `jax.experimental.topologies.get_topology_desc(c.plan.topology, "tpu",
num_slices=...)` (needs the `tpu` extra: jax[tpu] / libtpu; no TPU attached), or from the local backend
when `c.plan.topology` is "local" (tests use 8 fake CPU devices). Either way they go through the same
`build_topology` the runtime uses, and the same objects build the programs: `Trainer`'s jitted RL step,
the sampler engine's prefill and decode chunk, and `CrossMeshPush`'s three parts. Each program is lowered
with ShapeDtypeStructs carrying its mesh's shardings and compiled; `memory_analysis()` gives per-chip
bytes and `cost_analysis()` per-chip FLOPs and bytes accessed. Times are a roofline estimate,
max(flops / peak, bytes / HBM bandwidth), i.e. perfect overlap and full MXU use: a lower bound.
The weight push time is a bandwidth model (bytes per chip over ICI/DCN bandwidth), not a measurement.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlax import builders
from rlax import models as M
from rlax.multihost import CrossMeshPush, transport_spec
from rlax.topology import Topology, build_topology
from rlax.trainer import RolloutBatch, Trainer, TrainState

GIB = 2 ** 30
_I32 = jax.ShapeDtypeStruct((), jnp.int32)  # scalar args as abstract values: no eager op on abstract devices


class PlanError(ValueError):
  """A program does not fit the chip: the message is one line naming program, overshoot and knob."""


@dataclasses.dataclass(frozen=True)
class Chip:
  """Per-chip published figures the estimates use (bytes, FLOP/s, bytes/s)."""
  name: str
  hbm_bytes: float
  peak_flops: float
  hbm_bw: float
  ici_bw: float
  dcn_bw: float

  @classmethod
  def from_config(cls, p) -> "Chip":
    return cls(p.chip, p.hbm_gib * GIB, p.peak_tflops * 1e12, p.hbm_tb_s * 1e12, p.ici_gb_s * 1e9,
               p.dcn_gb_s * 1e9)


@dataclasses.dataclass
class Program:
  """One compiled program's per-chip figures."""
  name: str
  mesh: str
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  flops: float
  bytes_accessed: float
  compile_s: float

  @property
  def peak_bytes(self) -> int:
    """Live bytes at the program's peak: inputs + outputs (donated inputs counted once) + scratch."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  # XLA's cost analysis counts a while-loop body once, so scanned layers and micro-batches undercount;
  # the estimate takes the larger of it and an analytic count (set by make_plan).
  est_flops: float = 0.0
  est_bytes: float = 0.0

  def roofline_s(self, chip: Chip) -> float:
    flops, nbytes = max(self.flops, self.est_flops), max(self.bytes_accessed, self.est_bytes)
    return max(flops / chip.peak_flops, nbytes / chip.hbm_bw)

  def analytic_s(self, chip: Chip) -> float:
    """Roofline of the analytic count alone: what the math needs, whatever the compiled code touches."""
    return max(self.est_flops / chip.peak_flops, self.est_bytes / chip.hbm_bw)


def plan_devices(p) -> list:
  """Abstract TPU devices of `p.topology` x `p.num_slices`, or the local backend's for "local"."""
  if p.topology == "local":
    return list(jax.devices())
  import os
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # compile-only libtpu: no workers to find
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other JAX processes may hold libtpu's lock
  from jax.experimental import topologies
  try:
    desc = topologies.get_topology_desc(p.topology, platform="tpu", num_slices=p.num_slices)
  except Exception as e:  # libtpu missing or an unknown topology string
    raise ValueError(f"plan.topology={p.topology!r} x {p.num_slices} slices: cannot build TPU topology "
                     f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); install the `tpu` "
                     "extra (pip install 'jax[tpu]') or use plan.topology='local'") from None
  return list(desc.devices)


def on_first_slices(mesh: Mesh, devices) -> Mesh:
  """The same mesh moved onto the lowest-numbered slices, device for device (same position in its slice).

  libtpu's compile-only client rejects a program whose devices all sit on slices other than slice 0
  ("Slice is empty"); slices are identical, so the moved program has the same per-chip figures.
  """
  slice_of = lambda d: getattr(d, "slice_index", None)
  if any(slice_of(d) is None for d in mesh.devices.flat):
    return mesh
  lo = min(slice_of(d) for d in mesh.devices.flat)
  if lo == 0:
    return mesh
  by_slice: dict = {}
  for d in sorted(devices, key=lambda d: d.id):
    by_slice.setdefault(slice_of(d), []).append(d)
  pos = {d.id: (slice_of(d), i) for k, ds in by_slice.items() for i, d in enumerate(ds)}
  move = lambda d: by_slice[pos[d.id][0] - lo][pos[d.id][1]]
  return Mesh(np.vectorize(move, otypes=[object])(mesh.devices), mesh.axis_names)


def _shard_bytes(x: jax.ShapeDtypeStruct) -> int:
  return int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize


def _no_fit(name: str, need: float, chip: Chip, what: str, knob: str) -> str:
  return (f"{name} does not fit: needs {need / GIB:.3g} GiB per chip of {chip.hbm_bytes / GIB:.3g} GiB HBM "
          f"(over by {(need - chip.hbm_bytes) / GIB:.3g} GiB; {what}); try {knob}")


def _sds(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _rows(mesh, shape, dtype):
  n = mesh.shape["data"] * mesh.shape["fsdp"]
  axes = ("data", "fsdp") if shape[0] % n == 0 else None
  return _sds(shape, dtype, NamedSharding(mesh, P(axes, *([None] * (len(shape) - 1)))))


def abstract_params(cfg: M.ModelConfig, mesh) -> Any:
  """Parameter tree of ShapeDtypeStructs on `mesh`'s parameter shardings (nothing allocated)."""
  shapes = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
  return jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, M.param_shardings(cfg, mesh))


def abstract_train_state(trainer: Trainer) -> TrainState:
  """TrainState of ShapeDtypeStructs laid out as `Trainer.init_state` lays them out."""
  mesh, cfg = trainer.mesh, trainer.model_cfg
  params = abstract_params(cfg, mesh)
  shard = M.param_shardings(cfg, mesh)
  rep = NamedSharding(mesh, P())
  opt = jax.eval_shape(trainer.tx.init, params)
  opt_sh = optax.tree_map_params(trainer.tx, lambda _, s: s, opt, shard, transform_non_params=lambda _: rep)
  opt = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), opt, opt_sh)
  return TrainState(step=_sds((), jnp.int32, rep), params=params, opt_state=opt)


def abstract_rollout_batch(mesh, rows: int, seq: int, with_ref: bool) -> RolloutBatch:
  """RolloutBatch of ShapeDtypeStructs, rows sharded over ('data', 'fsdp') as `Trainer.step` puts them."""
  f = lambda shape, dt: _rows(mesh, shape, dt)
  return RolloutBatch(tokens=f((rows, seq), jnp.int32), input_mask=f((rows, seq), jnp.bool_),
                      loss_mask=f((rows, seq - 1), jnp.float32),
                      behaviour_logprobs=f((rows, seq - 1), jnp.float32), rewards=f((rows,), jnp.float32),
                      versions=f((rows,), jnp.int32), group_ids=f((rows,), jnp.int32),
                      ref_logprobs=f((rows, seq - 1), jnp.float32) if with_ref else None)


def trainer_program(c, topo: Topology, cfg: M.ModelConfig, chip: Chip):
  """The runtime's `Trainer` RL step lowered for one global batch on the trainer mesh.

  Fails fast (before a compile that takes minutes at 32B) when the train state alone exceeds HBM.
  """
  r = c.rollout
  trainer = Trainer(cfg, builders.algorithm(c), builders.optimizer(c, c.controller.steps), topo.trainer_mesh,
                    group_size=r.samples_per_prompt, micro_batches=c.optimizer.micro_batches,
                    micro_batch_tokens=c.optimizer.micro_batch_tokens, temperature=r.temperature)
  rows = r.prompts_per_step * r.samples_per_prompt
  if rows % c.optimizer.micro_batches:
    raise ValueError(f"{rows} rollout rows do not split into optimizer.micro_batches={c.optimizer.micro_batches}")
  batch = abstract_rollout_batch(topo.trainer_mesh, rows, r.max_prompt_len + r.max_new_tokens,
                                 c.algorithm.kl_coef > 0)
  state = abstract_train_state(trainer)  # outside the mesh context: it runs eager optax init code
  resident = sum(_shard_bytes(x) for x in jax.tree.leaves(state))
  if resident > chip.hbm_bytes:
    raise PlanError(_no_fit("trainer_step", resident, chip, "params + optimizer state alone",
                            "more FSDP (topology.trainer_mesh.fsdp) or more trainer slices"))
  with jax.set_mesh(topo.trainer_mesh):
    return trainer._rl.lower(state, batch)  # the exact jit the runtime calls


def sampler_programs(c, topo: Topology, cfg: M.ModelConfig, chip: Chip) -> dict[str, Any]:
  """Thunks lowering the sampler engine's prefill and decode chunk for `c.plan.sampler_batch` rows.

  The adapter between the plan and `rlax.sampler.Sampler`: it builds the engine with one prompt bucket
  (max_prompt_len) and one batch bucket, and lowers the engine's own jitted prefill and decode chunk.
  """
  from rlax.sampler import Sampler, Temperature
  r, mesh = c.rollout, topo.sampler_mesh
  B, G, Pl, N = c.plan.sampler_batch, r.samples_per_prompt, r.max_prompt_len, r.max_new_tokens
  if B % G:
    raise ValueError(f"plan.sampler_batch={B} is not a multiple of rollout.samples_per_prompt={G}")
  eng = Sampler(cfg, mesh, max_prompt_len=Pl, max_new_tokens=N, batch_buckets=(B,), prompt_buckets=(Pl,),
                eos_id=0, decode_chunk=r.decode_chunk or None, memory_budget_bytes=1 << 62)
  resident = eng.memory["params"] + eng.memory["cache"]  # the engine's own accounting
  if resident > chip.hbm_bytes:
    raise PlanError(_no_fit("sampler_decode", resident, chip, "params + KV cache alone",
                            f"{_KNOBS['sampler_decode'][0]} or {_KNOBS['sampler_decode'][1]}"))
  strategy = Temperature(r.temperature)
  params = abstract_params(cfg, mesh)
  spec = lambda shape, dt: _sds(shape, dt, eng._batch_spec(len(shape)))
  key_dt = jax.eval_shape(lambda: jax.random.key(0)).dtype

  def prefill():
    with jax.set_mesh(mesh):
      return eng._prefill.lower(params, spec((B // G, Pl), jnp.int32), spec((B // G, Pl), jnp.bool_),
                                spec((B,), key_dt), _I32, spec((B,), jnp.bool_), samples=G, strategy=strategy)

  def decode(compiled_prefill):
    """Decode chunk lowered on the state the compiled prefill outputs (its shapes and shardings)."""
    state = jax.tree.map(lambda o, sh: _sds(o.shape, o.dtype, sh), compiled_prefill.out_info,
                         compiled_prefill.output_shardings)
    with jax.set_mesh(mesh):
      return eng._chunk.lower(params, state, _I32, _I32, strategy=strategy)
  return {"sampler_prefill": prefill, "sampler_decode": decode}


def _analyze(name: str, mesh_desc: str, lower, chip: Chip, extra_s: float = 0.0) -> tuple[Program, Any]:
  """Lowers (`lower()`) and compiles one program, reads its per-chip figures; PlanError when it does not fit."""
  t0 = time.perf_counter()
  compiled = lower().compile()
  dt = time.perf_counter() - t0 + extra_s
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  prog = Program(name, mesh_desc, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                 int(m.alias_size_in_bytes), int(m.temp_size_in_bytes), float(cost.get("flops", 0.0)),
                 float(cost.get("bytes accessed", 0.0)), dt)
  logging.info("plan: compiled %s in %.1f s: peak %.2f GiB per chip", name, dt, prog.peak_bytes / GIB)
  check_fit([prog], chip)
  return prog, compiled


def _mesh_desc(mesh) -> str:
  return "x".join(f"{k}{v}" for k, v in mesh.shape.items() if v > 1) or "1"


def _per_chip_bytes(shapes, shardings) -> int:
  return sum(int(np.prod(sh.shard_shape(s.shape))) * jnp.dtype(s.dtype).itemsize
             for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))


def push_estimate(cfg: M.ModelConfig, topo: Topology, chip: Chip, cross_dcn: bool) -> dict[str, float]:
  """Bandwidth model of one trainer → sampler push (CrossMeshPush's three phases, no overlap).

  transport: trainer chips reshard to unique 1/n pieces over ICI; cross: each piece crosses once, over DCN
  when the roles sit on different slices (else ICI); gather: sampler chips all-gather their own shards
  over ICI. Bytes are in the sampler dtype.
  """
  shapes = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, cfg.jnp_dtype), shapes)
  mesh = topo.sampler_mesh
  total = sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
  tr = [NamedSharding(mesh, transport_spec(s.shape, dict(mesh.shape))) for s in jax.tree.leaves(shapes)]
  piece = _per_chip_bytes(jax.tree.leaves(shapes), tr)
  shard = _per_chip_bytes(shapes, M.param_shardings(cfg, mesh))
  link = chip.dcn_bw if cross_dcn else chip.ici_bw
  t = dict(transport_s=piece / chip.ici_bw, cross_s=piece / link, gather_s=max(shard - piece, 0) / chip.ici_bw)
  return dict(total_bytes=total, per_chip_transport_bytes=piece, per_chip_sampler_bytes=shard,
              link="dcn" if cross_dcn else "ici", seconds=sum(t.values()), **t)


def model_flops(cfg: M.ModelConfig, tokens: int, context: int) -> float:
  """Forward FLOPs: 2 x matmul params per token + attention (2 x 2 x layers x heads x head_dim x context)."""
  D, L, H, K, Dh, F, V = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim,
                          cfg.vocab_size)
  matmul = L * (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F) + D * V
  return tokens * (2 * matmul + 4 * L * H * Dh * context)


def make_plan(c) -> dict[str, Any]:
  """Builds, compiles and measures every program of config `c` on its plan topology; returns the table.

  Raises PlanError (one line) as soon as a program's per-chip peak exceeds the chip's HBM.
  """
  chip = Chip.from_config(c.plan)
  cfg = builders.model_config(c)
  devices = plan_devices(c.plan)
  topo = build_topology(c.topology, devices=devices)
  desc_t, desc_s = _mesh_desc(topo.trainer_mesh), _mesh_desc(topo.sampler_mesh)
  progs = [_analyze("trainer_step", desc_t, lambda: trainer_program(c, topo, cfg, chip), chip)[0]]
  sampler_topo = dataclasses.replace(topo, sampler_mesh=on_first_slices(topo.sampler_mesh, devices))
  sp = sampler_programs(c, sampler_topo, cfg, chip)
  prog, compiled_prefill = _analyze("sampler_prefill", desc_s, sp["sampler_prefill"], chip)
  progs.append(prog)
  progs.append(_analyze("sampler_decode", desc_s, lambda: sp["sampler_decode"](compiled_prefill), chip)[0])
  if not topo.colocated:
    push = CrossMeshPush(topo.trainer_mesh, topo.sampler_mesh, M.param_shardings(cfg, topo.sampler_mesh),
                         dtype=cfg.jnp_dtype)
    t0 = time.perf_counter()
    parts = push.lowered(abstract_params(cfg, topo.trainer_mesh), compile_mesh=lambda m: on_first_slices(m, devices))
    lower_s = (time.perf_counter() - t0) / len(parts)  # lowering is shared; split it evenly
    meshes = {"push_to_transport": push.mirror, "push_cross": push.global_mesh, "push_to_sampler": topo.sampler_mesh}
    for name, lowered in parts.items():
      progs.append(_analyze(name, _mesh_desc(meshes[name]), lambda: lowered, chip, extra_s=lower_s)[0])
  return _table(c, chip, cfg, topo, progs, devices)


def _table(c, chip: Chip, cfg: M.ModelConfig, topo: Topology, progs: list[Program], devices) -> dict[str, Any]:
  r = c.rollout
  rows = r.prompts_per_step * r.samples_per_prompt
  seq = r.max_prompt_len + r.max_new_tokens
  by = {q.name: q for q in progs}
  n_tr, n_sa = topo.trainer_mesh.devices.size, topo.sampler_mesh.devices.size
  B, G = c.plan.sampler_batch, r.samples_per_prompt
  passes = 4 if cfg.remat else 3  # forward + backward (2x) + the remat forward
  by["trainer_step"].est_flops = passes * model_flops(cfg, rows * seq, seq // 2) / n_tr
  by["trainer_step"].est_bytes = by["trainer_step"].argument_bytes + by["trainer_step"].output_bytes
  by["sampler_prefill"].est_flops = model_flops(cfg, B // G * r.max_prompt_len, r.max_prompt_len // 2) / n_sa
  by["sampler_prefill"].est_bytes = by["sampler_prefill"].argument_bytes + by["sampler_prefill"].output_bytes
  # One decode step reads every weight and the whole cache (the engine attends over all slots).
  by["sampler_decode"].est_flops = model_flops(cfg, B, seq) / n_sa
  by["sampler_decode"].est_bytes = by["sampler_decode"].argument_bytes
  slices = {getattr(d, "slice_index", 0) for d in topo.devices_of(topo.assignment.trainer)}
  cross_dcn = not slices & {getattr(d, "slice_index", 0) for d in topo.devices_of(topo.assignment.sampler)}
  step_s = by["trainer_step"].roofline_s(chip)
  decode_s = by["sampler_decode"].roofline_s(chip)
  prefill_s = by["sampler_prefill"].roofline_s(chip)
  push = push_estimate(cfg, topo, chip, cross_dcn and not topo.colocated)
  table = dict(
      config=dict(model=c.model.preset, params=cfg.num_params(), devices=len(devices),
                  topology=f"{c.plan.topology} x {c.plan.num_slices}", chip=chip.name,
                  trainer_mesh=dict(topo.trainer_mesh.shape), sampler_mesh=dict(topo.sampler_mesh.shape),
                  batch_rows=rows, seq_len=seq, micro_batches=c.optimizer.micro_batches,
                  sampler_batch=c.plan.sampler_batch),
      assumptions=dict(hbm_gib=chip.hbm_bytes / GIB, peak_tflops=chip.peak_flops / 1e12,
                       hbm_tb_s=chip.hbm_bw / 1e12, ici_gb_s=chip.ici_bw / 1e9, dcn_gb_s=chip.dcn_bw / 1e9,
                       time=("roofline max(flops/peak, bytes/hbm_bw) per chip; flops/bytes = max(cost_analysis, "
                             "analytic count: 2 x matmul params x tokens + attention, x4 with remat for training; "
                             "decode reads all weights + cache per token); a lower bound"),
                       push="bandwidth model: transport (ICI) + cross (DCN across slices) + gather (ICI)"),
      programs=[dict(dataclasses.asdict(q), peak_bytes=q.peak_bytes, peak_gib=round(q.peak_bytes / GIB, 3),
                     hbm_frac=round(q.peak_bytes / chip.hbm_bytes, 4), roofline_s=q.roofline_s(chip),
                     analytic_s=q.analytic_s(chip))
                for q in progs],
      estimates=dict(train_step_s=step_s, train_tokens_per_s=rows * seq / max(step_s, 1e-12),
                     train_mfu_flops_per_chip=by["trainer_step"].est_flops,
                     prefill_s=prefill_s, decode_token_step_s=decode_s,
                     sampler_tokens_per_s=c.plan.sampler_batch / max(decode_s, 1e-12),
                     analytic_decode_token_step_s=by["sampler_decode"].analytic_s(chip),
                     analytic_sampler_tokens_per_s=c.plan.sampler_batch / max(by["sampler_decode"].analytic_s(chip),
                                                                               1e-12),
                     push=push),
      compile_s={q.name: round(q.compile_s, 2) for q in progs},
  )
  return table


_KNOBS = {
    "trainer_step": ("more micro-batches (optimizer.micro_batches)", "more FSDP (topology.trainer_mesh.fsdp) or "
                     "bf16 params (model.overrides.param_dtype)"),
    "sampler_prefill": ("fewer rows per call (plan.sampler_batch) or shorter rollout.max_prompt_len",
                        "more tensor parallelism (topology.sampler_mesh.tensor)"),
    "sampler_decode": ("fewer rows per call (plan.sampler_batch) or shorter rollout.max_new_tokens",
                       "more tensor parallelism (topology.sampler_mesh.tensor)"),
}


def check_fit(progs: list[Program], chip: Chip) -> None:
  for q in progs:
    if q.peak_bytes > chip.hbm_bytes:
      act, weights = _KNOBS.get(q.name, ("smaller buckets", "more devices per role"))
      knob = act if q.temp_bytes >= q.argument_bytes else weights
      if q.name == "trainer_step" and q.temp_bytes >= q.argument_bytes:
        knob += " or remat (model.overrides.remat=True)"
      raise PlanError(_no_fit(q.name, q.peak_bytes, chip, f"args {q.argument_bytes / GIB:.3g}, temp "
                              f"{q.temp_bytes / GIB:.3g} GiB", knob))
