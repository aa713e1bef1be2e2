"""Ahead-of-time plan: compile the real trainer, sampler and weight-push programs for a target topology.

    plan = make_plan(config)          # config: configs/paper_qwq32b.py's get_config()
    print(format_table(plan))

Devices: `jax.experimental.topologies.get_topology_desc(c.plan.topology, "tpu", num_slices=...)` (the `tpu`
extra; no TPU attached), or the local backend's for "local" (tests: 8 fake CPU devices), through the runtime's
own `build_topology`. Programs are built through public lowerings only (`Trainer.abstract_state` /
`abstract_batch` / `lower_step`, `Sampler.abstract_state` / `lower_admit` / `lower_decode`,
`CrossMeshPush.lowered`), so the plan cannot drift from what runs (on TPU the decode chunk is the paged
layout's, with jax's Pallas kernel). Each is compiled; `memory_analysis()` gives per-chip bytes and
`cost_analysis()` FLOPs and bytes accessed. Times are a roofline, max(flops / peak, bytes / HBM bandwidth): a
lower bound. The weight push time is a bandwidth model, not a measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlax import builders
from rlax import config as config_lib
from rlax import models
from rlax import planning_sync
from rlax import run as run_lib
from rlax.multihost import CrossMeshPush
from rlax.sampler import Sampler, Temperature, layouts, paged, sizing
from rlax.topology import Topology, build_topology
from rlax.trainer import Trainer

GIB = 2 ** 30
PROGRAMS = ("trainer_step", "sampler_prefill", "sampler_admit", "sampler_decode", "push_to_transport",
            "push_cross", "push_to_sampler")
LORA_PROGRAMS = ("sampler_merge",)  # with model.lora: the adapters merged into the sampler's pristine base


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


def build_sampler(c: config_lib.RunConfig, mesh: Mesh, scan: bool | None = None) -> Sampler:
  """The sampling engine the runtime builds, on `mesh` with `c.plan.sampler_batch` slots; its cache layout is
  the runtime's for these devices (on TPU: the paged pool, with jax's Pallas kernel where it compiles).

  No memory budget: the plan measures memory from the compiled programs instead. scan: override
  `c.model.scan_layers` (False: the layers unrolled, which XLA's cost analysis counts in full).
  """
  r = c.rollout
  cfg = c.model if scan is None else c.model.replace(scan_layers=scan)
  return Sampler(cfg, mesh, max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
                 slots=c.plan.sampler_batch, eos_id=0, decode_chunk=r.decode_chunk, memory_budget_bytes=1 << 62)


def trainer_program(c: config_lib.RunConfig, trainer: Trainer, chip: Chip) -> jax.stages.Lowered:
  """`trainer`'s RL step lowered for the run's batch whose micro-batch is largest (rlax.run.train_plan); fails fast (before a compile that takes minutes at 32B)
  when the train state alone exceeds HBM."""
  batch = run_lib.train_plan(c, trainer).largest_abstract(trainer, with_ref=c.algorithm.kl_coef > 0)
  state = trainer.abstract_state()
  resident = sum(planning_sync.shard_bytes(x) for x in jax.tree.leaves(state))
  if resident > chip.hbm_bytes:
    raise PlanError(_no_fit("trainer_step", resident, chip, "params + optimizer state alone",
                            "more FSDP (topology.trainer_mesh.fsdp) or more trainer slices"))
  return trainer.lower_step(state, batch)


def sampler_programs(c: config_lib.RunConfig, sampler: Sampler, chip: Chip) -> dict[str, Any]:
  """Thunks lowering the engine's programs through its public lowerings: the prefill of a full admission
  (every slot's group at once), its admission into the slots, and the decode chunk over all slots."""
  r = c.rollout
  B, G = sampler.slots, r.samples_per_prompt
  if B % G:
    raise ValueError(f"plan.sampler_batch={B} is not a multiple of rollout.samples_per_prompt={G}")
  resident = sampler.memory["params"] + sampler.memory["cache"]  # the engine's own accounting
  if c.lora.enabled:  # + the pristine base the adapters merge into
    resident += planning_sync.pristine_bytes(c, sampler.mesh)
  if resident > chip.hbm_bytes:
    raise PlanError(_no_fit("sampler_decode", resident, chip, "params + KV cache alone",
                            f"{_KNOBS['sampler_decode'][0]} or {_KNOBS['sampler_decode'][1]}"))
  strategy = Temperature(r.temperature)
  admit = functools.lru_cache(maxsize=1)(lambda: sampler.lower_admit(B // G, G, strategy))
  return {"sampler_prefill": lambda: admit()["prefill"], "sampler_admit": lambda: admit()["admit"],
          "sampler_decode": lambda: sampler.lower_decode(strategy)}


def decode_counts(c: config_lib.RunConfig, sampler: Sampler, unrolled: jax.stages.Compiled) -> dict[str, Any]:
  """Per-chip bytes of one decode step, which the scanned program's cost analysis cannot give.

  XLA counts a loop body once and cannot see into a Mosaic kernel, so the chunk is compiled with its layers
  unrolled (`unrolled`) and on the paged layout the kernel's own count is added (`paged.kernel_cost`: every page
  of every slot at the full context). Compared with what a step must read: weights + KV cache per chip. XLA's
  count is of the whole chunk, whose while loop carries the state and weights in its tuple (not separable from
  per-step traffic); the dense layout's chunk has one loop per segment bound, each body counted once.
  """
  r, cfg, mesh, lay = c.rollout, c.model, sampler.mesh, sampler.layout
  S, max_len = sampler.slots, r.max_prompt_len + r.max_new_tokens
  cost = unrolled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  xla = float(cost.get("bytes accessed", 0.0))
  kernel = dict(bytes_accessed=0.0, flops=0.0, pages_read=0)
  paged_layout = isinstance(lay, layouts.Paged)
  if paged_layout and lay.attention == "kernel":  # per chip: its own slots and KV heads (and their query heads)
    state = sampler.abstract_state()
    s_loc = state.t.sharding.shard_shape((S,))[0]
    k_loc = state.cache.k.sharding.shard_shape(state.cache.k.shape)[0]
    local = cfg.replace(n_kv_heads=k_loc, n_heads=cfg.n_heads // cfg.n_kv_heads * k_loc)
    ppb = paged.default_pages_per_block(lay.pages, lay.page_size)  # what the kernel call uses
    kernel = paged.kernel_cost(local, [max_len] * s_loc, lay.page_size, ppb, q_dtype=jnp.float32)
  weights = sizing.weight_bytes(cfg, mesh)
  kv = sizing.kv_bytes(cfg, lay, S, mesh)
  step = xla + kernel["bytes_accessed"]
  return dict(layout="paged" if paged_layout else "dense", attention=lay.attention if paged_layout else "dense",
              page_size=lay.page_size if paged_layout else 0, slots=S, context=max_len,
              xla_step_bytes=xla, xla_step_flops=float(cost.get("flops", 0.0)), kernel_bytes=kernel["bytes_accessed"],
              kernel_flops=kernel["flops"], kernel_pages_read=kernel["pages_read"], step_bytes=step,
              weights_bytes=weights, kv_bytes=kv, ratio=step / max(weights + kv, 1))


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


def model_flops(cfg: models.ModelConfig, tokens: int, context: int) -> float:
  """Forward FLOPs: 2 x matmul params per token + attention (2 x 2 x layers x heads x head_dim x context)."""
  D, L, H, K, Dh, F, V = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim,
                          cfg.vocab_size)
  matmul = L * (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F) + D * V
  return tokens * (2 * matmul + 4 * L * H * Dh * context)


def selected_programs(p) -> tuple[str, ...]:
  """The programs `p.programs` names (comma-separated; "" = all), in PROGRAMS order; ValueError on unknown names."""
  names = [n.strip() for n in (p.programs or "").split(",") if n.strip()]
  known = PROGRAMS + LORA_PROGRAMS
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
  progs = []
  if "trainer_step" in want:
    progs.append(_analyze("trainer_step", desc_t, lambda: trainer_program(c, trainer, chip), chip)[0])
  sampler = build_sampler(c, topo.sampler_mesh)
  first = build_sampler(c, on_first_slices(topo.sampler_mesh, devices))
  decode = None
  if {"sampler_prefill", "sampler_admit", "sampler_decode"} & set(want):
    sp = sampler_programs(c, first, chip)
    for name in ("sampler_prefill", "sampler_admit"):
      if name in want:
        progs.append(_analyze(name, desc_s, sp[name], chip)[0])
  if "sampler_decode" in want:
    prog, compiled = _analyze("sampler_decode", desc_s, sp["sampler_decode"], chip)
    progs.append(prog)
    t0, counted_s = time.perf_counter(), prog.compile_s
    if first.layout.scans and cfg.scan_layers:  # XLA counts a scanned layer once: count the unrolled chunk
      compiled = build_sampler(c, first.mesh, scan=False).lower_decode(Temperature(c.rollout.temperature)).compile()
      counted_s = time.perf_counter() - t0
    decode = dict(decode_counts(c, first, compiled), unrolled_compile_s=counted_s)
  if c.lora.enabled and "sampler_merge" in want:
    progs.append(_analyze("sampler_merge", desc_s, lambda: planning_sync.lower_merge(c, first), chip)[0])
  if not topo.colocated and {"push_to_transport", "push_cross", "push_to_sampler"} & set(want):
    target = planning_sync.push_target(c, sampler)  # what the sampler receives: weights, or LoRA's adapters
    push = CrossMeshPush(topo.trainer_mesh, topo.sampler_mesh, jax.tree.map(lambda x: x.sharding, target),
                         dtype=None if c.lora.enabled else cfg.jnp_dtype)
    t0 = time.perf_counter()
    parts = push.lowered(trainer.abstract_state().params, compile_mesh=lambda m: on_first_slices(m, devices))
    lower_s = (time.perf_counter() - t0) / len(parts)  # lowering is shared; split it evenly
    meshes = {"push_to_transport": push.mirror, "push_cross": push.global_mesh, "push_to_sampler": topo.sampler_mesh}
    for name, lowered in parts.items():
      if name in want:
        progs.append(_analyze(name, _mesh_desc(meshes[name]), lambda: lowered, chip, extra_s=lower_s)[0])
  return _table(c, chip, cfg, topo, progs, devices, sampler, decode)


def _table(c, chip: Chip, cfg: models.ModelConfig, topo: Topology, progs: list[Program], devices, sampler: Sampler,
           decode: dict[str, Any] | None = None) -> dict[str, Any]:
  r = c.rollout
  rows = r.rows
  seq = r.max_prompt_len + r.max_new_tokens
  by = {q.name: q for q in progs}
  n_tr, n_sa = topo.trainer_mesh.devices.size, topo.sampler_mesh.devices.size
  B, G = c.plan.sampler_batch, r.samples_per_prompt
  # forward + backward (2x; LoRA: 1x, no weight gradients of the frozen base) + the remat forward
  passes = (4 if cfg.remat else 3) - (1 if c.lora.enabled else 0)
  estimates = {}
  if "trainer_step" in by:
    by["trainer_step"].est_flops = passes * model_flops(cfg, rows * seq, seq // 2) / n_tr
    by["trainer_step"].est_bytes = by["trainer_step"].argument_bytes + by["trainer_step"].output_bytes
    step_s = by["trainer_step"].roofline_s(chip)
    estimates.update(train_step_s=step_s, train_tokens_per_s=rows * seq / max(step_s, 1e-12),
                     train_mfu_flops_per_chip=by["trainer_step"].est_flops)
  if "sampler_prefill" in by:
    by["sampler_prefill"].est_flops = model_flops(cfg, B // G * r.max_prompt_len, r.max_prompt_len // 2) / n_sa
    by["sampler_prefill"].est_bytes = by["sampler_prefill"].argument_bytes + by["sampler_prefill"].output_bytes
    estimates.update(prefill_s=by["sampler_prefill"].roofline_s(chip))
  if "sampler_decode" in by:
    # Its bytes are counted, not assumed: XLA over the unrolled layers (+ the kernel's page reads).
    by["sampler_decode"].est_flops = model_flops(cfg, B, seq) / n_sa
    by["sampler_decode"].est_bytes = decode["step_bytes"]
    decode_s = by["sampler_decode"].roofline_s(chip)
    estimates.update(decode_token_step_s=decode_s, sampler_tokens_per_s=B / max(decode_s, 1e-12), decode=decode)
  slices = {getattr(d, "slice_index", 0) for d in topo.devices_of(topo.assignment.trainer)}
  cross_dcn = not slices & {getattr(d, "slice_index", 0) for d in topo.devices_of(topo.assignment.sampler)}
  estimates.update(planning_sync.estimates(c, sampler, chip, cross_dcn and not topo.colocated))
  table = dict(
      config=dict(model=c.model_preset, params=cfg.num_params(), devices=len(devices),
                  topology=f"{c.plan.topology} x {c.plan.num_slices}", chip=chip.name,
                  trainer_mesh=dict(topo.trainer_mesh.shape), sampler_mesh=dict(topo.sampler_mesh.shape),
                  batch_rows=rows, seq_len=seq, micro_batches=c.optimizer.micro_batches,
                  sampler_batch=c.plan.sampler_batch, lora_rank=c.lora.rank),
      assumptions=dict(hbm_gib=chip.hbm_bytes / GIB, peak_tflops=chip.peak_flops / 1e12,
                       hbm_tb_s=chip.hbm_bw / 1e12, ici_gb_s=chip.ici_bw / 1e9, dcn_gb_s=chip.dcn_bw / 1e9,
                       time=("roofline max(flops/peak, bytes/hbm_bw) per chip; flops/bytes = max(cost_analysis, "
                             "analytic count: 2 x matmul params x tokens + attention, x4 with remat for training; "
                             "decode reads all weights + cache per token); a lower bound"),
                       decode=("sampler_decode bytes per token step = XLA's count of the chunk's loop body with "
                               "its layers unrolled + on the paged layout the kernel's page reads (jax's kernel "
                               "ships no cost estimate)"),
                       push="bandwidth model: transport (ICI) + cross (DCN across slices) + gather (ICI)"),
      programs=[dict(dataclasses.asdict(q), peak_bytes=q.peak_bytes, peak_gib=round(q.peak_bytes / GIB, 3),
                     hbm_frac=round(q.peak_bytes / chip.hbm_bytes, 4), roofline_s=q.roofline_s(chip),
                     analytic_s=q.analytic_s(chip))
                for q in progs],
      estimates=estimates,
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
    "sampler_admit": ("fewer slots (plan.sampler_batch) or shorter rollout.max_new_tokens",
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
