"""What a sampler compiles, decided once: its buckets and the calls of its warm-up. `Sampler.warm_up` makes
exactly these calls; `rlax.compiled` counts the programs they compile (each compiled program holds host heap)
without building an engine."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import jax
import numpy as np

from rlax.sampler import prompts as prompts_lib


ADMIT_FACTOR = 2  # admissions are padded to 1, 2, 4, ... groups (`Sampler`'s default)


def prompt_buckets(max_prompt_len: int, factor: int) -> tuple[int, ...]:
  """Prefill widths: 32, 32 factor, ... up to max_prompt_len (factor 0: max_prompt_len only)."""
  return prompts_lib.pow_buckets(32, max_prompt_len, factor) if factor else (max_prompt_len,)


def slot_buckets(slots: int, shards: int, shrink: bool) -> tuple[int, ...]:
  """Slot counts a stream decodes on: slots halved down to slots/128 (a decode program each), none under one
  whole shard row; just `slots` without shrinking. Up to 512 slots, a long tail of 1-4 rows decodes on 1-4
  slots: on W4 (64 slots) that is 1.10x as fast as stopping at slots/16."""
  if not shrink:
    return (slots,)
  return tuple(b for b in (slots >> i for i in range(8)) if b and b % shards == 0)[::-1]


def next_smaller(buckets: Sequence[int], size: int) -> int:
  """The bucket a stream of `size` slots shrinks to (0: none): one step at a time, so the shrink programs are
  one per bucket, not one per pair. Read by `Stream` and `Sizes.calls`."""
  return max((b for b in buckets if b < size), default=0)


def group_buckets(slots: int, samples: int, admit_factor: int) -> tuple[int, ...]:
  """Prompt counts an admission of groups of `samples` rows is padded to (one prefill and admit program each)."""
  return prompts_lib.pow_buckets(1, slots // samples, admit_factor)


EXTEND_BLOCKS = (8, 64)  # appended tokens are fed this many at a time (`extend_block`)


def extend_buckets(slots: int, max_new_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Rows an extension is padded to (1, 2, 4, ...: each padded row costs as much as a real one) and the blocks
  its appended tokens are fed in (a loop over blocks, any length: one program per rows and block). A larger
  block than an append can be (max_new_tokens - 2: a turn samples at least one token before and after it)
  would never run."""
  small = min(EXTEND_BLOCKS[0], max_new_tokens)
  return prompts_lib.pow2_buckets(1, slots), (small,) + tuple(b for b in EXTEND_BLOCKS[1:] if b <= max_new_tokens - 2)


def extend_block(blocks: Sequence[int], longest: int) -> int:
  """The block an extension whose longest append has `longest` tokens runs in: the largest that does not exceed
  it (past the smallest block, padding under 2x; at most 8 loops below the largest), else the smallest.
  Callers: `Sampler.extension` (and through it the warm-up, whose appends are one block long)."""
  return max((b for b in blocks if b <= longest), default=blocks[0])


def extend_width(block: int, max_new_tokens: int) -> int:
  """The appended tokens' array width for `block`: the budget rounded up to whole blocks."""
  return -(-max_new_tokens // block) * block


@dataclasses.dataclass(frozen=True)
class Sizes:
  """A sampler's compiled sizes, decided once by `sizes`: `Sampler` runs on them and `rlax.compiled` counts the
  programs of their warm-up without building an engine."""
  slots: int
  slot_buckets: tuple[int, ...]   # the tail's decode sizes (`slot_buckets`)
  prompt_widths: tuple[int, ...]  # prefill widths (`prompt_buckets`)
  admit_factor: int
  max_new_tokens: int
  recompute: bool                 # a weight swap recomputes the running rows' caches
  shrink: bool

  def group_buckets(self, samples: int) -> tuple[int, ...]:
    return group_buckets(self.slots, samples, self.admit_factor)

  def extend_buckets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return extend_buckets(self.slots, self.max_new_tokens)

  def calls(self, uses, *, extend: bool = False) -> list[tuple]:
    """Every call of a warm-up, in order: ("state", S), ("decode", S, strategy), ("recompute", S), ("cancel",
    S), ("shrink", S, b), ("grow", S), ("extend", A, block), ("admission", G, strategy, q, P). uses: the (samples
    per group, strategy) pairs a run samples with; extend: multi-turn extensions too."""
    out, buckets = [], self.slot_buckets
    for S in reversed(buckets):
      out.append(("state", S))
      out += [("decode", S, strategy) for _, strategy in uses]
      out += [("recompute", S)] * self.recompute + [("cancel", S)]
      out += [("shrink", S, next_smaller(buckets, S))] * (S > buckets[0])
      out += [("grow", S)] * (S < self.slots)
    if extend:
      rows, blocks = self.extend_buckets()
      out += [("extend", A, block) for A in rows for block in blocks]
    for G, strategy in uses:
      out += [("admission", G, strategy, q, P)
              for q, P in itertools.product(self.group_buckets(G), self.prompt_widths)]
    return out


def sizes(slots: int, shards: int, *, paged: bool, on_swap: str, max_prompt_len: int, max_new_tokens: int,
          shrink: bool = True, admit_factor: int = ADMIT_FACTOR, prompt_factor: int = 0) -> Sizes:
  """The sizes of a sampler of `slots` over `shards` row shards (see `Sampler` for the arguments). The paged
  layout's pool is not laid out by slot: it never shrinks. Callers: `Sampler`, `rlax.compiled`."""
  shrink = shrink and not paged
  return Sizes(slots, slot_buckets(slots, shards, shrink), prompt_buckets(max_prompt_len, prompt_factor),
               admit_factor, max_new_tokens, on_swap == "recompute", shrink)


def programs(warm_calls: Sequence[tuple]) -> set:
  """The distinct programs `warm_calls` compile: the weights' fuse and each call's own (an admission: a
  prefill of its width and an admit of its rows). Each compiled program holds host heap: `rlax.compiled`."""
  out = {("fuse",)}
  for c in warm_calls:
    if c[0] == "admission":
      _, G, strategy, q, P = c
      out |= {("prefill", q, P), ("admit", q, q * G, strategy)}
    else:
      out.add(c)
  return out


def run(engine, params, warm_calls: Sequence[tuple]) -> None:
  """Makes `warm_calls` on `engine` (a `Sampler`) under its mesh, with empty states: each program compiles and
  returns at once."""
  key = np.asarray(jax.random.key_data(jax.random.key(0)))  # off the mesh: the process's one eager program
  with engine.ctx():
    _make(engine, params, warm_calls, key)


def _make(engine, params, warm_calls: Sequence[tuple], key) -> None:
  st = None
  for kind, *a in warm_calls:
    if kind == "state":
      st = engine.empty(a[0])
    elif kind == "decode":
      st = engine.decode(params, st, 0, a[1])
    elif kind == "recompute":
      st = engine.recompute(params, st)
    elif kind == "cancel":
      st = engine.cancel(st, np.zeros(a[0], bool))
    elif kind == "shrink":
      engine.gather(st, np.arange(a[1]))
    elif kind == "grow":
      engine.grow(st)
    elif kind == "extend":  # appends one block long: that block's program (`extend_block`)
      A, block = a
      st = engine.extension(params, engine.empty(), [engine.slots] * A, [[0] * block] * A, [1] * A, [[]] * A, 0)
    else:  # an admission of q groups of G at prompt width P
      G, strategy, q, P = a
      st = engine.admission(params, engine.empty(), np.zeros((q, engine.max_prompt_len), np.int32),
                            np.full(q, P, np.int32), np.full(q * G, engine.slots, np.int32),
                            np.stack([key] * (q * G)), np.ones(q * G, np.int32), 0, strategy)
  jax.block_until_ready(st)
