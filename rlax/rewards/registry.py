"""Reward functions by name, so configs select them: `get('math')`, `combine({'math': 1, 'format': .1})`.

Every entry has the signature `reward_fn(completion: str, record) -> (reward: float, info: dict)`.
'auto' dispatches on `record.task` (arithmetic, countdown, code, math, exact), which is what a
mixture of task types needs.
"""

from __future__ import annotations

from typing import Callable, Mapping

from rlax.rewards import code, math, text

RewardFn = Callable[[str, object], tuple[float, dict]]

_REGISTRY: dict[str, RewardFn] = {
    "math": math.math_reward,
    "exact": text.exact_reward,
    "format": text.format_reward,
    "arithmetic": text.arithmetic_reward,
    "countdown": text.countdown_reward,
    "code": code.code_reward,
    "digit_sort": text.exact_reward,
}
_TASK_ALIASES = {"program": "code"}


def register(name: str, fn: RewardFn, overwrite: bool = False) -> None:
  """Adds a reward under `name` (refuses to replace one unless `overwrite`)."""
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"reward {name!r} is already registered")
  _REGISTRY[name] = fn


def get(name: str) -> RewardFn:
  """The reward named `name`; 'a+b' sums rewards, 'auto' dispatches on record.task."""
  if "+" in name:
    return combine({n: 1.0 for n in name.split("+")})
  if name == "auto":
    return auto_reward
  if name not in _REGISTRY:
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY) + ['auto']}")
  return _REGISTRY[name]


def names() -> list[str]:
  return sorted(_REGISTRY) + ["auto"]


def auto_reward(completion: str, record) -> tuple[float, dict]:
  """Grades with the reward named by `record.task`."""
  task = _TASK_ALIASES.get(record.task, record.task)
  if task not in _REGISTRY:
    raise ValueError(f"record {record.id}: no reward for task {record.task!r}")
  return _REGISTRY[task](completion, record)


def combine(weights: Mapping[str, float]) -> RewardFn:
  """Weighted sum of named rewards; info holds each part's reward and info under its name."""
  if not weights:
    raise ValueError("combine needs at least one reward")
  parts = {n: get(n) for n in weights}

  def combined(completion: str, record) -> tuple[float, dict]:
    total, info = 0.0, {}
    for n, fn in parts.items():
      r, i = fn(completion, record)
      total += weights[n] * r
      info[n] = {"reward": r, **i}
    return total, info

  return combined
