"""Which sequence each per-token slot belongs to, and the per-sequence reductions the objectives need.

Every per-token array of an objective is [R, S]. In the padded layout a row is one sequence
(`Segments.rows()`); in a packed batch (rlax.rollout.packing) a row holds the scored slots of several
sequences, each contiguous and in order, and `ids` [R, S] names the sequence of each slot (0..n-1; n
on padding slots). Sequence-level math (GSPO's ratio, sequence IS weights, per-sequence means, KL to
go, GAE's recursion, the reward on the last token) is written once against these methods.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Segments:
  """ids [R, S] int32 (None: row r is sequence r) and n, the number of sequences (static)."""
  ids: Optional[jax.Array] = None
  n: int = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def rows(cls) -> "Segments":
    return cls(None, 0)

  @property
  def packed(self) -> bool:
    return self.ids is not None

  def sum(self, x: jax.Array) -> jax.Array:
    """Per-sequence sums of x [R, S]: [R] (rows) or [n] (packed; padding slots dropped)."""
    if not self.packed:
      return jnp.sum(x, axis=1)
    return jax.ops.segment_sum(x.reshape(-1), self.ids.reshape(-1), num_segments=self.n + 1)[:self.n]

  def spread(self, v: jax.Array, like: jax.Array) -> jax.Array:
    """Per-sequence values v ([R] or [n]) on every slot of their sequence, shaped like `like` [R, S]."""
    if not self.packed:
      return jnp.broadcast_to(v[:, None], like.shape)
    return jnp.concatenate([v, jnp.zeros((1,), v.dtype)])[self.ids]

  def reverse_cumsum(self, x: jax.Array) -> jax.Array:
    """sum_{i >= t, same sequence} x_i for every slot t."""
    if not self.packed:
      return jnp.flip(jnp.cumsum(jnp.flip(x, 1), axis=1), 1)
    # Slots of a sequence are contiguous in one row: from the row's reverse cumsum, subtract what lies after
    # the sequence, which is the row's reverse cumsum at the first slot past the sequence's last.
    rev = jnp.flip(jnp.cumsum(jnp.flip(x, 1), axis=1), 1)
    after = jnp.concatenate([rev[:, 1:], jnp.zeros_like(rev[:, :1])], axis=1)
    last = self.is_last()
    tail = jnp.where(last, after, 0.0)  # the amount after each sequence, on its last slot
    return rev - self.spread(self.sum(tail), x)

  def continues(self) -> jax.Array:
    """[R, S] bool: slot t+1 belongs to the same sequence as slot t (False on each row's last slot)."""
    if not self.packed:
      return jnp.ones((1, 1), bool)
    nxt = jnp.concatenate([self.ids[:, 1:], jnp.full_like(self.ids[:, :1], self.n)], axis=1)
    return (nxt == self.ids) & (self.ids < self.n)

  def is_last(self) -> jax.Array:
    """[R, S] bool: the slot is the last of its sequence (packed layout only)."""
    return (self.ids < self.n) & ~self.continues()

  def count(self, mask: jax.Array) -> jax.Array:
    """Number of sequences with at least one unmasked slot (f32 scalar)."""
    return jnp.sum((self.sum(mask.astype(jnp.float32)) > 0).astype(jnp.float32))

  def last_masked(self, mask: jax.Array) -> jax.Array:
    """[R, S] bool: the slot is the last one with mask > 0 of its sequence."""
    m = mask > 0
    if not self.packed:
      idx = jnp.arange(m.shape[1])
      last = jnp.max(jnp.where(m, idx, -1), axis=1)
      return idx[None] == last[:, None]
    flat = jnp.arange(m.size, dtype=jnp.int32).reshape(m.shape)
    last = jax.ops.segment_max(jnp.where(m, flat, -1).reshape(-1), self.ids.reshape(-1), num_segments=self.n + 1)
    return m & (flat == jnp.concatenate([last[:self.n], jnp.full((1,), -2, last.dtype)])[self.ids])
