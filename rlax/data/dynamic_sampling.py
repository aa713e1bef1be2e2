"""DAPO dynamic sampling: drop prompt groups whose rewards all tie, refill the batch to its size.

A group (the n samples of one prompt) whose rewards are all equal has zero advantage under
group-normalized estimators (GRPO/DAPO), so it only dilutes the gradient. `informative_groups` is
the pure function over a [G, n] reward array; `GroupBuffer` accumulates informative groups across
sampling rounds until a fixed number of groups is ready, so the train step's batch shape never
changes (no recompiles) while every group in it carries signal.
"""

from __future__ import annotations

from typing import Any, Sequence

from absl import logging
import numpy as np


def informative_groups(rewards, atol: float = 1e-6) -> tuple[np.ndarray, int]:
  """Keep mask [G] (False where max - min ≤ atol across a group's n rewards) and the dropped count.

  `rewards`: [G, n] array, one row per prompt group.
  """
  r = np.asarray(rewards, dtype=np.float64)
  if r.ndim != 2 or r.shape[1] < 1:
    raise ValueError(f"rewards must be [groups, samples], got shape {r.shape}")
  keep = (r.max(axis=1) - r.min(axis=1)) > atol
  return keep, int(r.shape[0] - keep.sum())


def tied_rows(rewards, group_size: int) -> np.ndarray:
  """[B] bool: the rows of a batch (groups of `group_size` contiguous rows, as the advantages take them) whose
  group's rewards are all equal, exactly: the estimators' rule for advantage 0 (rlax.algorithms.advantages).
  Caller: rlax.runtime.step (such groups train nothing; their rows are packed apart)."""
  keep, _ = informative_groups(np.asarray(rewards).reshape(-1, group_size), atol=0.0)
  return np.repeat(~keep, group_size)


def refill_count(rewards, target_groups: int, atol: float = 1e-6) -> int:
  """How many more groups must be sampled so that `target_groups` informative ones are available,
  assuming refills are as informative as this round (at least the raw shortfall)."""
  keep, _ = informative_groups(rewards, atol)
  shortfall = target_groups - int(keep.sum())
  if shortfall <= 0:
    return 0
  frac = max(keep.mean(), 1.0 / max(len(keep), 1))
  return max(shortfall, int(np.ceil(shortfall / frac)))


class GroupBuffer:
  """Accumulates informative groups until a batch of exactly `target_groups` can be taken.

  Surplus groups carry over to the next batch (they are fresh enough: same policy version or one
  newer, which the controller's staleness bound covers) unless `clear()`ed. Tied groups are kept
  aside as spares: `pop_batch(fill=True)` tops a short batch up with them (their advantage is 0,
  so they are harmless) when the sampling budget ran out. Counters report what was dropped.
  """

  def __init__(self, target_groups: int, atol: float = 1e-6):
    if target_groups <= 0:
      raise ValueError(f"target_groups must be positive, got {target_groups}")
    self.target, self.atol = target_groups, atol
    self._groups: list[Any] = []
    self._rewards: list[np.ndarray] = []
    self._spare: list[tuple[Any, np.ndarray]] = []
    self.dropped = 0
    self.seen = 0

  def add(self, groups: Sequence[Any], rewards) -> int:
    """Adds one round: `groups` (G opaque items) with their [G, n] rewards; returns how many were kept."""
    r = np.asarray(rewards, dtype=np.float64)
    if len(groups) != r.shape[0]:
      raise ValueError(f"{len(groups)} groups but rewards has {r.shape[0]} rows")
    keep, dropped = informative_groups(r, self.atol)
    self.seen += len(groups)
    self.dropped += dropped
    for g, row, k in zip(groups, r, keep):
      if k:
        self._groups.append(g)
        self._rewards.append(row)
      else:
        self._spare.append((g, row))
    logging.info("dynamic sampling: dropped %d of %d groups with tied rewards; %d/%d buffered",
                 dropped, len(groups), len(self._groups), self.target)
    return int(keep.sum())

  def needed(self) -> int:
    """Informative groups still missing for the next batch (0 when ready)."""
    return max(0, self.target - len(self._groups))

  def ready(self) -> bool:
    return not self.needed()

  def clear(self) -> None:
    """Forget buffered and spare groups (each batch then depends only on its own sampling rounds)."""
    self._groups, self._rewards, self._spare = [], [], []

  def pop_batch(self, fill: bool = False) -> tuple[list[Any], np.ndarray]:
    """Exactly `target_groups` groups (oldest first) and their [target, n] rewards.

    `fill`: a short batch is topped up with spare tied groups (an error if there are too few).
    """
    if fill and not self.ready():
      n = min(self.needed(), len(self._spare))
      for g, row in self._spare[:n]:
        self._groups.append(g)
        self._rewards.append(row)
      self._spare = self._spare[n:]
    if not self.ready():
      raise ValueError(f"batch not ready: {len(self._groups)} of {self.target} groups buffered")
    groups, self._groups = self._groups[:self.target], self._groups[self.target:]
    rewards, self._rewards = self._rewards[:self.target], self._rewards[self.target:]
    return groups, np.stack(rewards)

  def take_surplus(self) -> list[Any]:
    """Removes and returns the informative groups buffered past a popped batch (oldest first)."""
    groups, self._groups, self._rewards = self._groups, [], []
    return groups

  def take_spares(self) -> list[Any]:
    """Removes and returns the tied groups kept aside."""
    spares, self._spare = [g for g, _ in self._spare], []
    return spares
