"""Loss aggregation over tokens and sequences: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm.

With gradient accumulation the micro-batch losses must add up to the full-batch
loss, so every mode takes optional global denominators (`num_tokens`,
`num_seqs`, `num_rows`) counted over the whole batch; left as None they are counted from
the arrays given (one micro-batch == the whole batch).
"""

from __future__ import annotations

from typing import Optional

import chex
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlax.algorithms.segments import Segments

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def denominators(mask: Float[Array, "B T"], segments: Segments = Segments()
                 ) -> tuple[Float[Array, ""], Float[Array, ""]]:
  """(number of unmasked tokens, number of sequences with at least one unmasked token), both f32 scalars."""
  m = mask.astype(jnp.float32)
  return jnp.sum(m), segments.count(m)


def aggregate(values: Float[Array, "B T"], mask: Float[Array, "B T"], mode: str, *,
              num_tokens: Optional[Float[Array, ""]] = None, num_seqs: Optional[Float[Array, ""]] = None,
              num_rows: Optional[int] = None, max_len: Optional[int] = None,
              segments: Segments = Segments()) -> Float[Array, ""]:
  """Reduces per-token values [B, T] to a scalar.

  - token_mean (DAPO, arXiv 2503.14476): sum(v m) / sum(m) — every token weighs the same.
  - seq_mean_token_mean (GRPO, arXiv 2402.03300): mean over sequences of sum_t(v m) / sum_t(m);
    rows with no unmasked token are left out of the mean.
  - seq_mean_token_sum_norm (Dr. GRPO, arXiv 2503.20783): sum(v m) / (B * max_len), a constant
    normalizer (max_len defaults to T) so that long answers are not down-weighted.
  Denominators are clamped at 1, so a fully masked batch gives 0, not NaN. `segments`: which sequence each
  slot is (a packed batch: pass num_rows and max_len, which its shape does not tell).
  """
  chex.assert_rank([values, mask], 2)
  chex.assert_equal_shape([values, mask])
  m = mask.astype(jnp.float32)
  v = values * m
  if segments.packed and (num_rows is None or max_len is None):
    raise ValueError("aggregate: a packed batch needs num_rows (its sequences) and max_len (the response budget)")
  tok, seqs = denominators(m, segments)
  if mode == "token_mean":
    n = tok if num_tokens is None else num_tokens
    return jnp.sum(v) / jnp.maximum(n, 1.0)
  if mode == "seq_mean_token_mean":
    n = seqs if num_seqs is None else num_seqs
    per_seq = segments.sum(v) / jnp.maximum(segments.sum(m), 1.0)
    return jnp.sum(per_seq) / jnp.maximum(n, 1.0)
  if mode == "seq_mean_token_sum_norm":
    rows = values.shape[0] if num_rows is None else num_rows
    return jnp.sum(v) / (jnp.maximum(rows, 1) * (max_len or values.shape[1]))
  raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(AGG_MODES)}")
