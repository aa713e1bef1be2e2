"""The host memory of the process itself, beside its devices' buffers: Python, JAX/XLA and the programs the run
compiles, counted without building anything (each compiled program holds host heap). Read by `rlax.memory`'s
estimate (its `host.runtime` item)."""

from __future__ import annotations

from typing import Optional, Sequence

from jax.sharding import AbstractMesh

from rlax import builders
from rlax import judges
from rlax import run as run_lib
from rlax import teachers
from rlax.config import RunConfig
from rlax.models import hf
from rlax.models import sharding as shd
from rlax.sampler import layouts
from rlax.sampler import warmup

# The process before its programs: Python, JAX/XLA, tokenizer and records (after the warm-up, free pages returned).
_PROCESS_BYTES = int(0.5 * 2 ** 30)
# The host heap a compiled program holds, as loaded from the persistent cache (XLA:CPU keeps more of a loaded
# executable than of one it compiled: 40.0 against 23.7 MiB a program over the calculator run's 54 sampler
# programs, SmolLM2-135M's 30 layers; a one-layer program 3 MiB; 2026-12-07): a part per program, one per layer.
PROGRAM_BYTES = 3 * 2 ** 20
PROGRAM_LAYER_BYTES = int(1.25 * 2 ** 20)
EAGER_PROGRAMS = 25  # eager operations (jit(stage)) a process compiles once, one-layer sized


def programs(run: RunConfig, tmesh: AbstractMesh, smesh: AbstractMesh, platform: str,
             budget: Optional[int]) -> list[tuple[int, int]]:
  """(programs, layers each) the run compiles: its sampler's warm-up (`warmup.sizes` as `builders.sampler`'s
  engine decides them, counted without building it), its train steps (with the reference's log-probs where
  algorithm.kl_coef > 0), the teachers' scoring, the judge's warm-up and the eager operations."""
  r, L = run.rollout, run.model.n_layers
  B = builders.slots(run, smesh, budget, platform)
  paged = isinstance(layouts.make_layout(run.model, "auto", r.max_prompt_len, r.max_new_tokens, platform=platform),
                     layouts.Paged)
  sizes = warmup.sizes(B, shd.row_shards(smesh, B), paged=paged, on_swap=r.on_swap, max_prompt_len=r.max_prompt_len,
                       max_new_tokens=r.max_new_tokens)
  calls = sizes.calls(builders.sampler_uses(run), extend=run.env.episodic)
  steps = len(run_lib.train_plan(run, builders.trainer(run, tmesh)).programs) * (1 + (run.algorithm.kl_coef > 0))
  out = [(len(warmup.programs(calls)), L), (steps, L), (EAGER_PROGRAMS, 1)]
  out += [(teachers.programs_each(run.env.episodic), hf.read_config(path).n_layers)
          for path in (run.teacher.dirs().values() if run.algorithm.distills else ())]
  if run.reward.name == "judge":
    judging = judges.sizes(run.judge, builders.judge_slots(run)).calls(judges.USES)
    out.append((len(warmup.programs(judging)), hf.read_config(run.judge.hf_checkpoint).n_layers))
  return out


def runtime_bytes(counted: Sequence[tuple[int, int]]) -> int:
  """The process's host bytes with the programs `counted` ((programs, layers each), as `programs` gives them)."""
  return _PROCESS_BYTES + sum(n * (PROGRAM_BYTES + layers * PROGRAM_LAYER_BYTES) for n, layers in counted)
