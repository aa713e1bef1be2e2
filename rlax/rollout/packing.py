"""Between the sampler and the trainer, on the host: sampler output → `RolloutBatch` → packed trainer rows.

Everything here is numpy: the sampler's output is fetched to the host once (rlax.rollout.text.to_host),
decoded for grading (rlax.rollout.text) and packed here, and the trainer places the packed batch on
its mesh with one `device_put` — one host→device crossing per rollout.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from rlax.models import moe
from rlax.sampler import SampleOutput
from rlax.trainer.batch import TEACHER_FIELDS, PackedBatch, RolloutBatch, response_loss_mask, teacher_fields


def pack(out: SampleOutput, rewards: np.ndarray, prompt_len: int, forks=None) -> RolloutBatch:
  """Sampler output on the host (prompt-major rows) + rewards → the trainer's RolloutBatch, in numpy.

  tokens = [prompt left-padded to `prompt_len` | right-padded response], so every
  batch has the same static shape (no trainer recompiles, fixed checkpoint
  shapes); the behaviour log-prob of response token j sits at index P-1+j,
  where token_logprobs scores it. Tokens the policy did not sample (appended by `Stream.extend`) get loss
  mask 0. forks [B, N]: where a response starts a new segment (multi-turn episodes split into rows). Routes
  (MoE) ride along, laid out as the tokens."""
  prompt, pmask = np.asarray(out.prompt_tokens), np.asarray(out.prompt_mask)
  if prompt.shape[1] > prompt_len:
    raise ValueError(f"prompt bucket {prompt.shape[1]} exceeds the batch prompt length {prompt_len}")
  extra = prompt_len - prompt.shape[1]
  prompt = np.pad(prompt, ((0, 0), (extra, 0)))
  pmask = np.pad(pmask, ((0, 0), (extra, 0)))
  resp, lens = np.asarray(out.tokens), np.asarray(out.lengths)
  B, P = prompt.shape
  N = resp.shape[1]
  rmask = np.arange(N)[None, :] < lens[:, None]
  tokens = np.concatenate([prompt, np.where(rmask, resp, 0)], axis=1).astype(np.int32)
  input_mask = np.concatenate([pmask, rmask], axis=1)
  blp = np.zeros((B, P + N - 1), np.float32)
  blp[:, P - 1:] = np.where(rmask, np.asarray(out.logprobs), 0.0)
  versions = np.asarray(out.versions)
  row_version = np.where(rmask, versions, np.iinfo(np.int32).max).min(axis=1)
  row_version = np.where(lens > 0, row_version, out.version).astype(np.int32)
  loss_mask = response_loss_mask(input_mask, P)
  loss_mask[:, P - 1:] *= np.asarray(out.sampled) & rmask
  if forks is not None:
    forks = np.concatenate([np.zeros((B, P), np.int32), np.where(rmask, np.asarray(forks, np.int32), 0)], axis=1)
  routes = None if out.routes is None else np.pad(np.asarray(out.routes), ((0, 0), (extra, 0), (0, 0), (0, 0)),
                                                  constant_values=moe.NO_ROUTE)
  return RolloutBatch(tokens=tokens, input_mask=input_mask, loss_mask=loss_mask,
                      behaviour_logprobs=blp, rewards=np.asarray(rewards, np.float32), versions=row_version,
                      group_ids=np.asarray(out.prompt_ids, np.int32), forks=forks, routes=routes, prompt_len=P)


def _sequences(batch: RolloutBatch) -> list[tuple[np.ndarray, int, int]]:
  """(real prompt tokens, response start, response length) of every row; raises on a layout it cannot pack."""
  P = batch.prompt_len
  if P < 1:
    raise ValueError("packing needs RolloutBatch.prompt_len >= 1 (rows of [left-padded prompt | response])")
  tokens, mask = np.asarray(batch.tokens), np.asarray(batch.input_mask, bool)
  lm = np.asarray(batch.loss_mask)
  out = []
  for b in range(tokens.shape[0]):
    prompt = tokens[b, :P][mask[b, :P]]
    n = int(mask[b, P:].sum())
    if not mask[b, P:P + n].all():
      raise ValueError(f"row {b}: response tokens must be contiguous after the prompt (right padding only)")
    if len(prompt) == 0 and n:
      raise ValueError(f"row {b}: a response needs at least one prompt token to be scored from")
    if np.any(lm[b, P - 1 + n:]):
      raise ValueError(f"row {b}: loss_mask scores a position past the response")
    out.append((prompt, P, n))
  return out


def _pieces(batch: RolloutBatch, seqs, share: bool, row_len: int, slot_cap: int, inert: np.ndarray
            ) -> list[tuple[np.ndarray, list[int]]]:
  """Pieces of (prompt, member rows): one prompt, then the responses that attend to it, within row_len tokens
  and slot_cap scored slots; a piece's members are all `inert` or none."""
  groups: dict = {}
  for b, (prompt, _, n) in enumerate(seqs):
    if n == 0:
      continue  # nothing to score; its reward still counts in its group's advantages
    if len(prompt) + n > row_len:
      raise ValueError(f"a sequence of {len(prompt) + n} tokens ({len(prompt)} prompt + {n} response) does not "
                       f"fit a packed row of optimizer.pack_tokens={row_len}; raise it")
    key = (int(batch.group_ids[b]), prompt.tobytes(), bool(inert[b])) if share else b
    groups.setdefault(key, []).append(b)
  pieces = []
  for members in groups.values():
    prompt = seqs[members[0]][0]
    cur, used, scored = [], len(prompt), 0
    for b in members:
      n = seqs[b][2]
      if cur and (used + n > row_len or scored + n > slot_cap):
        pieces.append((prompt, cur))
        cur, used, scored = [], len(prompt), 0
      cur.append(b)
      used, scored = used + n, scored + n
    pieces.append((prompt, cur))
  return pieces


def slot_bucket(n: int, cap: int) -> int:
  """Scored slots a packed row is padded to: the next of 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (four
  steps an octave: at most 25% of the logits wasted, few compiles), at most `cap`."""
  if n <= 8:
    return min(cap, 8)
  top = 1 << (n - 1).bit_length()  # the power of two >= n
  step = top // 8
  return min(cap, -(-n // step) * step)


PACKED_OVERHEAD_RATIO = 0.9  # pack only when it saves more than this share of the padded batch's FLOPs


def row_bucket(n: int, multiple: int = 1) -> int:
  """Rows of a packed batch: n rounded up to a multiple of `multiple`, then the count of multiples to a
  quarter-octave step (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...): at most 25% padding rows, few
  compiles, and counts with many divisors for the micro-batch split."""
  units = -(-max(n, 1) // multiple)
  if units > 8:
    step = (1 << (units - 1).bit_length()) // 8
    units = -(-units // step) * step
  return units * multiple


def row_cost(cfg, rows: int, row_len: int) -> float:
  """Relative trainer FLOPs of `rows` packed rows of `row_len` tokens: matmuls + attention over the row."""
  return rows * row_len * (2.0 * cfg.layer_matmul_weights() + 4.0 * row_len * cfg.n_heads * cfg.head_dim)


@dataclasses.dataclass(frozen=True)
class PackedShape:
  """A fixed packed batch: `rows` rows of `length` tokens with `slots` scored slots each, real rows laid out at
  `order` (rlax.trainer.state.fill_order: whole micro-batches first). The resolved run decides them."""
  length: int
  rows: int
  slots: int
  order: tuple[int, ...] = ()


def _first_fit(pieces, seqs, row_len: int, slot_cap: int) -> tuple[list[list], list[int]]:
  """Rows of (prompt, members) holding `pieces` (first-fit decreasing) and the scored slots each row uses."""
  pieces = sorted(pieces, key=lambda pc: -(len(pc[0]) + sum(seqs[b][2] for b in pc[1])))
  rows: list[list] = []
  free: list[int] = []
  room: list[int] = []  # scored slots left
  n_of = lambda b: seqs[b][2]

  def place(r: int, prompt, members) -> None:
    rows[r].append((prompt, members))
    free[r] -= len(prompt) + sum(map(n_of, members))
    room[r] -= sum(map(n_of, members))

  for prompt, members in pieces:
    members = sorted(members, key=n_of, reverse=True)
    while members:
      size, n = len(prompt) + sum(map(n_of, members)), sum(map(n_of, members))
      r = next((i for i, (f, k) in enumerate(zip(free, room)) if f >= size and k >= n), None)
      if r is None and len(members) > 1:
        # The piece fits no row whole: the roomiest row that holds its prompt and a response takes what fits
        # (a prompt copy costs less than a new row, and the trainer computes whole rows).
        fits = lambda i: free[i] >= len(prompt) + n_of(members[-1]) and room[i] >= n_of(members[-1])
        r = max(filter(fits, range(len(rows))), key=lambda i: free[i], default=None)
        if r is not None:
          take, f, k = [], free[r] - len(prompt), room[r]
          for b in members:
            if n_of(b) <= min(f, k):
              take.append(b)
              f, k = f - n_of(b), k - n_of(b)
          place(r, prompt, take)
          members = [b for b in members if b not in take]
          continue
      if r is None:
        rows.append([])
        free.append(row_len)
        room.append(slot_cap)
        r = len(rows) - 1
      place(r, prompt, members)
      members = []
  return rows, [slot_cap - k for k in room]


def pack_tokens(batch: RolloutBatch, row_len: int | PackedShape, *, share_prompts: bool = True,
                row_multiple: int = 1, inert: np.ndarray | None = None) -> PackedBatch:
  """The padded numpy batch as rows of `row_len` real tokens (first-fit decreasing), on the host.

  With share_prompts, the responses of one group whose prompts are equal follow one copy of the prompt and
  attend to it (the same hidden states and gradients as separate copies, computed once). `row_len` a
  `PackedShape`: exactly its rows and slots (a row holds at most `slots` scored slots; ValueError if the batch
  needs more rows); an int: `row_bucket(rows, row_multiple)` rows and `slot_bucket` slots. Sequences with no
  response token get no slots. `inert` [B] bool: sequences that add nothing to the gradient (a tied group's),
  packed into rows of their own after the others; in a `PackedShape` they fill its order from the back, so
  they take whole micro-batches of their own, which the trainer skips. Raises ValueError naming the knob if a
  sequence does not fit."""
  fixed = row_len if isinstance(row_len, PackedShape) else None
  row_len = fixed.length if fixed else row_len
  slot_cap = fixed.slots if fixed else row_len
  batch.check()
  seqs = _sequences(batch)
  inert = np.zeros(batch.batch_size, bool) if inert is None else np.asarray(inert, bool)
  pieces = _pieces(batch, seqs, share_prompts, row_len, slot_cap, inert)
  live, idle = ([pc for pc in pieces if inert[pc[1][0]] == i] for i in (False, True))
  rows, used = _first_fit(live, seqs, row_len, slot_cap)
  idle_rows, idle_used = _first_fit(idle, seqs, row_len, slot_cap)
  if fixed:
    if len(rows) + len(idle_rows) > fixed.rows:
      raise ValueError(f"the batch packs into {len(rows) + len(idle_rows)} rows of {row_len} tokens; its program "
                       f"has {fixed.rows}")
    R, K, order = fixed.rows, fixed.slots, np.asarray(fixed.order or range(fixed.rows))
    at = np.concatenate([order[:len(rows)], order[::-1][:len(idle_rows)]]).astype(int)
  else:
    R = row_bucket(len(rows) + len(idle_rows), row_multiple)
    K = slot_bucket(max(used + idle_used + [1]), row_len)
    at = np.arange(R)
  rows += idle_rows
  B = batch.batch_size
  tok, lm = np.asarray(batch.tokens), np.asarray(batch.loss_mask, np.float32)
  forks = np.zeros(tok.shape, np.int32) if batch.forks is None else np.asarray(batch.forks)
  blp = np.asarray(batch.behaviour_logprobs, np.float32)
  per_tok = {"loss_mask": lm, "behaviour_logprobs": blp}
  for name in ("ref_logprobs", *TEACHER_FIELDS):
    if getattr(batch, name) is not None:
      per_tok[name] = np.asarray(getattr(batch, name))
  adv = None if batch.advantages is None else np.asarray(batch.advantages, np.float32)
  if adv is not None and adv.ndim == 2:
    per_tok["advantages"] = adv
  z = lambda shape, fill=0, d=np.int32: np.full(shape, fill, d)
  out = dict(tokens=z((R, row_len)), positions=z((R, row_len)), segment_ids=z((R, row_len)),
             parents=z((R, row_len)), score_index=z((R, K)), targets=z((R, K)), seq=z((R, K), B))
  routes = None if batch.routes is None else np.asarray(batch.routes)
  if routes is not None:
    out["routes"] = z((R, row_len, *routes.shape[2:]), moe.NO_ROUTE, routes.dtype)
  out.update({k: z((R, K, *a.shape[2:]), 0, a.dtype) for k, a in per_tok.items()})
  for q, row in enumerate(rows):
    r, o, k, sid = at[q], 0, 0, 0
    for prompt, members in row:
      p = len(prompt)
      sid += 1
      parent = sid
      out["tokens"][r, o:o + p], out["positions"][r, o:o + p], out["segment_ids"][r, o:o + p] = prompt, np.arange(p), sid
      if routes is not None:  # its first member's (left-padded) prompt routes: equal prompts route alike
        out["routes"][r, o:o + p] = routes[members[0], batch.prompt_len - p:batch.prompt_len]
      last, o = o + p - 1, o + p
      for b in members:
        _, P, n = seqs[b]
        sl, ks = slice(o, o + n), slice(k, k + n)
        out["tokens"][r, sl], out["targets"][r, ks], out["seq"][r, ks] = tok[b, P:P + n], tok[b, P:P + n], b
        if routes is not None:
          out["routes"][r, sl] = routes[b, P:P + n]
        # Segments of the response: the first after the prompt, then one per fork (a new row of an episode
        # after the prompt, or alone); a segment's first token is scored from the prompt's last (alone: from
        # itself, an unscored appended token).
        cuts = [0] + [int(j) for j in np.flatnonzero(forks[b, P + 1:P + n]) + 1] + [n]
        for a, z in zip(cuts[:-1], cuts[1:]):
          sid += 1
          alone = a > 0 and forks[b, P + a] == 2
          out["segment_ids"][r, o + a:o + z], out["parents"][r, o + a:o + z] = sid, 0 if alone else parent
          out["positions"][r, o + a:o + z] = (0 if alone else p) + np.arange(z - a)
          first = o + a if alone else last
          out["score_index"][r, k + a:k + z] = np.concatenate([[first], np.arange(o + a, o + z - 1)])
        for name, a in per_tok.items():
          out[name][r, ks] = a[b, P - 1:P - 1 + n]
        o, k = o + n, k + n
  if adv is not None and adv.ndim == 2:
    adv = out.pop("advantages")
  return PackedBatch(**out, rewards=np.asarray(batch.rewards, np.float32), versions=np.asarray(batch.versions, np.int32),
                     group_ids=np.asarray(batch.group_ids, np.int32), advantages=adv,
                     max_len=batch.tokens.shape[1] - batch.prompt_len)


def auto_row_lens(cfg, prompt_len: int, new_tokens: int, group: int, share_prompts: bool) -> tuple[int, ...]:
  """The packed row length of a run: the padded row (prompt_len + new_tokens) or, when prompts are shared, room
  for a whole group (one prompt + its G responses, rounded to 128) as long as attending over the row costs at
  most a quarter of a token's matmul FLOPs (4 L H Dh <= 2 N_layer / 4). One length: one program."""
  seq = prompt_len + new_tokens
  if not share_prompts:
    return (seq,)
  whole = -(-(prompt_len + group * new_tokens) // 128) * 128
  cap = cfg.layer_matmul_weights() // (8 * cfg.n_heads * cfg.head_dim) // 128 * 128
  return (max(seq, min(whole, cap)),)


def slot_cap(length: int, prompt_len: int, new_tokens: int, group: int, share_prompts: bool) -> int:
  """Scored slots a packed row of `length` tokens holds at most: the responses of the full-length sequences
  that fit (with shared prompts, of the whole groups that fit), at least one response, in a slot bucket."""
  seq = prompt_len + new_tokens
  n = new_tokens * max(1, length // seq)
  if share_prompts:
    n = max(n, group * new_tokens * (length // (prompt_len + group * new_tokens)))
  return slot_bucket(min(length - 1, n), length)


def rows_run(packed: PackedBatch, micro_batches: int, inert: np.ndarray | None = None) -> int:
  """Rows the trainer computes for `packed`: those of its micro-batches (strided, rlax.trainer.state) that hold
  a sequence not `inert` ([B] bool, as for `pack_tokens`); the others are skipped. One micro-batch always runs
  (rlax.trainer.state.accumulate_gradients)."""
  R, B = packed.tokens.shape[0], packed.batch_size
  if micro_batches == 1:
    return R
  seq = np.asarray(packed.seq)
  scored = seq < B
  if inert is not None:
    scored &= ~np.append(np.asarray(inert, bool), True)[np.minimum(seq, B)]
  live = scored.any(1)
  return R // micro_batches * int(sum(live[j::micro_batches].any() for j in range(micro_batches)))


def is_split(batch: RolloutBatch) -> bool:
  """Whether an episode of `batch` is split into rows (forks): such a batch is computed in packed rows. Callers:
  `for_trainer`, rlax.teachers.Teacher.logprobs."""
  return batch.forks is not None and bool(np.any(np.asarray(batch.forks)))


def for_trainer(batch: RolloutBatch, trainer, row_lens, share_prompts: bool = True, padded: bool = True,
                inert: np.ndarray | None = None):
  """The rollout as `trainer` computes it: packed rows of the length in `row_lens` that costs the fewest FLOPs
  for this batch (`row_cost` of the rows that run), or with `padded` the padded batch as is when packing saves
  too little. `row_lens`: ints (rows in row buckets, sized per batch), or the resolved run's `PackedShape`s
  (exactly those shapes: no new program); 0 or (): padded. `inert` [B] bool: sequences that add nothing to the
  gradient, packed apart so that their micro-batches are skipped (`pack_tokens`)."""
  lens = (row_lens,) if isinstance(row_lens, (int, PackedShape)) else tuple(row_lens)
  lens = tuple(n for n in lens if n)
  split = is_split(batch)
  if not split:
    batch = batch.replace(forks=None)
  if not lens:
    if split:
      raise ValueError("episodes split into rows (a template that is not append-only) train in packed rows; "
                       "set optimizer.pack_tokens")
    return batch
  cost = lambda p: row_cost(trainer.model_cfg, rows_run(p, trainer.num_micro_batches(*p.tokens.shape), inert),
                            p.tokens.shape[1])
  best = min((pack_tokens(batch, n, share_prompts=share_prompts, row_multiple=trainer.packed_rows_multiple(),
                          inert=inert) for n in lens), key=cost)
  if split or not padded:
    return best
  # At equal FLOPs packed rows run ~10% slower on CPU (no prompt skip in the last layer, segment masks, the
  # slot gather: W2 3.64 vs 3.30 s): a batch with nothing to drop (fixed lengths, no shared prompt) stays padded.
  if cost(best) > PACKED_OVERHEAD_RATIO * row_cost(trainer.model_cfg, *batch.tokens.shape):
    return batch
  return best


def unpack_slots(values: np.ndarray, packed: PackedBatch, like: RolloutBatch) -> np.ndarray:
  """Scored-slot values [R, K, ...] of `packed` back at their places [B, T-1, ...] of the padded batch `like`."""
  values, seq = np.asarray(values), np.asarray(packed.seq)
  B, T = like.tokens.shape
  out = np.zeros((B, T - 1, *values.shape[2:]), values.dtype)
  seen = np.zeros(B, np.int64)
  for r, k in zip(*np.nonzero(seq < B)):
    b = seq[r, k]
    out[b, like.prompt_len - 1 + seen[b]] = values[r, k]
    seen[b] += 1
  return out


def take_rows(batch: RolloutBatch, rows: np.ndarray) -> RolloutBatch:
  """The batch restricted to `rows` (numpy indices), same prompt_len."""
  return jax.tree.map(lambda x: x[rows], batch)


def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
  """Row-wise concatenation of numpy batches with the same prompt_len."""
  return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


def empty_batch(batch: int, prompt_len: int, new_tokens: int, forks: bool = False,
                routes: tuple[int, int] | None = None, teacher: bool = False, teacher_top_k: int = 0) -> RolloutBatch:
  """An all-zero numpy RolloutBatch of the static shape `pack` produces (a checkpoint restore template);
  forks: with the field episodes fill; routes: (layers, top_k) of a model that replays them; teacher /
  teacher_top_k: with a teacher's fields (a distilling run's, rlax.trainer.batch.teacher_fields)."""
  T = prompt_len + new_tokens
  z = lambda *s, d=np.float32: np.zeros(s, d)
  return RolloutBatch(**teacher_fields(np.zeros, (batch, T - 1), teacher, teacher_top_k),
                      tokens=z(batch, T, d=np.int32), input_mask=z(batch, T, d=bool), loss_mask=z(batch, T - 1),
                      behaviour_logprobs=z(batch, T - 1), rewards=z(batch), versions=z(batch, d=np.int32),
                      group_ids=z(batch, d=np.int32), forks=z(batch, T, d=np.int32) if forks else None,
                      routes=z(batch, T, *routes, d=np.uint8) if routes else None, prompt_len=prompt_len)
