"""The trainer's two batch layouts: padded rows (`RolloutBatch`) and packed rows (`PackedBatch`).

Both hand the objective per-slot arrays [rows, S] and the `Segments` that say which sequence each slot
belongs to; the model runs once here for either, and the log-prob and value heads see only the hidden
states of scored slots. Padded: S = T - 1 (slot t scores token t+1; slots before `start` are 0 and not
computed). Packed: S = K scored slots a row, gathered from the rows' hidden states by `score_index`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from rlax import algorithms
from rlax import models
from rlax.trainer.batch import PackedBatch, RolloutBatch, SFTBatch

_PADDED = ("tokens", "input_mask")
_PACKED = ("tokens", "positions", "segment_ids", "parents", "score_index", "targets", "seq")


@dataclasses.dataclass(frozen=True)
class Layout:
  """packed: which layout; start: the padded layout's first computed slot; seqs: sequences of a packed batch;
  max_len: the response budget (Dr. GRPO's default normalizer)."""
  packed: bool
  start: int = 0
  seqs: int = 0
  max_len: int = 0

  def inputs(self, batch) -> dict:
    """The per-row arrays the forward needs (split into micro-batches with the rest of the loss inputs): with a
    MoE rollout's recorded experts (`routes`) when it carries them."""
    x = {k: getattr(batch, k) for k in (_PACKED if self.packed else _PADDED)}
    if getattr(batch, "routes", None) is not None:
      x["routes"] = batch.routes
    return x

  def hidden(self, params, cfg: models.ModelConfig, x: dict, router_stats: bool = False) -> tuple:
    """Final-normed hidden states of the scored slots [rows, S', D] and their target tokens [rows, S'], and with
    `router_stats` the forward's rlax.models.moe.RouterStats; every forward (policy, reference, critic) replays
    the batch's routes."""
    kw = dict(routes=x.get("routes"), router_stats=router_stats)
    if self.packed:
      h, _, *stats = models.hidden_states(params, cfg, x["tokens"], positions=x["positions"],
                                          segment_ids=x["segment_ids"], parents=x["parents"], **kw)
      return (jnp.take_along_axis(h, x["score_index"][..., None], axis=1), x["targets"], *stats)
    h, _, *stats = models.hidden_states(params, cfg, x["tokens"], input_mask=x["input_mask"].astype(bool),
                                        start=self.start, **kw)
    return (h[:, :-1], x["tokens"][:, self.start + 1:], *stats)

  def per_slot(self, head: Callable, params, cfg: models.ModelConfig, x: dict, router_stats: bool = False):
    """head(hidden [rows, S', D], targets [rows, S']) -> tuple of [rows, S', ...] arrays, placed on all S slots;
    with `router_stats` the forward's RouterStats follow them."""
    h, t, *stats = self.hidden(params, cfg, x, router_stats)
    outs = head(h, t)
    if not self.packed and self.start:
      outs = tuple(jnp.pad(o, ((0, 0), (self.start, 0)) + ((0, 0),) * (o.ndim - 2)) for o in outs)
    return (*outs, *stats)

  def logprobs(self, params, cfg: models.ModelConfig, x: dict, *, chunk: int, temperature: float,
               with_entropy: bool = False, router_stats: bool = False, top_k: int = 0, top_vocab: int = 0,
               at=None):
    """Log-prob of each slot's token ([rows, S] f32), then entropies when `with_entropy`, then with `top_k` the
    slot's k most likely ids and their log-probs (among the first `top_vocab`), then with `at` ([rows, S, k] ids
    per slot) their log-probs, then the forward's RouterStats when `router_stats` (a lone log-prob array when
    none of these). See rlax.models.logprobs_from_hidden."""
    w = models.lm_head(params, cfg)

    def head(h, t):
      ids = None if at is None else at[:, self.start:] if not self.packed else at
      out = models.logprobs_from_hidden(h, w, t, temperature=temperature, chunk=chunk, with_entropy=with_entropy,
                                        top_k=top_k, top_vocab=top_vocab, at=ids)
      return out if isinstance(out, tuple) else (out,)

    out = self.per_slot(head, params, cfg, x, router_stats)
    return out if len(out) > 1 else out[0]

  def values(self, critic: dict, cfg: models.ModelConfig, x: dict) -> jax.Array:
    """PPO's value head on every slot ([rows, S] f32): V(tokens up to the slot)."""
    head = lambda h, _: (jnp.einsum("btd,d->bt", h.astype(jnp.float32), critic["head"]["w"]) + critic["head"]["b"],)
    return self.per_slot(head, critic["trunk"], cfg, x)[0]

  def has_tokens(self, x: dict) -> jax.Array:
    """[] bool: whether rows `x` (a micro-batch's inputs) hold any sequence (empty ones are skipped)."""
    return jnp.any(x["seq"] < self.seqs) if self.packed else jnp.any(x["input_mask"])

  def input_tokens(self, x: dict) -> jax.Array:
    """[] f32: the real tokens rows `x` feed the model (padding left out), what a MoE's router statistics are
    over (rlax.models.hidden_states)."""
    real = x["segment_ids"] > 0 if self.packed else x["input_mask"]
    return jnp.sum(real.astype(jnp.float32))

  def segments(self, x: dict) -> algorithms.Segments:
    """Which sequence each slot of `x` (a batch's or a micro-batch's inputs) belongs to."""
    return algorithms.Segments(x["seq"], self.seqs) if self.packed else algorithms.Segments.rows()


def of(batch) -> Layout:
  """The layout of a RolloutBatch, SFTBatch or PackedBatch (arrays or ShapeDtypeStructs)."""
  if isinstance(batch, PackedBatch):
    return Layout(packed=True, seqs=batch.batch_size, max_len=batch.max_len)
  if isinstance(batch, (RolloutBatch, SFTBatch)):
    return padded(getattr(batch, "prompt_len", 0), batch.tokens.shape[1])
  raise TypeError(f"not a trainer batch: {type(batch).__name__}")


def padded(prompt_len: int, length: int) -> Layout:
  """The padded layout of rows of `length` tokens whose first `prompt_len` are prompt (0: unknown). Callers:
  `of`, rlax.teachers.Teacher.lower."""
  start = max(prompt_len - 1, 0)
  return Layout(packed=False, start=start, max_len=length - 1 - start)
