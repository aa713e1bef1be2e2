"""Periodic evaluation: n samples per prompt, graded, summarized as unbiased pass@k.

pass@k (Chen et al. 2021) from n ≥ k samples of which c are correct is 1 - C(n-c, k)/C(n, k),
computed as the product 1 - ∏_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
`evaluate` takes the controller's own `generate_fn(records, n) -> [[completion] * n]` and a
reward function, and reports pass@k overall and per record source, plus the mean reward.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

from absl import logging
import numpy as np

GenerateFn = Callable[[list, int], list[list[str]]]  # (records, n) → n completions each
RewardFn = Callable[[str, object], tuple[float, dict]]


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one prompt with c of n samples correct (needs 0 ≤ c ≤ n, 1 ≤ k ≤ n)."""
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(num_correct: Sequence[int], n: int, k: int) -> float:
  """Mean pass@k over prompts, each with `num_correct[i]` of n samples correct."""
  if not len(num_correct):
    raise ValueError("mean_pass_at_k needs at least one prompt")
  return float(np.mean([pass_at_k(n, int(c), k) for c in num_correct]))


def _graded(generate_fn: GenerateFn, chunk: list, reward_fn: RewardFn, n: int, grade_fn) -> np.ndarray:
  """[len(chunk), n] rewards of n sampled completions per record."""
  outs = generate_fn(chunk, n)
  if len(outs) != len(chunk) or any(len(o) != n for o in outs):
    raise ValueError(f"generate_fn returned {[len(o) for o in outs]} for {len(chunk)} prompts x n={n}")
  flat_c = [c for o in outs for c in o]
  flat_r = [r for r in chunk for _ in range(n)]
  if grade_fn is None:
    graded = [reward_fn(c, r) for c, r in zip(flat_c, flat_r)]
  else:
    graded = grade_fn(reward_fn, flat_c, flat_r)
  return np.array([g[0] for g in graded], dtype=np.float64).reshape(len(chunk), n)


def evaluate(generate_fn: GenerateFn, records: Sequence, reward_fn: RewardFn, n: int,
             ks: Sequence[int] = (1,), success: float = 0.5, batch_size: int = 64,
             grade_fn: Optional[Callable] = None, rewards_fn: Optional[Callable] = None) -> dict[str, float]:
  """Samples n completions per record, grades them, returns metrics.

  rewards_fn(records, n) -> [len(records), n] rewards replaces generate_fn and grading (multi-turn episodes,
  rewarded by their environment).

  A sample counts as correct when its reward > `success`. `grade_fn(fn, completions, records)`
  may be a `VerifierPool.grade` to grade in parallel (default: sequential calls of `reward_fn`).
  Returns {'pass@k': ..., 'pass@k/<source>': ..., 'mean_reward': ..., 'num_prompts': ...}.
  """
  if any(k > n or k < 1 for k in ks):
    raise ValueError(f"every k in {list(ks)} must satisfy 1 <= k <= n={n}")
  correct, rewards_all = [], []
  for start in range(0, len(records), batch_size):
    chunk = list(records[start:start + batch_size])
    if rewards_fn is not None:
      rw = np.asarray(rewards_fn(chunk, n), np.float64).reshape(len(chunk), n)
    else:
      rw = _graded(generate_fn, chunk, reward_fn, n, grade_fn)
    rewards_all.append(rw)
    correct.extend(int(x) for x in (rw > success).sum(axis=1))
  by_source = collections.defaultdict(list)
  for r, c in zip(records, correct):
    by_source[r.source].append(c)
  metrics = {"num_prompts": float(len(records)),
             "mean_reward": float(np.concatenate(rewards_all).mean()) if rewards_all else 0.0}
  for k in ks:
    metrics[f"pass@{k}"] = mean_pass_at_k(correct, n, k)
    if len(by_source) > 1:
      for src, cs in sorted(by_source.items()):
        metrics[f"pass@{k}/{src}"] = mean_pass_at_k(cs, n, k)
  logging.info("evaluation: %s", {m: round(v, 4) for m, v in metrics.items()})
  return metrics
