"""Per-device memory of a run's trainer, sampler and service slices (its teacher or judge with placement "own"),
before anything is built; rlax.memory_check holds it to the devices' budgets.

    est = memory.estimate(run, trainer_devices=4, sampler_devices=4)
    print(est.summary())

Closed form and compile-free (milliseconds), so it runs before a multi-minute compile or an OOM. The
layouts are the runtime's own: the train state's shapes, dtypes and shardings come from
`builders.trainer(run, mesh).abstract_state()` on an `AbstractMesh` of the configured shape (the path
`rlax.planning` lowers), the sampler's from `models.param_shardings` and `models.cache_bytes`. What no
layout says (activations, logits, scratch) is modelled per token and per layer, with coefficients fitted
to XLA:CPU's compiled programs (`memory_analysis()` of `Trainer.lower_step`, `Sampler.lower_prefill` /
`lower_decode`; tests/test_memory.py holds the estimate to a stated factor of them). `rlax.planning`
gives the exact per-program figures for a target TPU topology, at the price of compiling.

Three XLA:CPU facts the estimate encodes (platform "cpu"), each seen in the compiled programs: bf16/f16
compute is upcast, so activations and weight copies cost f32 bytes; `remat` saves memory only with
`scan_layers` (over unrolled layers the scheduler hoists the recomputation and keeps every layer's
activations); and micro-batches are a scan (unrolled ones would all be live at once), so one micro-batch's
activations are live. Other platforms are assumed to honour remat and micro-batches and to keep
activations in the compute dtype; that is not measured here.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from rlax import builders
from rlax import compiled
from rlax import models
from rlax import run as run_lib
from rlax import services
from rlax import teachers
from rlax import topology
from rlax.config import RunConfig
from rlax.models import hf
from rlax.models import moe
from rlax.models import sharding as shd
from rlax.models import variation
from rlax.sampler import layouts, sizing
from rlax.sampler import params as params_lib
from rlax.sampler.layouts import make_layout

GIB = 2 ** 30

# Bytes per token of one layer's activations, in units of the activation itemsize (per element of d_model,
# of the attention projections and of the MLP) and in f32 per attention score. Fitted to XLA:CPU's
# compiled train step (saved for the backward pass) and prefill (inference, nothing saved).
# The train step keeps no attention scores (rlax.models.layers recomputes the probabilities in the backward
# pass): only the layer being differentiated holds its scores, probabilities and their gradient.
_TRAIN_PER_ELEM = dict(embed=4.8, mlp=5.0, score=0.0)
_TRAIN_LIVE_SCORES = dict(embed=0.0, mlp=0.0, score=3.0)
_INFER_PER_ELEM = dict(embed=2.0, mlp=2.0, score=2.0)
# f32 [rows, chunk, vocab] buffers live at once in the chunked log-prob backward (one more when the
# head is the tied embedding); [rows, vocab] f32 buffers of one sampling step (logits, probabilities,
# padded cumulative sums).
_LOGIT_COPIES = 2
_TIED_LOGIT_COPIES = 3
_SAMPLING_COPIES = 4

TRAINER_ITEMS = ("params", "opt_state", "grads", "ref_params", "critic", "batch", "activations", "logits")
SAMPLER_ITEMS = ("weights", "spare_weights", "pristine_base", "fused", "kv_cache", "teacher", "judge", "scratch")
HOST_ITEMS = ("runtime", "checkpoint")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes by item (`TRAINER_ITEMS`, `SAMPLER_ITEMS`); `notes[item]` says what it holds."""
  trainer: Mapping[str, int]
  sampler: Mapping[str, int]
  trainer_devices: int
  sampler_devices: int
  colocated: bool
  notes: Mapping[str, str]
  trainer_mesh: Mapping[str, int]
  sampler_mesh: Mapping[str, int]
  host: Mapping[str, int] = dataclasses.field(default_factory=dict)  # `HOST_ITEMS`, in host RAM
  host_is_device: bool = False  # CPU devices: device memory is the host's RAM, so the host items add to it
  service: Mapping[str, int] = dataclasses.field(default_factory=dict)  # teacher, judge, scratch on service slices
  service_devices: int = 0
  service_mesh: Mapping[str, int] = dataclasses.field(default_factory=dict)

  @property
  def trainer_bytes(self) -> int:
    """Per trainer device, at the step's peak."""
    return sum(self.trainer.values())

  @property
  def sampler_bytes(self) -> int:
    """Per sampler device, at the larger of the prefill / decode peaks, with the weight versions held."""
    return sum(self.sampler.values())

  @property
  def service_bytes(self) -> int:
    """Per service device (0 without service slices)."""
    return sum(self.service.values())

  @property
  def total_bytes(self) -> int:
    """Summed over every device (what one host's RAM must hold when all devices are fake CPU devices)."""
    host = (sum(self.host.values()) if self.host_is_device else 0) + self.service_bytes * self.service_devices
    if self.colocated:
      return (self.trainer_bytes + self.sampler_bytes) * self.trainer_devices + host
    return self.trainer_bytes * self.trainer_devices + self.sampler_bytes * self.sampler_devices + host

  def summary(self) -> str:
    """One line per item, GiB per device."""
    mesh = lambda m: "x".join(f"{k}{v}" for k, v in m.items() if v > 1) or "1"
    lines = []
    for role, items, n, m in (("trainer", self.trainer, self.trainer_devices, self.trainer_mesh),
                              ("sampler", self.sampler, self.sampler_devices, self.sampler_mesh),
                              ("service", self.service, self.service_devices, self.service_mesh)):
      if not n:
        continue
      lines.append(f"{role}: {n} device(s), mesh {mesh(m)}; GiB per device")
      for k, v in items.items():
        lines.append(f"  {k:<14s}{v / GIB:9.3f}  {self.notes.get(f'{role}.{k}', '')}")
      lines.append(f"  {'total':<14s}{sum(items.values()) / GIB:9.3f}")
    lines.append("host (this process, besides its devices); GiB")
    for k, v in self.host.items():
      lines.append(f"  {k:<14s}{v / GIB:9.3f}  {self.notes.get(f'host.{k}', '')}")
    where = "colocated: both roles on the same devices" if self.colocated else "disjoint devices"
    with_host = " + host" if self.host_is_device else ""
    lines.append(f"all devices ({where}){with_host}: {self.total_bytes / GIB:.3f} GiB")
    return "\n".join(lines)


# -- layouts ---------------------------------------------------------------------------------------------
def _param_bytes(cfg: models.ModelConfig, mesh: AbstractMesh, itemsize: int, subtree: Optional[str] = None) -> int:
  """Per-device bytes of the parameters (or of one subtree, e.g. 'layers') on `mesh`, `itemsize` bytes each."""
  shapes, shardings = models.init.abstract_params(cfg), models.param_shardings(cfg, mesh)
  if subtree:
    shapes, shardings = shapes[subtree], shardings[subtree]
  return sizing.tree_bytes(shapes, shardings, itemsize)


def _split(n: int, ways: int) -> int:
  """n per device when a mesh axis of size `ways` shards it (the rules skip axes that do not divide)."""
  return n // ways if n % ways == 0 else n


def _act_itemsize(cfg: models.ModelConfig, platform: str) -> int:
  return 4 if platform == "cpu" else cfg.jnp_dtype.itemsize  # XLA:CPU computes bf16/f16 in f32


def _layer_acts(cfg: models.ModelConfig, tokens: int, keys: int, tensor: int, isz: int,
                coef: Mapping[str, float]) -> float:
  """One layer's activation bytes for `tokens` queries attending over `keys` positions."""
  h, k, f = _split(cfg.n_heads, tensor), _split(cfg.n_kv_heads, tensor), _split(cfg.active_mlp_dim, tensor)
  per_token = (isz * (coef["embed"] * (cfg.d_model + (h + k) * cfg.head_dim) + coef["mlp"] * f)
               + 4 * coef["score"] * h * keys)
  return tokens * per_token


# -- the estimate ----------------------------------------------------------------------------------------
def _trainer_items(run: RunConfig, mesh: AbstractMesh, platform: str, notes: dict) -> dict[str, int]:
  cfg, r = run.model, run.rollout
  trainer = builders.trainer(run, mesh)  # the runtime's own layouts
  state = trainer.abstract_state()
  kl = run.algorithm.kl_coef > 0
  plan = run_lib.train_plan(run, trainer)  # the run's own programs
  prog, batch = plan.largest_micro_batch(mesh), plan.largest_abstract(trainer, with_ref=kl)
  rows_all, seq, n_micro = prog.rows, prog.length, prog.micro_batches
  packed = prog.packed is not None
  slots = prog.packed.slots if packed else r.max_new_tokens
  rows = prog.micro_rows // shd.row_shards(mesh, prog.rows)  # per device and micro-batch
  live = 1  # micro-batches are a scan: one is live (rlax.trainer.state.accumulate_gradients)
  tensor = dict(mesh.shape)["tensor"]
  isz = _act_itemsize(cfg, platform)
  trained = sizing.tree_bytes(state.params)  # LoRA: the adapters; else the params
  # Gradients in the trained tree's dtype and layout: the step's result and the clipped update live together;
  # accumulating over micro-batches adds the running sum.
  grads = trained * (2 if n_micro == 1 else 3)
  frozen = trainer.variation.frozen_base  # held beside what trains, and the KL reference (no second copy)
  params = trained + (_param_bytes(cfg, mesh, jnp.dtype(cfg.param_dtype).itemsize) if frozen else 0)
  one_layer = (_layer_acts(cfg, rows * seq, seq, tensor, isz, _TRAIN_PER_ELEM)
               + moe.block_weight_bytes(cfg, rows * seq, tensor, isz, platform))
  remat = cfg.remat and (cfg.scan_layers or platform != "cpu")
  if remat:  # each layer's input is kept; one layer at a time is recomputed for its backward pass
    acts = cfg.n_layers * rows * seq * cfg.d_model * isz + one_layer
  else:
    acts = cfg.n_layers * one_layer
  acts += _layer_acts(cfg, rows * seq, seq, tensor, isz, _TRAIN_LIVE_SCORES)
  positions = min(trainer.chunk, slots)  # scored positions per log-prob chunk
  copies = _TIED_LOGIT_COPIES if cfg.tie_embeddings else _LOGIT_COPIES
  logits = copies * rows * positions * _split(cfg.vocab_size, tensor) * 4
  notes.update({
      "trainer.params": f"{cfg.param_dtype}, sharded on the trainer mesh ({trainer.variation.describe()})",
      "trainer.opt_state": "AdamW moments (dtype and layout of what trains)",
      "trainer.grads": f"{cfg.param_dtype}" + (f", + running sum over {n_micro} micro-batches" if n_micro > 1 else ""),
      "trainer.ref_params": ("the frozen base (no copy)" if frozen else "reference policy (algorithm.kl_coef > 0)")
                            if kl else "none (algorithm.kl_coef = 0)",
      "trainer.batch": f"{rows_all} {'packed ' if packed else ''}rows x {seq} tokens",
      "trainer.activations": (f"{live} live micro-batch of at most {rows} rows x {seq} tokens per device "
                              f"({n_micro} in the largest batch), "
                              + ("remat" if remat else "no remat" + (" (remat needs scan_layers on CPU)"
                                                                    if cfg.remat else ""))),
      "trainer.logits": f"f32 [{rows} rows, {positions} positions, {cfg.vocab_size} vocab] x {copies * live}",
  })
  critic = 0
  if state.critic is not None:  # PPO's value model: its own params, AdamW moments and gradients
    cp = sizing.tree_bytes(state.critic.params)
    critic = cp + sizing.tree_bytes(state.critic.opt_state) + 2 * cp
  notes["trainer.critic"] = ("value model (algorithm ppo): params, AdamW moments, gradients; its activations "
                             "come after the policy's" if critic else "none (no value model)")
  return dict(params=params, opt_state=sizing.tree_bytes(state.opt_state), grads=grads,
              ref_params=params if kl and not frozen else 0,
              critic=critic, batch=sizing.tree_bytes(batch), activations=int(live * acts), logits=int(live * logits))


def _sampler_items(run: RunConfig, mesh: AbstractMesh, platform: str, notes: dict,
                   budget: Optional[int], beside: Sequence[str]) -> dict[str, int]:
  """`beside`: the frozen models ("teacher", "judge") that run on the sampler's devices."""
  cfg, r = run.model, run.rollout
  S = r.max_prompt_len + r.max_new_tokens
  B = builders.slots(run, mesh, budget, platform)  # the runtime's own sizing (rollout.slots=-1: what fits)
  layout = make_layout(cfg, "auto", r.max_prompt_len, r.max_new_tokens, platform=platform)
  mem = sizing.sampler_memory(cfg, layout, B, S, mesh)
  b = B // shd.row_shards(mesh, B)  # rows per device
  tensor = dict(mesh.shape)["tensor"]
  keep = run_lib.versions_kept(run)
  isz = _act_itemsize(cfg, platform)
  sampling = _SAMPLING_COPIES * b * _split(cfg.vocab_size, tensor) * 4
  groups = min(r.samples_per_prompt, run.eval.n_samples)
  prompts = max(1, b // groups)  # distinct prompts one prefill runs
  prefill = (sizing.recompute_bytes(cfg, prompts, r.max_prompt_len) + sampling
             + _layer_acts(cfg, prompts * r.max_prompt_len, r.max_prompt_len, tensor, isz, _INFER_PER_ELEM))
  # A weight swap recomputes every slot's cache (sampler.slots.recompute); the engine streams across versions.
  refill = mem["transient"] + _layer_acts(cfg, b * S, S, tensor, isz, _INFER_PER_ELEM)
  fused = _fused_bytes(cfg, mesh, isz, platform, layout)
  teacher, score = _teacher_bytes(run, mesh, isz) if "teacher" in beside else (0, 0.0)
  judge, judging = _judge_bytes(run, mesh, isz, platform) if "judge" in beside else (0, 0.0)
  programs = {"decode": sampling, "refill": refill, "prefill": prefill, "the teacher's scoring": score,
              "the judge's decode": judging}
  which = max(programs, key=programs.get)  # the first of equals, in this order
  scratch = programs[which]
  frozen = variation.of(cfg, run.lora).frozen_base  # pushes merge into the sampler's own copy of the base
  kind = "paged pool" if isinstance(layout, layouts.Paged) else "dense"
  slots_note = "rollout.slots = -1: as many as the budget holds" if r.slots == -1 else "rollout.slots"
  notes.update({
      "sampler.weights": f"{cfg.dtype} (the compute dtype)",
      "sampler.spare_weights": f"{keep} more version(s): the newest kept / arriving while the sampler uses one",
      "sampler.pristine_base": ("LoRA: the base every pushed version of the adapters merges into (compute dtype)"
                                if frozen else "none (no adapters)"),
      "sampler.kv_cache": f"{b} slots x {S} tokens per device ({B} slots: {slots_note}; {kind} layout)",
      "sampler.fused": ("the weights as the sampler's programs read them, made once per version (Sampler.fused)"
                        if fused else "none (the programs read the stored weights)"),
      "sampler.scratch": f"largest program scratch: {which} (sampling buffers, activations)",
      "sampler.teacher": (f"the teachers' weights ({', '.join(run.teacher.dirs().values())}), beside the sampler"
                          if teacher else "none (no teacher)"),
      "sampler.judge": (f"the judge's weights ({run.judge.hf_checkpoint}) and its KV cache "
                        f"({builders.judge_slots(run)} slots), beside the sampler" if judge else "none (no judge)"),
  })
  return dict(weights=mem["params"], spare_weights=keep * mem["params"],
              pristine_base=mem["params"] if frozen else 0, fused=int(fused), kv_cache=mem["cache"], teacher=teacher,
              judge=judge, scratch=int(scratch))


def _teacher_bytes(run: RunConfig, mesh: AbstractMesh, isz: int) -> tuple[int, float]:
  """A distilling run's teachers on `mesh` (rlax.teachers): (their weights, summed; the largest scoring program's
  scratch: one layer's activations and the chunked log-softmax over the rows one pass scores on this device; the
  teachers score one after another), 0s without one."""
  if not run.algorithm.distills:
    return 0, 0.0
  r, dirs, per_pass = run.rollout, run.teacher.dirs(), run.teacher.rows_per_pass
  call = teachers.call_rows(r.rows, len(dirs), per_pass)  # a call's rows, in row_passes passes
  batch = call // teachers.row_passes(call, per_pass, shd.row_shards(mesh, call))
  S, rows = r.max_prompt_len + r.max_new_tokens, batch // shd.row_shards(mesh, batch)
  tensor = dict(mesh.shape)["tensor"]
  weights, scratch = 0, 0.0
  for path in dirs.values():
    tcfg = hf.read_config(path, dtype=run.model.dtype)
    logits = _LOGIT_COPIES * rows * min(run.teacher.chunk, S) * _split(tcfg.vocab_size, tensor) * 4
    weights += sizing.weight_bytes(tcfg, mesh)
    scratch = max(scratch, logits + _layer_acts(tcfg, rows * S, S, tensor, isz, _INFER_PER_ELEM))
  return weights, scratch


def _service_items(run: RunConfig, mesh: AbstractMesh, platform: str, notes: dict,
                   own: Sequence[str]) -> dict[str, int]:
  """The service slices: the frozen models in `own` (placement "own", rlax.services), their weights and their
  programs' scratch, summed (the teacher scores in the producer's scoring thread while the judge grades)."""
  isz = _act_itemsize(run.model, platform)
  teacher, score = _teacher_bytes(run, mesh, isz) if "teacher" in own else (0, 0.0)
  judge, judging = _judge_bytes(run, mesh, isz, platform) if "judge" in own else (0, 0.0)
  notes.update({"service.teacher": "the teacher's weights" if teacher else "none (no teacher here)",
                "service.judge": (f"the judge's weights and its KV cache ({builders.judge_slots(run)} slots)" if judge
                                  else "none (no judge here)"),
                "service.scratch": "the teacher's scoring and the judge's decode, at once"})
  return dict(teacher=teacher, judge=judge, scratch=int(score + judging))


def _fused_bytes(cfg: models.ModelConfig, mesh: AbstractMesh, isz: int, platform: str, layout) -> int:
  """`Sampler.fused`'s copies: the layers (joined, or sliced per layer), the tied head transposed."""
  stacked, joined = params_lib.fused_layout(cfg, layout, platform)
  layers = _param_bytes(cfg, mesh, max(isz, cfg.jnp_dtype.itemsize), "layers") if joined or not stacked else 0
  head = cfg.d_model * _split(cfg.vocab_size, dict(mesh.shape)["tensor"]) * max(isz, cfg.jnp_dtype.itemsize)
  return layers + (head if cfg.tie_embeddings else 0)


def _judge_bytes(run: RunConfig, mesh: AbstractMesh, isz: int, platform: str) -> tuple[int, float]:
  """A judging run's judge on `mesh` (rlax.judges): (its weights, their fused copy and its KV cache,
  its decode's scratch: the sampling buffers), 0s without one."""
  if run.reward.name != "judge":
    return 0, 0.0
  j, slots, tensor = run.judge, builders.judge_slots(run), dict(mesh.shape)["tensor"]
  jcfg = hf.read_config(j.hf_checkpoint, dtype=run.model.dtype)
  layout = make_layout(jcfg, "auto", j.max_prompt_len, j.max_new_tokens, platform=platform)
  mem = sizing.sampler_memory(jcfg, layout, slots, j.max_prompt_len + j.max_new_tokens, mesh)
  sampling = _SAMPLING_COPIES * slots // shd.row_shards(mesh, slots) * _split(jcfg.vocab_size, tensor) * 4
  return int(mem["params"] + mem["cache"] + _fused_bytes(jcfg, mesh, isz, platform, layout)), sampling


def estimate(run: RunConfig, trainer_devices: int, sampler_devices: int, *, service_devices: int = 0,
             platform: Optional[str] = None, sampler_budget_bytes: Optional[int] = None) -> MemoryEstimate:
  """Per-device bytes of `run`'s trainer step on `trainer_devices` devices, of its sampler on `sampler_devices`
  and of its frozen models with placement "own" on `service_devices` (0: beside the sampler, as while their
  slices are lost); mesh shapes are the topology's; `platform` defaults to the default backend's.
  sampler_budget_bytes: what rollout.slots=-1 sizes the slots to (default: this host's first device's budget,
  as `builders.slots`)."""
  platform = platform or jax.default_backend()
  topo = run.topology
  if topo.colocated and trainer_devices != sampler_devices:
    raise ValueError(f"topology.colocated=True: trainer_devices={trainer_devices} and sampler_devices="
                     f"{sampler_devices} must be equal (both roles use the same devices)")
  tmesh, smesh = topology.role_meshes(topo, trainer_devices, sampler_devices)
  notes: dict[str, str] = {}
  trainer = _trainer_items(run, tmesh, platform, notes)
  own = [k for k, v in services.placements(run).items() if v == "own" and service_devices]
  sampler = _sampler_items(run, smesh, platform, notes, sampler_budget_bytes,
                           [k for k in services.placements(run) if k not in own])
  vmesh = topology.abstract_mesh(topo.service_mesh, service_devices, "service") if own else None
  service = _service_items(run, vmesh, platform, notes, own) if own else {}
  # A checkpoint save copies the train state to the host before writing it; where it blocks (on CPU devices) it
  # streams chunks of it, and the chunk replaces the step's transients (gradients, activations, logits) rather
  # than adding to them.
  state = run_lib.host_copy_bytes(platform, (trainer["params"] + trainer["opt_state"] + trainer["critic"])
                                  * trainer_devices, run_lib.largest_array_bytes(run.model))
  blocks = run_lib.checkpoint_blocks(platform)
  if blocks:
    state = max(0, state - (trainer["grads"] + trainer["activations"] + trainer["logits"]) * trainer_devices)
  programs = compiled.programs(run, tmesh, smesh, platform, sampler_budget_bytes)
  host = dict(runtime=compiled.runtime_bytes(programs), checkpoint=state)
  notes.update({"host.runtime": (f"Python, JAX/XLA, tokenizer and records; {sum(n for n, _ in programs)} "
                                 "compiled programs (the sampler's warm-up, the train steps, eager operations, "
                                 "teachers' and judge's)"),
                "host.checkpoint": ("the chunk of the train state a save streams, beyond the step's "
                                    "transients (a save blocks between steps)" if blocks else
                                    "the train state's host copy while an async checkpoint save runs")})
  return MemoryEstimate(trainer, sampler, trainer_devices, sampler_devices, topo.colocated, notes,
                        dict(tmesh.shape), dict(smesh.shape), host, host_is_device=platform == "cpu",
                        service=service, service_devices=service_devices if own else 0,
                        service_mesh=dict(vmesh.shape) if own else {})
