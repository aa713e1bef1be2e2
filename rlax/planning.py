"""Ahead-of-time plan: compile the run's trainer, sampler and weight-push programs, at the run's sizes, for a
target topology.

    plan = make_plan(config)          # config: configs/paper_qwq32b.py's get_config()
    print(format_table(plan))

Devices: `jax.experimental.topologies.get_topology_desc(c.plan.topology, "tpu", num_slices=...)` (the `tpu`
extra; no TPU attached), or the local backend's for "local" (tests: 8 fake CPU devices), through the runtime's
own `build_topology`. Programs are built through public lowerings only (`Trainer.abstract_state` /
`lower_step`, `Sampler.abstract_state` / `lower_admit` / `lower_decode` / `lower_recompute`,
`CrossMeshPush.lowered`), so the plan cannot drift from what runs (on TPU the decode chunk is the paged
layout's, with jax's Pallas kernel). Each is compiled; `memory_analysis()` gives per-chip bytes and
`cost_analysis()` FLOPs and bytes accessed, each checked against the chip's HBM. Times are a roofline,
max(flops / peak, bytes / HBM bandwidth): a lower bound. The weight push time is a bandwidth model.

What it lowers (rlax.planning_programs), against what the run compiles:
  trainer: every RL step the run compiles ahead (`rlax.run.train_plan`): `trainer_step` is the one with the
    largest micro-batch, `trainer_step[<rows>x<length>]` the others. Not lowered: with algorithm.kl_coef > 0
    the reference log-prob programs (the trainer has no public lowering of them).
  sampler, with the run's slots (`rlax.builders.slots`, budget: the chip's HBM): the decode chunk over all
    slots with the rollout's sampling method; the prefill and admission of a full admission
    (`Sampler.group_buckets(G)[-1]` prompts) of the rollout's groups, and of any other group size the run
    samples with (evaluation, greedy) that admits more prompts at once (`sampler_prefill[<groups>x<samples>]`);
    the recompute after a weight swap (rollout.on_swap="recompute"). Not lowered: the decode, recompute and
    cancel at the smaller `Sampler.slot_buckets` and with the other sampling methods, the smaller admission
    buckets (all smaller than those lowered), gather / grow between buckets (copies of the slot state, no
    weights) and multi-turn extensions (compiled lazily).
  weights: the push's three parts (not colocated) and with LoRA the sampler's merge.
  teacher (a distilling run): `teacher_score`, its log-probs of one step's padded rows (in
    teacher.rows_per_pass passes; with routed teachers, `teacher_score[<name>]` too, each at the rows of one
    call), on its mesh (rlax.services: its own slices or the sampler's). Not lowered: the packed rows of a
    batch whose episodes were split into rows (forks).
  judge (reward.name="judge"): `judge_prefill`, `judge_admit` (a full admission of replies) and `judge_decode`
    (greedy, every slot: rlax.builders.judge_slots), on its mesh. Not lowered: its smaller admission buckets.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from absl import logging
import jax
import numpy as np
from jax.sharding import Mesh

from rlax import builders
from rlax import config as config_lib
from rlax import models
from rlax import planning_programs as lowerings
from rlax import planning_sync
from rlax import services
from rlax import teachers
from rlax.models import expert_parallel, variation
from rlax.models import sharding as shd
from rlax.multihost import CrossMeshPush
from rlax.sampler import Sampler, sizing
from rlax.topology import Topology, build_topology

GIB = 2 ** 30
PROGRAMS = ("trainer_step", "sampler_prefill", "sampler_admit", "sampler_decode", "sampler_recompute",
            "push_to_transport", "push_cross", "push_to_sampler")
LORA_PROGRAMS = ("sampler_merge",)  # with model.lora: the adapters merged into the sampler's pristine base
SERVICE_PROGRAMS = ("teacher_score", "judge_prefill", "judge_admit", "judge_decode")  # a teacher, a judge


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


def _no_fit(name: str, need: float, chip: Chip, what: str, knob: str) -> str:
  return (f"{name} does not fit: needs {need / GIB:.3g} GiB per chip of {chip.hbm_bytes / GIB:.3g} GiB HBM "
          f"(over by {(need - chip.hbm_bytes) / GIB:.3g} GiB; {what}); try {knob}")


def _analyze(low: lowerings.Lowering, mesh_desc: str, chip: Chip, extra_s: float = 0.0) -> tuple[Program, Any]:
  """Lowers and compiles one program, reads its per-chip figures; PlanError when it does not fit."""
  t0 = time.perf_counter()
  try:
    compiled = low.lower().compile()
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses temporaries beyond HBM itself
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    act, weights = _KNOBS.get(low.base, ("smaller buckets", "more devices per role"))
    raise PlanError(f"{low.name} does not fit: {str(e).splitlines()[0].split(': ', 1)[-1]}; try {act} or "
                    f"{weights}") from None
  dt = time.perf_counter() - t0 + extra_s
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  prog = Program(low.name, mesh_desc, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                 int(m.alias_size_in_bytes), int(m.temp_size_in_bytes), float(cost.get("flops", 0.0)),
                 float(cost.get("bytes accessed", 0.0)), dt)
  if low.est_flops:  # with an analytic count, the bytes it must touch: its inputs and outputs
    prog.est_flops, prog.est_bytes = low.est_flops, prog.argument_bytes + prog.output_bytes
  logging.info("plan: compiled %s in %.1f s: peak %.2f GiB per chip", low.name, dt, prog.peak_bytes / GIB)
  check_fit([prog], chip)
  return prog, compiled


def _check_resident(name: str, resident: float, chip: Chip, what: str, knob: str) -> None:
  """Fails fast, before a compile that takes minutes at 32B, when the resident state alone exceeds HBM."""
  if resident > chip.hbm_bytes:
    raise PlanError(_no_fit(name, resident, chip, what, knob))


def _mesh_desc(mesh) -> str:
  return "x".join(f"{k}{v}" for k, v in mesh.shape.items() if v > 1) or "1"


def selected_programs(p) -> tuple[str, ...]:
  """The programs `p.programs` names (comma-separated; "" = all), in PROGRAMS order; ValueError on unknown names."""
  names = [n.strip() for n in (p.programs or "").split(",") if n.strip()]
  known = PROGRAMS + LORA_PROGRAMS + SERVICE_PROGRAMS
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise ValueError(f"plan.programs: unknown program(s) {', '.join(unknown)}; known: {', '.join(known)}")
  return tuple(n for n in known if not names or n in names)


def make_plan(c) -> dict[str, Any]:
  """Builds, compiles and measures the programs of config `c` (a RunConfig or the user's ConfigDict) on its
  plan topology: all of them, or those `c.plan.programs` names; returns the table.

  Raises PlanError (one line) as soon as a program's per-chip peak exceeds the chip's HBM.
  """
  c = c if isinstance(c, config_lib.RunConfig) else config_lib.load(c)
  if c.plan is None:
    raise ValueError("the config has no `plan` section (see configs/paper_qwq32b.py)")
  want = selected_programs(c.plan)
  chip = Chip.from_config(c.plan)
  cfg = c.model
  devices = plan_devices(c.plan)
  topo = build_topology(c.topology, devices=devices)
  desc_t, desc_s = _mesh_desc(topo.trainer_mesh), _mesh_desc(topo.sampler_mesh)
  trainer = builders.trainer(c, topo.trainer_mesh)  # the runtime's own builder
  progs, train = [], lowerings.train_lowerings(c, trainer)
  if "trainer_step" in want:
    state = sizing.tree_bytes(trainer.abstract_state())
    _check_resident("trainer_step", state, chip, "params + optimizer state alone",
                    "more FSDP (topology.trainer_mesh.fsdp) or more trainer slices")
    progs += [_analyze(low, desc_t, chip)[0] for low in train]
  slots = lowerings.sampler_slots(c, topo.sampler_mesh, chip.hbm_bytes)
  kind = variation.of(cfg, c.lora)  # what trains and what a push carries
  sampler = lowerings.build_sampler(c, topo.sampler_mesh, slots)
  first = lowerings.build_sampler(c, on_first_slices(topo.sampler_mesh, devices), slots)
  decode = None
  sampler_all = lowerings.sampler_lowerings(c, first)
  sampler_lows = [low for low in sampler_all if low.base in want]
  if sampler_lows:
    resident = first.memory["params"] + first.memory["cache"]  # the engine's own accounting
    if kind.frozen_base:  # + the pristine base the adapters merge into
      resident += planning_sync.pristine_bytes(c, first.mesh)
    _check_resident("sampler_decode", resident, chip, "params + KV cache alone",
                    " or ".join(_KNOBS["sampler_decode"]))
  for low in sampler_lows:
    prog, compiled = _analyze(low, desc_s, chip)
    progs.append(prog)
    if low.name != "sampler_decode":
      continue
    t0, counted_s = time.perf_counter(), prog.compile_s
    if first.layout.scans and cfg.scan_layers:  # XLA counts a scanned layer once: count the unrolled chunk
      unrolled = lowerings.build_sampler(c, first.mesh, slots, scan=False)
      compiled = unrolled.lower_decode(builders.sampling_method(c)).compile()
      counted_s = time.perf_counter() - t0
    decode = dict(lowerings.decode_counts(c, first, compiled), unrolled_compile_s=counted_s)
  if kind.frozen_base and "sampler_merge" in want:
    merge = lowerings.Lowering("sampler_merge", lambda: planning_sync.lower_merge(c, first))
    progs.append(_analyze(merge, desc_s, chip)[0])
  if not topo.colocated and {"push_to_transport", "push_cross", "push_to_sampler"} & set(want):
    target = planning_sync.push_target(c, sampler)  # what the sampler receives: weights, or LoRA's adapters
    push = CrossMeshPush(topo.trainer_mesh, topo.sampler_mesh, jax.tree.map(lambda x: x.sharding, target),
                         dtype=kind.push_dtype(cfg.jnp_dtype))
    t0 = time.perf_counter()
    parts = push.lowered(trainer.abstract_state().params, compile_mesh=lambda m: on_first_slices(m, devices))
    lower_s = (time.perf_counter() - t0) / len(parts)  # lowering is shared; split it evenly
    meshes = {"push_to_transport": push.mirror, "push_cross": push.global_mesh, "push_to_sampler": topo.sampler_mesh}
    for name, lowered in parts.items():
      if name in want:
        low = lowerings.Lowering(name, lambda lowered=lowered: lowered)
        progs.append(_analyze(low, _mesh_desc(meshes[name]), chip, extra_s=lower_s)[0])
  scoring = _teacher_lowerings(c, topo, devices) if c.algorithm.distills and "teacher_score" in want else []
  if c.reward.name == "judge":
    jmesh = services.mesh(topo, c.judge.placement)
    scoring += [(low, _mesh_desc(jmesh)) for low in lowerings.judge_lowerings(c, on_first_slices(jmesh, devices))
                if low.name in want]
  progs += [_analyze(low, desc, chip)[0] for low, desc in scoring]
  shapes = {low.name: low.shape for low in [*train, *sampler_all, *(low for low, _ in scoring)]}
  return _table(c, chip, cfg, topo, progs, devices, sampler, decode, shapes)


def _teacher_lowerings(c, topo: Topology, devices) -> list[tuple[lowerings.Lowering, str]]:
  """Each teacher's scoring program (rlax.teachers.Teacher.lower) from its config.json, at the rows of one call
  (rlax.teachers.routing.call_rows), and its mesh: `teacher_score` the default one, `teacher_score[<name>]` a
  routed one."""
  mesh, r, dirs = services.mesh(topo, c.teacher.placement), c.rollout, c.teacher.dirs()
  rows, length = teachers.call_rows(r.rows, len(dirs), c.teacher.rows_per_pass), r.max_prompt_len + r.max_new_tokens
  out = []
  for name, path in dirs.items():
    teacher = teachers.Teacher.abstract(dataclasses.replace(c.teacher, hf_checkpoint=path),
                                        on_first_slices(mesh, devices), dtype=c.model.dtype,
                                        top_k=c.algorithm.teacher_top_k, student_vocab=c.model.vocab_size)
    low = lowerings.Lowering("teacher_score" + ("" if name == teachers.DEFAULT else f"[{name}]"),
                             lambda t=teacher: t.lower(rows, r.max_prompt_len, length),
                             est_flops=lowerings.model_flops(teacher.cfg, rows * length, length // 2) / mesh.size,
                             shape=dict(rows=rows, length=length, params=teacher.cfg.num_params()))
    out.append((low, _mesh_desc(mesh)))
  return out


def _table(c, chip: Chip, cfg: models.ModelConfig, topo: Topology, progs: list[Program], devices, sampler: Sampler,
           decode: dict[str, Any] | None, shapes: dict[str, dict]) -> dict[str, Any]:
  r = c.rollout
  rows, seq = r.rows, r.max_prompt_len + r.max_new_tokens
  by = {q.name: q for q in progs}
  estimates = {}
  if "trainer_step" in by:
    step_s = by["trainer_step"].roofline_s(chip)
    estimates.update(train_step_s=step_s, train_tokens_per_s=rows * seq / max(step_s, 1e-12),
                     train_mfu_flops_per_chip=by["trainer_step"].est_flops)
  if "sampler_prefill" in by:
    estimates.update(prefill_s=by["sampler_prefill"].roofline_s(chip))
  if "teacher_score" in by:
    estimates.update(teacher_score_s=by["teacher_score"].roofline_s(chip))
  if "sampler_decode" in by:
    # Its bytes are counted, not assumed: XLA over the unrolled layers (+ the kernel's page reads).
    by["sampler_decode"].est_bytes = decode["step_bytes"]
    decode_s = by["sampler_decode"].roofline_s(chip)
    estimates.update(decode_token_step_s=decode_s, sampler_tokens_per_s=sampler.slots / max(decode_s, 1e-12),
                     decode=decode)
  slices = {getattr(d, "slice_index", 0) for d in topo.devices_of(topo.assignment.trainer)}
  cross_dcn = not slices & {getattr(d, "slice_index", 0) for d in topo.devices_of(topo.assignment.sampler)}
  estimates.update(planning_sync.estimates(c, sampler, chip, cross_dcn and not topo.colocated))
  if cfg.moe is not None:
    estimates.update(experts=_expert_exchange(c, cfg, topo, sampler, chip))
  table = dict(
      config=dict(model=c.model_preset, params=cfg.num_params(), devices=len(devices),
                  topology=f"{c.plan.topology} x {c.plan.num_slices}", chip=chip.name,
                  trainer_mesh=dict(topo.trainer_mesh.shape), sampler_mesh=dict(topo.sampler_mesh.shape),
                  service_mesh=dict(topo.service_mesh.shape) if topo.assignment.service else None,
                  batch_rows=rows, seq_len=seq, micro_batches=c.optimizer.micro_batches,
                  sampler_slots=sampler.slots, slot_buckets=list(sampler.slot_buckets), lora_rank=c.lora.rank,
                  train_programs=[dict(name=n, **s) for n, s in shapes.items() if n.startswith("trainer_step")]),
      assumptions=dict(hbm_gib=chip.hbm_bytes / GIB, peak_tflops=chip.peak_flops / 1e12,
                       hbm_tb_s=chip.hbm_bw / 1e12, ici_gb_s=chip.ici_bw / 1e9, dcn_gb_s=chip.dcn_bw / 1e9,
                       time=("roofline max(flops/peak, bytes/hbm_bw) per chip; flops/bytes = max(cost_analysis, "
                             "analytic count: 2 x matmul params x tokens + attention, x4 with remat for training; "
                             "decode reads all weights + cache per token); a lower bound"),
                       decode=("sampler_decode bytes per token step = XLA's count of the chunk's loop body with "
                               "its layers unrolled + on the paged layout the kernel's page reads (jax's kernel "
                               "ships no cost estimate)"),
                       push="bandwidth model: transport (ICI) + cross (DCN across slices) + gather (ICI)"),
      programs=[dict(dataclasses.asdict(q), shape=shapes.get(q.name, {}), peak_bytes=q.peak_bytes,
                     peak_gib=round(q.peak_bytes / GIB, 3), hbm_frac=round(q.peak_bytes / chip.hbm_bytes, 4), roofline_s=q.roofline_s(chip),
                     analytic_s=q.analytic_s(chip))
                for q in progs],
      estimates=estimates,
      compile_s={q.name: round(q.compile_s, 2) for q in progs},
  )
  return table


def _expert_exchange(c, cfg: models.ModelConfig, topo: Topology, sampler: Sampler, chip: Chip) -> dict[str, Any]:
  """Where the experts split on each mesh and the tokens they exchange per chip (rlax.models.expert_parallel):
  a train step (every token of the batch, forward + backward, + the remat forward) and a decode step."""
  r = c.rollout
  tm, sm = dict(topo.trainer_mesh.shape), dict(topo.sampler_mesh.shape)
  train_tokens = r.rows * (r.max_prompt_len + r.max_new_tokens) // shd.row_shards(topo.trainer_mesh, r.rows)
  train = expert_parallel.exchange_bytes(cfg, tm, train_tokens, 3 if cfg.remat else 2)
  decode = expert_parallel.exchange_bytes(cfg, sm, sampler.slots // shd.row_shards(topo.sampler_mesh,
                                                                                          sampler.slots), 1)
  return dict(trainer=train, sampler=decode, train_s=train["bytes"] / chip.ici_bw,
              decode_s=decode["bytes"] / chip.ici_bw)


_KNOBS = {
    "trainer_step": ("more micro-batches (optimizer.micro_batches)", "more FSDP (topology.trainer_mesh.fsdp) or "
                     "bf16 params (model.overrides.param_dtype)"),
    "sampler_prefill": ("fewer slots (rollout.slots) or shorter rollout.max_prompt_len",
                        "more tensor parallelism (topology.sampler_mesh.tensor)"),
    "sampler_decode": ("fewer slots (rollout.slots) or shorter rollout.max_new_tokens",
                       "more tensor parallelism (topology.sampler_mesh.tensor)"),
    "sampler_admit": ("fewer slots (rollout.slots) or shorter rollout.max_new_tokens",
                      "more tensor parallelism (topology.sampler_mesh.tensor)"),
    "sampler_recompute": ("fewer slots (rollout.slots) or rollout.on_swap='keep'",
                          "more tensor parallelism (topology.sampler_mesh.tensor)"),
    "teacher_score": ("fewer rows at once (teacher.rows_per_pass) or a smaller teacher.chunk",
                      "more service devices (topology.service_slices) or topology.service_mesh.tensor"),
}


def check_fit(progs: list[Program], chip: Chip) -> None:
  for q in progs:
    if q.peak_bytes > chip.hbm_bytes:
      base = q.name.split("[")[0]  # a variant's knobs are its row's
      act, weights = _KNOBS.get(base, ("smaller buckets", "more devices per role"))
      knob = act if q.temp_bytes >= q.argument_bytes else weights
      if base == "trainer_step" and q.temp_bytes >= q.argument_bytes:
        knob += " or remat (model.overrides.remat=True)"
      raise PlanError(_no_fit(q.name, q.peak_bytes, chip, f"args {q.argument_bytes / GIB:.3g}, temp "
                              f"{q.temp_bytes / GIB:.3g} GiB", knob))
