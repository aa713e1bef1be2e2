"""What the plan lowers: the run's trainer and sampler programs at the run's own sizes, through public lowerings.

The trainer's programs are the resolved run's (`rlax.run.train_plan`), every one; the sampler is built with the
slots the runtime gives it (`rlax.builders.slots`), and its programs are the largest of each kind the run
compiles (rlax.planning's docstring says which are left out); a judge's engine is the runtime's
(`rlax.judges.engine`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rlax import builders
from rlax import config as config_lib
from rlax import judges
from rlax import models
from rlax import run as run_lib
from rlax.models import hf
from rlax.models import variation
from rlax.sampler import Sampler, layouts, paged, sizing, strategies
from rlax.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Lowering:
  """One program to compile: its table name (`base[detail]` for a variant of a PROGRAMS row), its lowering, the
  analytic FLOPs per chip (0: none) and the sizes it is lowered at."""
  name: str
  lower: Callable[[], jax.stages.Lowered]
  est_flops: float = 0.0
  shape: dict = dataclasses.field(default_factory=dict)

  @property
  def base(self) -> str:
    """The PROGRAMS name it belongs to (what plan.programs selects and the knobs are keyed by)."""
    return self.name.split("[")[0]


def model_flops(cfg: models.ModelConfig, tokens: int, context: int) -> float:
  """Forward FLOPs: 2 x matmul params per token + attention (2 x 2 x layers x heads x head_dim x context)."""
  D, L, H, Dh, V = cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.vocab_size
  matmul = L * cfg.layer_matmul_weights() + D * V
  return tokens * (2 * matmul + 4 * L * H * Dh * context)


def train_name(p: run_lib.TrainProgram, largest: run_lib.TrainProgram) -> str:
  """`trainer_step` for the program with the largest micro-batch, `trainer_step[<rows>x<length>]` for the rest
  (`,padded` marks padded rows)."""
  return "trainer_step" if p == largest else f"trainer_step[{p.rows}x{p.length}{'' if p.packed else ',padded'}]"


def train_lowerings(c: config_lib.RunConfig, trainer: Trainer) -> list[Lowering]:
  """Every train-step program of the run (the largest micro-batch first), as `compile_ahead` compiles them.

  Their analytic FLOPs are the same: what one batch of full-length sequences needs, whichever layout holds it."""
  plan = run_lib.train_plan(c, trainer)
  largest = plan.largest_micro_batch(trainer.mesh)
  batches = dict(zip(plan.programs, plan.abstract(trainer, with_ref=c.algorithm.kl_coef > 0)))
  r, cfg = c.rollout, c.model
  seq = r.max_prompt_len + r.max_new_tokens
  # forward + backward (the variation's passes) + the remat forward
  passes = 1 + variation.of(cfg, c.lora).backward_passes + (1 if cfg.remat else 0)
  flops = passes * model_flops(cfg, r.rows * seq, seq // 2) / trainer.mesh.devices.size
  order = [largest] + [p for p in plan.programs if p != largest]
  lower = lambda batch: lambda: trainer.lower_step(trainer.abstract_state(), batch)
  return [Lowering(train_name(p, largest), lower(batches[p][0]), flops,
                   dict(rows=p.rows, length=p.length, micro_batches=p.micro_batches, packed=p.packed is not None))
          for p in order]


def sampler_slots(c: config_lib.RunConfig, mesh: Mesh, hbm_bytes: float) -> int:
  """The slots the runtime gives the sampler on `mesh` (rollout.slots=-1: what a chip's HBM holds)."""
  return builders.slots(c, mesh, budget=int(hbm_bytes), platform=mesh.devices.flat[0].platform)


def build_sampler(c: config_lib.RunConfig, mesh: Mesh, slots: int, scan: bool | None = None) -> Sampler:
  """The sampling engine the runtime builds, on `mesh` with `slots` slots; its cache layout is the runtime's for
  these devices (on TPU: the paged pool, with jax's Pallas kernel where it compiles).

  No memory budget: the plan measures memory from the compiled programs instead. scan: override
  `c.model.scan_layers` (False: the layers unrolled, which XLA's cost analysis counts in full).
  """
  r = c.rollout
  cfg = c.model if scan is None else c.model.replace(scan_layers=scan)
  return Sampler(cfg, mesh, max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens, slots=slots,
                 eos_id=0, decode_chunk=r.decode_chunk, on_swap=r.on_swap, memory_budget_bytes=1 << 62)


def sampler_lowerings(c: config_lib.RunConfig, sampler: Sampler) -> list[Lowering]:
  """The prefill and admission of a full admission (`group_buckets(G)[-1]` groups) for the rollout's group size
  G (`sampler_prefill`, `sampler_admit`) and for each other group size the run samples with that admits more
  prompts at once (`sampler_prefill[<groups>x<samples>]`: evaluation, greedy evaluation), the weights as every
  program reads them, made once per pushed version (`sampler_fuse`), then the decode chunk
  over all slots with the rollout's sampling method (`sampler_decode`) and, with rollout.on_swap="recompute", the
  recompute of every slot's cache after a weight swap (`sampler_recompute`)."""
  r, cfg = c.rollout, c.model
  n = sampler.mesh.devices.size
  uses = builders.sampler_uses(c)
  G, strategy = uses[0]
  most = sampler.group_buckets(G)[-1]
  out, seen = [], set()
  for g, method in uses:
    q = sampler.group_buckets(g)[-1]
    if g in seen or (g != G and q <= most):
      continue  # shapes already lowered, or fewer prompts per call than the rollout's
    seen.add(g)
    tag = "" if g == G else f"[{q}x{g}]"
    admit = functools.lru_cache(maxsize=1)(functools.partial(sampler.lower_admit, q, g, method))
    shape = dict(groups=q, samples=g)
    out += [Lowering(f"sampler_prefill{tag}", lambda a=admit: a()["prefill"],
                     model_flops(cfg, q * r.max_prompt_len, r.max_prompt_len // 2) / n, shape),
            Lowering(f"sampler_admit{tag}", lambda a=admit: a()["admit"], shape=shape)]
  seq = r.max_prompt_len + r.max_new_tokens
  out.append(Lowering("sampler_fuse", sampler.lower_fuse))  # every program's weights, once per version
  out.append(Lowering("sampler_decode", lambda: sampler.lower_decode(strategy),
                      model_flops(cfg, sampler.slots, seq) / n, dict(slots=sampler.slots)))
  if r.on_swap == "recompute":  # a forward over every slot's whole context after each weight swap
    out.append(Lowering("sampler_recompute", sampler.lower_recompute,
                        model_flops(cfg, sampler.slots * seq, seq // 2) / n, dict(slots=sampler.slots)))
  return out


def judge_lowerings(c: config_lib.RunConfig, mesh: Mesh) -> list[Lowering]:
  """A judging run's judge (rlax.judges.engine) from its config.json on `mesh`, at the run's judge slots: the
  prefill and admission of a full admission of replies (`judge_prefill`, `judge_admit`) and the greedy decode
  chunk over every slot (`judge_decode`)."""
  j = c.judge
  cfg = hf.read_config(j.hf_checkpoint, dtype=c.model.dtype)
  engine = judges.engine(j, cfg, mesh, slots=builders.judge_slots(c), memory_budget_bytes=1 << 62)
  q, n, greedy = engine.group_buckets(1)[-1], mesh.devices.size, strategies.Greedy()
  admit = functools.lru_cache(maxsize=1)(functools.partial(engine.lower_admit, q, 1, greedy))
  return [Lowering("judge_prefill", lambda: admit()["prefill"],
                   model_flops(cfg, q * j.max_prompt_len, j.max_prompt_len // 2) / n, dict(replies=q)),
          Lowering("judge_admit", lambda: admit()["admit"], shape=dict(replies=q)),
          Lowering("judge_decode", lambda: engine.lower_decode(greedy),
                   model_flops(cfg, engine.slots, j.max_prompt_len + j.max_new_tokens) / n, dict(slots=engine.slots))]


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
