"""The batch structures the sampler fills, the controller queues and the trainer consumes.

Layout of one row (T = prompt + response slots):

    tokens      [pad pad p0 p1 p2 | r0 r1 r2 pad]    prompt LEFT-padded, response RIGHT-padded
    input_mask  [ 0   0  1  1  1  |  1  1  1   0 ]   real tokens
    loss_mask      [ 0  0  0  0  1  1  1   0 ]       length T-1: index t scores tokens[t+1], so the
                                                     1s sit one to the left of the response tokens

`loss_mask`, `behaviour_logprobs` and `ref_logprobs` are [B, T-1] and aligned
with `rlax.models.token_logprobs` (whose index t is log p(tokens[t+1] | tokens[:t+1])).
Rows are P prompt groups of G contiguous samples (rlax.algorithms convention).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# The dtype of every batch field: `check` enforces them, so that the program the planner lowers from
# `RolloutBatch.abstract` is the one the runtime runs (a new dtype would be a new compile).
_DTYPES = {"tokens": jnp.int32, "input_mask": jnp.bool_, "loss_mask": jnp.float32,
           "behaviour_logprobs": jnp.float32, "rewards": jnp.float32, "versions": jnp.int32,
           "group_ids": jnp.int32, "ref_logprobs": jnp.float32, "advantages": jnp.float32,
           "positions": jnp.int32, "segment_ids": jnp.int32, "parents": jnp.int32, "score_index": jnp.int32,
           "targets": jnp.int32, "seq": jnp.int32, "forks": jnp.int32, "routes": jnp.uint8,
           "teacher_logprobs": jnp.float32, "teacher_top_ids": jnp.int32, "teacher_top_logprobs": jnp.float32}
# A teacher's scores of each scored slot: its log-prob of the sampled token, then (top-k forward KL) its k most
# likely ids and their log-probs.
TEACHER_FIELDS = ("teacher_logprobs", "teacher_top_ids", "teacher_top_logprobs")


def teacher_fields(make, per_slot: tuple, with_teacher: bool, top_k: int) -> dict:
  """The teacher's batch fields, make(shape, dtype) each: its log-probs per slot when `with_teacher`, and with
  `top_k` its top-k ids and log-probs [*per_slot, top_k]; None where absent. Callers: the batches' `abstract`,
  rlax.rollout.packing.empty_batch."""
  shapes = {TEACHER_FIELDS[0]: per_slot} if with_teacher else {}
  if with_teacher and top_k:
    shapes.update({n: (*per_slot, top_k) for n in TEACHER_FIELDS[1:]})
  return {n: make(shapes[n], _DTYPES[n]) if n in shapes else None for n in TEACHER_FIELDS}


def _check_dtype(kind: str, name: str, x) -> None:
  if jnp.dtype(x.dtype) != jnp.dtype(_DTYPES[name]):
    raise ValueError(f"{kind}.{name} has dtype {jnp.dtype(x.dtype).name}, expected {jnp.dtype(_DTYPES[name]).name}")


def _check_fields(batch, want: dict, per_slot: tuple, seqs: int, suffix: str = "") -> None:
  """Shapes and dtypes of `want`'s fields, of ref_logprobs and the teacher's (per slot; its top-k [*per_slot, k]),
  of routes (per token: [rows, length, L, k]) and of advantages ([seqs] or per slot)."""
  kind = type(batch).__name__
  for name in ("ref_logprobs", "teacher_logprobs"):
    if getattr(batch, name) is not None:
      want = {**want, name: per_slot}
  if (batch.teacher_top_ids is None) != (batch.teacher_top_logprobs is None):
    raise ValueError(f"{kind}.teacher_top_ids and teacher_top_logprobs come together")
  if batch.teacher_top_ids is not None:
    k = batch.teacher_top_ids.shape[-1]
    want = {**want, "teacher_top_ids": (*per_slot, k), "teacher_top_logprobs": (*per_slot, k)}
  if batch.routes is not None:
    if batch.routes.ndim != 4:
      raise ValueError(f"{kind}.routes must be [rows, length, layers, top_k], got shape {batch.routes.shape}")
    want = {**want, "routes": tuple(batch.tokens.shape) + tuple(batch.routes.shape[2:])}
  for name, shape in want.items():
    got = tuple(getattr(batch, name).shape)
    if got != shape:
      raise ValueError(f"{kind}.{name} has shape {got}, expected {shape}{suffix}")
    _check_dtype(kind, name, getattr(batch, name))
  if batch.advantages is not None:
    if tuple(batch.advantages.shape) not in ((seqs,), per_slot):
      raise ValueError(f"{kind}.advantages has shape {batch.advantages.shape}, expected {(seqs,)} or {per_slot}")
    _check_dtype(kind, "advantages", batch.advantages)


@flax.struct.dataclass
class RolloutBatch:
  """One RL batch of B sequences of T tokens (see module doc for the layout).

  tokens [B,T] int32; input_mask [B,T] bool; loss_mask [B,T-1] f32 (1 on scored
  response tokens); behaviour_logprobs [B,T-1] f32 (the sampler's, at its
  temperature); ref_logprobs [B,T-1] or None (fill with Trainer.ref_logprobs);
  rewards [B] f32; advantages [B] or [B,T-1] or None (None: the trainer computes
  them from rewards with the algorithm's estimator); versions [B] int32 (weight
  version that sampled each row); group_ids [B] int32 (prompt id of each row);
  prompt_len (static): P when the first P slots of every row are prompt, so
  that loss_mask[:, :P-1] is 0 and the trainer skips the logits and last-layer
  MLP there (0: unknown, score every position). forks [B,T] int32 or None:
  nonzero where a response slot starts a new attention segment of its
  sequence (a multi-turn episode split into rows, rlax.envs.episodes: 1 after
  the prompt, 2 alone); such a batch trains packed (rlax.rollout.packing).
  routes [B,T,L,k] uint8 or None: the experts the sampler sent each token to
  in each layer, which the trainer's forwards replay (rlax.models.moe;
  NO_ROUTE: route afresh). teacher_logprobs [B,T-1] or None: a teacher's
  log-probs of the sampled tokens, on loss_mask slots (on-policy distillation,
  rlax.teachers; 0 elsewhere); teacher_top_ids / teacher_top_logprobs
  [B,T-1,k] or None: its k most likely tokens at each such slot and their
  log-probs (top-k forward KL).
  """
  tokens: jax.Array
  input_mask: jax.Array
  loss_mask: jax.Array
  behaviour_logprobs: jax.Array
  rewards: jax.Array
  versions: jax.Array
  group_ids: jax.Array
  ref_logprobs: Optional[jax.Array] = None
  advantages: Optional[jax.Array] = None
  forks: Optional[jax.Array] = None
  routes: Optional[jax.Array] = None
  teacher_logprobs: Optional[jax.Array] = None
  teacher_top_ids: Optional[jax.Array] = None
  teacher_top_logprobs: Optional[jax.Array] = None
  prompt_len: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @classmethod
  def abstract(cls, rows: int, seq: int, *, with_ref: bool = False, prompt_len: int = 0,
               routes: Optional[tuple[int, int]] = None, with_teacher: bool = False, teacher_top_k: int = 0
               ) -> "RolloutBatch":
    """A batch of unsharded ShapeDtypeStructs: tokens [rows, seq] and the rest as in the class doc; routes:
    (layers, top_k) of a model that replays them (rlax.models.moe.replayed_routes), else None; with_teacher /
    teacher_top_k: the teacher's fields (`teacher_fields`)."""
    s = lambda name, *shape: jax.ShapeDtypeStruct(shape, _DTYPES[name])
    return cls(**teacher_fields(jax.ShapeDtypeStruct, (rows, seq - 1), with_teacher, teacher_top_k),
               tokens=s("tokens", rows, seq), input_mask=s("input_mask", rows, seq),
               loss_mask=s("loss_mask", rows, seq - 1), behaviour_logprobs=s("behaviour_logprobs", rows, seq - 1),
               rewards=s("rewards", rows), versions=s("versions", rows), group_ids=s("group_ids", rows),
               ref_logprobs=s("ref_logprobs", rows, seq - 1) if with_ref else None,
               routes=s("routes", rows, seq, *routes) if routes else None, prompt_len=prompt_len)

  def check(self, group_size: Optional[int] = None) -> "RolloutBatch":
    """Raises ValueError naming the first field whose shape, dtype or prompt masking is wrong; returns self.

    Shapes and dtypes are checked always; values only when the arrays are on the host (numpy), so a
    batch already on devices is never pulled back.
    """
    if self.tokens.ndim != 2:
      raise ValueError(f"RolloutBatch.tokens must be [B, T], got shape {self.tokens.shape}")
    B, T = self.tokens.shape
    if T < 2:
      raise ValueError(f"RolloutBatch.tokens needs T >= 2 (one scored token), got T={T}")
    want = {"tokens": (B, T), "input_mask": (B, T), "loss_mask": (B, T - 1), "behaviour_logprobs": (B, T - 1),
            "rewards": (B,), "versions": (B,), "group_ids": (B,)}
    if self.forks is not None:
      want["forks"] = (B, T)
    _check_fields(self, want, (B, T - 1), B, suffix=f" for tokens {(B, T)}")
    if not 0 <= self.prompt_len < T:
      raise ValueError(f"RolloutBatch.prompt_len={self.prompt_len} must be in [0, {T}) for tokens {(B, T)}")
    if (self.prompt_len > 1 and isinstance(self.loss_mask, np.ndarray)
        and np.any(self.loss_mask[:, :self.prompt_len - 1])):
      raise ValueError(f"RolloutBatch.loss_mask scores a position before prompt_len={self.prompt_len}")
    if group_size is not None and (group_size < 1 or B % group_size):
      raise ValueError(f"batch of {B} rows is not a whole number of groups of group_size={group_size}")
    return self


@flax.struct.dataclass
class PackedBatch:
  """A RolloutBatch packed into R rows of L tokens (rlax.rollout.packing.pack_tokens): only real tokens.

  Model inputs [R, L]: tokens, positions (restarting at 0 in each sequence), segment_ids (1.. per piece
  of a row, 0 on padding) and parents (the segment a response continues: its prompt, shared by the
  responses of one group; 0 for none). Token t attends to tokens s <= t of its segment or its parent's.
  Scored slots [R, K]: score_index (the row position whose hidden state predicts the slot's token),
  targets (that token), seq (the sequence 0..B-1 of the slot; B on padding), loss_mask,
  behaviour_logprobs, ref_logprobs and the teacher's fields (or None; top-k [R, K, k]). Per sequence [B]:
  rewards, versions, group_ids (prompt-major
  as in RolloutBatch); advantages [B], [R, K] or None. routes [R, L, layers, k] or None: each row token's
  replayed experts (RolloutBatch.routes). max_len (static): the response budget (T - prompt length of the
  padded batch), Dr. GRPO's default normalizer.
  """
  tokens: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  parents: jax.Array
  score_index: jax.Array
  targets: jax.Array
  seq: jax.Array
  loss_mask: jax.Array
  behaviour_logprobs: jax.Array
  rewards: jax.Array
  versions: jax.Array
  group_ids: jax.Array
  ref_logprobs: Optional[jax.Array] = None
  advantages: Optional[jax.Array] = None
  routes: Optional[jax.Array] = None
  teacher_logprobs: Optional[jax.Array] = None
  teacher_top_ids: Optional[jax.Array] = None
  teacher_top_logprobs: Optional[jax.Array] = None
  max_len: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def batch_size(self) -> int:
    """Sequences (rows of the padded batch it came from)."""
    return self.rewards.shape[0]

  @classmethod
  def abstract(cls, rows: int, length: int, slots: int, seqs: int, *, with_ref: bool = False,
               max_len: int = 1, routes: Optional[tuple[int, int]] = None, with_teacher: bool = False,
               teacher_top_k: int = 0) -> "PackedBatch":
    """ShapeDtypeStructs of a batch of `rows` x `length` tokens, `slots` scored slots a row, `seqs` sequences;
    routes as in `RolloutBatch.abstract`."""
    s = lambda name, *shape: jax.ShapeDtypeStruct(shape, _DTYPES[name])
    row = {n: s(n, rows, length) for n in ("tokens", "positions", "segment_ids", "parents")}
    slot = {n: s(n, rows, slots) for n in ("score_index", "targets", "seq", "loss_mask", "behaviour_logprobs")}
    return cls(**row, **slot, **teacher_fields(jax.ShapeDtypeStruct, (rows, slots), with_teacher, teacher_top_k),
               rewards=s("rewards", seqs), versions=s("versions", seqs),
               group_ids=s("group_ids", seqs), ref_logprobs=s("ref_logprobs", rows, slots) if with_ref else None,
               routes=s("routes", rows, length, *routes) if routes else None, max_len=max_len)

  def check(self, group_size: Optional[int] = None) -> "PackedBatch":
    """Raises ValueError naming the first field whose shape or dtype is wrong; returns self."""
    R, L = self.tokens.shape if self.tokens.ndim == 2 else (0, 0)
    if self.tokens.ndim != 2 or self.score_index.ndim != 2:
      raise ValueError(f"PackedBatch.tokens and score_index must be 2-D, got {self.tokens.shape}, "
                       f"{self.score_index.shape}")
    K, B = self.score_index.shape[1], self.rewards.shape[0]
    want = {"tokens": (R, L), "positions": (R, L), "segment_ids": (R, L), "parents": (R, L),
            "score_index": (R, K), "targets": (R, K), "seq": (R, K), "loss_mask": (R, K),
            "behaviour_logprobs": (R, K), "rewards": (B,), "versions": (B,), "group_ids": (B,)}
    _check_fields(self, want, (R, K), B)
    if group_size is not None and (group_size < 1 or B % group_size):
      raise ValueError(f"batch of {B} sequences is not a whole number of groups of group_size={group_size}")
    return self


@flax.struct.dataclass
class SFTBatch:
  """Supervised batch: tokens [B,T] int32, input_mask [B,T] bool, loss_mask [B,T-1] (1 on target tokens)."""
  tokens: jax.Array
  input_mask: jax.Array
  loss_mask: jax.Array

  def check(self) -> "SFTBatch":
    """Raises ValueError naming the first field whose shape or dtype is wrong; returns self."""
    if self.tokens.ndim != 2 or self.tokens.shape[1] < 2:
      raise ValueError(f"SFTBatch.tokens must be [B, T] with T >= 2, got shape {self.tokens.shape}")
    B, T = self.tokens.shape
    for name, shape in {"tokens": (B, T), "input_mask": (B, T), "loss_mask": (B, T - 1)}.items():
      if tuple(getattr(self, name).shape) != shape:
        raise ValueError(f"SFTBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")
      _check_dtype("SFTBatch", name, getattr(self, name))
    return self


def response_loss_mask(input_mask, prompt_len: int) -> np.ndarray:
  """loss_mask [B, T-1] for rows whose first `prompt_len` slots are the (left-padded) prompt.

  Scores every real token after the prompt: loss_mask[:, t] = input_mask[:, t+1] for t+1 >= prompt_len.
  """
  m = np.asarray(input_mask, np.float32)[:, 1:].copy()
  m[:, : max(prompt_len - 1, 0)] = 0.0
  return m
