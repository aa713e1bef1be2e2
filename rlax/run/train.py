"""The trainer's batch shapes, decided once per run: which layouts a batch may take, how many rows and
scored slots each has, and its micro-batches.

    plan = run_lib.train_plan(run, trainer)
    trainer.fix_shapes(plan.abstract(trainer, with_ref=False))      # and compile_ahead() compiles them
    batch = packing.for_trainer(host_batch, trainer, plan.packed, share_prompts, padded=plan.padded)

A packed program holds one row per sequence (its worst case) as whole micro-batches, filled in order
(`rlax.trainer.state.fill_order`); the micro-batches a batch leaves empty are skipped inside the step, so
a batch with few rows costs few rows, and no batch needs a new program. Callers: builders (the trainer),
the controller (packing), rlax.memory (its largest micro-batch) and rlax.planning (what it lowers).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlax.config import RunConfig
from rlax.models import sharding as shd
from rlax.rollout import packing
from rlax.trainer.state import fill_order


@dataclasses.dataclass(frozen=True)
class TrainProgram:
  """One train-step batch shape: `rows` x `length` tokens in `micro_batches` micro-batches; `packed` its packed
  layout (None: padded rows of [prompt | response])."""
  rows: int
  length: int
  micro_batches: int
  packed: Optional[packing.PackedShape] = None

  @property
  def micro_rows(self) -> int:
    """Rows of one micro-batch (over every row shard)."""
    return self.rows // self.micro_batches


@dataclasses.dataclass(frozen=True)
class TrainPlan:
  """Every train-step program of a run; `padded`: whether a batch may stay in padded rows."""
  programs: tuple[TrainProgram, ...]
  seqs: int
  prompt_len: int
  max_new_tokens: int

  @property
  def packed(self) -> tuple[packing.PackedShape, ...]:
    return tuple(p.packed for p in self.programs if p.packed is not None)

  @property
  def padded(self) -> bool:
    return any(p.packed is None for p in self.programs)

  def abstract(self, trainer, *, with_ref: bool) -> list:
    """(abstract batch, micro-batches) of every program, as `trainer.fix_shapes` takes them."""
    out = []
    for p in self.programs:
      if p.packed is None:
        b = trainer.abstract_batch(p.rows, p.length, with_ref=with_ref, prompt_len=self.prompt_len)
      else:
        b = trainer.abstract_packed(p.rows, p.length, p.packed.slots, self.seqs, with_ref=with_ref,
                                    max_len=self.max_new_tokens)
      out.append((b, p.micro_batches))
    return out

  def largest_micro_batch(self, mesh) -> TrainProgram:
    """The program whose micro-batch holds the most tokens per device (what activations are sized for)."""
    per_device = lambda p: p.micro_rows // shd.row_shards(mesh, p.rows) * p.length
    return max(self.programs, key=per_device)

  def largest_abstract(self, trainer, *, with_ref: bool):
    """`largest_micro_batch`'s abstract batch (what rlax.memory and rlax.planning size and lower)."""
    return dict(zip(self.programs, self.abstract(trainer, with_ref=with_ref)))[
        self.largest_micro_batch(trainer.mesh)][0]


def row_lengths(run: RunConfig) -> tuple[int, ...]:
  """Packed row lengths of the run: optimizer.pack_tokens, or (-1) `packing.auto_row_lens`; () for padded."""
  p, r = run.optimizer.pack_tokens, run.rollout
  if p != -1:
    return (p,) if p else ()
  return packing.auto_row_lens(run.model, r.max_prompt_len, r.max_new_tokens, r.samples_per_prompt,
                               run.optimizer.share_prompts)


def _full_length_cost(run: RunConfig, prog: TrainProgram) -> float:
  """`packing.row_cost` of the rows `prog` runs for a batch of full-length sequences with shared prompts (whole
  groups to a row where they fit, else a group's responses over rows that each hold its prompt), in whole
  micro-batches: where this is not below the padded batch's cost, packing may not pay and the padded program
  is kept for the batches where it does not."""
  r = run.rollout
  P, N, G, L = r.max_prompt_len, r.max_new_tokens, r.samples_per_prompt, prog.length
  groups = r.rows // G
  whole = L // (P + G * N)
  rows = -(-groups // whole) if whole else groups * -(-G // max(1, (L - P) // N))
  per = prog.micro_rows  # rows of one micro-batch over every shard; micro-batches run whole
  return packing.row_cost(run.model, -(-rows // per) * per, L)


def train_plan(run: RunConfig, trainer) -> TrainPlan:
  """The run's train programs on `trainer`'s mesh: one packed program per row length (one row per sequence at
  most, micro-batches of optimizer.micro_batch_tokens, else of the rows a batch of full-length sequences
  needs) and the padded one where packing may save too little (no shared prompts, groups of one, or full-length
  sequences that fill packed rows no better than padded ones)."""
  r, o = run.rollout, run.optimizer
  B, P, N, G = r.rows, r.max_prompt_len, r.max_new_tokens, r.samples_per_prompt
  seq, unit = P + N, trainer.packed_rows_multiple()
  shards = unit // trainer.micro_batches
  programs = []
  for L in row_lengths(run):
    full = packing.row_bucket(-(-B // max(1, L // seq)), unit)  # rows of a batch of full-length sequences
    per = max(1, o.micro_batch_tokens // L) if o.micro_batch_tokens else full // unit
    per = min(per, full // shards)  # rows per shard in one micro-batch
    step = shards * per * trainer.micro_batches
    R = -(-B // step) * step
    n = R // (shards * per)
    K = packing.slot_cap(L, P, N, G, o.share_prompts)
    order = tuple(int(i) for i in fill_order(R, n, shards))
    programs.append(TrainProgram(R, L, n, packing.PackedShape(L, R, K, order)))
  if not programs or not o.share_prompts or G == 1 or any(
      _full_length_cost(run, p) > packing.PACKED_OVERHEAD_RATIO * packing.row_cost(run.model, B, seq)
      for p in programs):
    programs.append(TrainProgram(B, seq, trainer.num_micro_batches(B, seq)))
  return TrainPlan(tuple(programs), seqs=B, prompt_len=P, max_new_tokens=N)
