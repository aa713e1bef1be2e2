"""Prompts on the host: token lists checked and laid into static [n, length] arrays, and the buckets that keep
shapes static (a new row count inside a bucket reuses the compiled programs)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def pow_buckets(lo: int, hi: int, factor: int) -> tuple[int, ...]:
  """lo, factor lo, factor^2 lo, ... below hi, then hi."""
  out, b = [], max(1, lo)
  while b < hi:
    out.append(b)
    b *= factor
  return tuple(out) + (hi,)


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
  """lo, 2 lo, 4 lo, ... below hi, then hi."""
  return pow_buckets(lo, hi, 2)


def bucket(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= n (ValueError past the largest)."""
  for b in buckets:
    if b >= n:
      return b
  raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def token_rows(prompts, mask=None) -> list[np.ndarray]:
  """prompts: token-id lists, or a [n, L] array (+ mask [n, L]) → one 1-D int64 array per prompt."""
  if isinstance(prompts, (list, tuple)) and (not prompts or not hasattr(prompts[0], "shape") or
                                             np.ndim(prompts[0]) == 1):
    rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
  else:
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise ValueError(f"prompts must be a list of token lists or a [P, L] array, got shape {arr.shape}")
    m = np.ones(arr.shape, bool) if mask is None else np.asarray(mask, bool)
    rows = [a[mm] for a, mm in zip(arr, m)]
  if not rows:
    raise ValueError("generate: no prompts given")
  if min(len(r) for r in rows) < 1:
    raise ValueError("generate: every prompt needs at least one token")
  return rows


def lay_out(rows: Sequence[np.ndarray], length: int, pad_id: int, *, left: bool,
            name: str = "prompt") -> tuple[np.ndarray, np.ndarray]:
  """Rows → (tokens [n, length] int32, valid [n, length] bool), left-padded (left=True: the tokens end at
  the last column) or right-padded (they start at column 0)."""
  longest = max(len(r) for r in rows)
  if longest > length:
    raise ValueError(f"generate: {name} of {longest} tokens exceeds max_prompt_len {length}")
  toks = np.full((len(rows), length), pad_id, np.int32)
  valid = np.zeros((len(rows), length), bool)
  for i, r in enumerate(rows):
    cols = slice(length - len(r), length) if left else slice(0, len(r))
    toks[i, cols], valid[i, cols] = r, True
  return toks, valid


def prompt_ids(ids: Optional[Sequence[int]], n: int) -> np.ndarray:
  """The prompt ids rows derive their keys from: given (one per prompt) or 0..n-1."""
  out = np.arange(n) if ids is None else np.asarray(ids, np.int64)
  if out.shape != (n,):
    raise ValueError(f"prompt_ids has shape {out.shape}, expected ({n},)")
  return out
