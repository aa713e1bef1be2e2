"""Per-batch rollout statistics: response lengths, truncation, and reward / pass rate per data source.

    stats = rollout_stats(out.lengths, truncated_from_finish_reason(out.finish_reason), rewards,
                          [r.source for r in records], success=0.5)

Keys: response_len_mean, response_len_p50, response_len_p95 (numpy's default linear-interpolated
percentiles), truncation_rate (fraction of rows that hit max_new_tokens), and for each data source
`reward/<source>` (mean reward) and `pass_rate/<source>` (fraction with reward > success). All
inputs are per row, host-side.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rlax.sampler import rows


def truncated_from_finish_reason(finish_reason) -> np.ndarray:
  """[B] bool: rows that stopped at the length limit (`rows.LENGTH`), from `SampleOutput.finish_reason`.

  Also takes the names in `rows.FINISH_REASONS` ('length', 'eos', 'stop', 'budget').
  """
  fr = np.asarray(finish_reason)
  if fr.ndim != 1:
    raise ValueError(f"finish_reason must be 1-D (one per row), got shape {fr.shape}")
  if fr.dtype.kind in "US":
    known, length = set(rows.FINISH_REASONS.values()), rows.FINISH_REASONS[rows.LENGTH]
  elif fr.dtype.kind in "iu":
    known, length = set(rows.FINISH_REASONS), rows.LENGTH
  else:
    raise ValueError(f"finish_reason must be integer codes or names, got dtype {fr.dtype}")
  bad = sorted(set(fr.tolist()) - known)
  if bad:
    raise ValueError(f"finish_reason has unknown values {bad[:5]}; known: {rows.FINISH_REASONS}")
  return fr == length


def _row_array(name: str, x, n: int | None) -> np.ndarray:
  a = np.asarray(x)
  if a.ndim != 1 or (n is not None and a.shape[0] != n):
    want = "1-D" if n is None else f"shape ({n},)"
    raise ValueError(f"{name} must be {want} (one value per row), got shape {a.shape}")
  return a


def rollout_stats(lengths, truncated, rewards, sources: Sequence[str],
                  success: float = 0.5) -> dict[str, float]:
  """Length, truncation and per-source reward / pass-rate metrics of one batch of rows; see module."""
  lengths = _row_array("lengths", lengths, None)
  n = lengths.shape[0]
  if n == 0:
    raise ValueError("rollout_stats needs at least one row")
  truncated = _row_array("truncated", truncated, n)
  rewards = _row_array("rewards", rewards, n)
  sources = _row_array("sources", np.asarray(sources, dtype=object), n)
  if lengths.dtype.kind not in "iuf" or (lengths < 0).any() or not np.isfinite(lengths).all():
    raise ValueError(f"lengths must be finite non-negative numbers, got {lengths[:8]}")
  if truncated.dtype != bool:
    raise ValueError(f"truncated must be bool (see truncated_from_finish_reason), got {truncated.dtype}")
  if rewards.dtype.kind not in "iuf":
    raise ValueError(f"rewards must be numbers, got {rewards[:8]}")
  if not all(isinstance(s, str) and s for s in sources):
    raise ValueError("sources must be non-empty strings, one per row")
  if isinstance(success, bool) or not isinstance(success, (int, float)) or not np.isfinite(success):
    raise ValueError(f"success threshold must be finite, got {success}")
  lengths, rewards = lengths.astype(np.float64), rewards.astype(np.float64)
  p50, p95 = np.percentile(lengths, [50, 95])
  stats = {"response_len_mean": float(lengths.mean()), "response_len_p50": float(p50),
           "response_len_p95": float(p95), "truncation_rate": float(truncated.mean())}
  # A non-finite reward is counted, not raised: the controller skips or stops on it (controller.on_nonfinite).
  finite = np.isfinite(rewards)
  if not finite.all():
    stats["reward_nonfinite"] = float((~finite).sum())
  for source in sorted(set(sources)):
    mine = rewards[(sources == source) & finite]
    stats[f"reward/{source}"] = float(mine.mean()) if mine.size else float("nan")
    stats[f"pass_rate/{source}"] = float((mine > success).mean()) if mine.size else float("nan")
  return stats
