"""Reward functions by name, so configs select them: `get('math')`, `combine({'math': 1, 'format': .1})`.

Every entry has the signature `reward_fn(completion: str, record) -> (reward: float, info: dict)`.
'auto' dispatches on `record.task` (arithmetic, countdown, code, math, exact), which is what a
mixture of task types needs. `build(name, answer=..., format_weight=...)` is what the runtime calls:
the named reward with a final-answer mode and an optional format bonus (see its docstring).
"""

from __future__ import annotations

import functools
import math as pymath
from typing import Callable, Mapping

from rlax import imports
from rlax.rewards import code, gym, math, qa, text

RewardFn = Callable[[str, object], tuple[float, dict]]

_REGISTRY: dict[str, RewardFn] = {
    "math": math.math_reward,
    "exact": text.exact_reward,
    "format": text.format_reward,
    "arithmetic": text.arithmetic_reward,
    "countdown": text.countdown_reward,
    "code": code.code_reward,
    "digit_sort": text.exact_reward,
    "reasoning_gym": gym.reasoning_gym_reward,
    "qa_em": qa.qa_em_reward,
    "qa_f1": qa.qa_f1_reward,
}
_TASK_ALIASES = {"program": "code"}


def register(name: str, fn: RewardFn, overwrite: bool = False) -> None:
  """Adds a reward under `name` (refuses to replace one unless `overwrite`)."""
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"reward {name!r} is already registered")
  _REGISTRY[name] = fn


def get(name: str) -> RewardFn:
  """The reward named `name`; 'a+b' sums rewards, 'auto' dispatches on record.task, "module:function" is a
  user's reward (it reads the record, metadata included: a file's extra columns land there)."""
  if "+" in name:
    return combine({n: 1.0 for n in name.split("+")})
  if name == "auto":
    return auto_reward
  if ":" in name:
    return imports.by_path(name, f"reward {name!r}", "a function")
  if name not in _REGISTRY:
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY) + ['auto']}")
  return _REGISTRY[name]


# Built-in rewards that grade a final answer and take the answer mode as `answer=` (digit_sort is
# exact_reward). Keyed by function, so a reward registered over one of their names is left alone.
_ANSWER_GRADERS = (math.math_reward, text.exact_reward, text.arithmetic_reward, gym.reasoning_gym_reward)


def _with_mode(fn: RewardFn, answer: str) -> RewardFn:
  if answer != "auto" and fn in _ANSWER_GRADERS:
    return functools.partial(fn, answer=answer)
  return fn


def build(name: str, *, answer: str = "auto", format_weight: float = 0.0) -> RewardFn:
  """The reward `name` (as in `get`) with answer mode `answer` and a format bonus.

  `answer` (one of `text.ANSWER_MODES`) picks where the final answer is read for the rewards that
  grade one: math (math-verify equivalence), arithmetic (numeric equality; with a mode other than
  'auto' decimals and fractions count, so 12.0 matches 12), exact and digit_sort (normalized text
  match), and 'auto' for records of those tasks. 'auto' keeps each reward's original extraction
  (see `math.math_reward`, `text.exact_reward`), so `build(name)` grades exactly as `get(name)`.
  Other rewards (countdown, code, format) ignore the mode; a mode other than 'auto' for a name in
  which no part grades a final answer is a ValueError.

  `format_weight > 0` adds `format_weight` when the completion states a final answer the way the
  mode asks (`text.has_answer_format`: a box for 'boxed', an `<answer>` tag for 'answer_tag', a
  number for 'last_number', any of them for 'auto'), right or wrong. Keep it below the success
  threshold of the pass-rate metrics (0.5), or well-formatted wrong answers count as passes.
  Info adds `correctness` (the reward before the bonus), `format_ok` and `format_bonus`.
  """
  parts = name.split("+") if isinstance(name, str) else [None]
  for part in parts:
    if part is not None and ":" in part:
      get(part)  # a user's reward by import path: one error when it does not import
    elif part != "auto" and part not in _REGISTRY:
      raise ValueError(f"reward.name={name!r}: unknown reward {part!r}; registered: {names()} "
                       "(join several with '+')")
  text.check_answer_mode(answer)
  if (isinstance(format_weight, bool) or not isinstance(format_weight, (int, float))
      or not pymath.isfinite(format_weight) or format_weight < 0):
    raise ValueError(f"reward.format_weight={format_weight!r} must be a finite number >= 0")
  if answer != "auto" and not any(p == "auto" or _REGISTRY.get(p) in _ANSWER_GRADERS for p in parts):
    raise ValueError(f"reward.answer={answer!r} does not apply to reward.name={name!r}: only math, "
                     "arithmetic, exact, digit_sort (and 'auto' over those tasks) grade a final answer")

  def one(part: str) -> RewardFn:
    if ":" in part:
      return get(part)
    if part != "auto":
      return _with_mode(_REGISTRY[part], answer)
    if answer == "auto":
      return auto_reward

    def auto_with_mode(completion: str, record) -> tuple[float, dict]:
      return _with_mode(_task_reward(record), answer)(completion, record)

    return auto_with_mode

  fns = {p: one(p) for p in parts}
  if len(fns) == 1:
    fn = fns[parts[0]]
  else:
    def fn(completion: str, record) -> tuple[float, dict]:
      total, info = 0.0, {}
      for n, f in fns.items():
        r, i = f(completion, record)
        total += r
        info[n] = {"reward": r, **i}
      return total, info

  if format_weight == 0:
    return fn

  def with_format(completion: str, record) -> tuple[float, dict]:
    r, info = fn(completion, record)
    ok = text.has_answer_format(completion, answer)
    bonus = float(format_weight) if ok else 0.0
    return r + bonus, {**info, "correctness": r, "format_ok": ok, "format_bonus": bonus}

  return with_format


def names() -> list[str]:
  return sorted(_REGISTRY) + ["auto"]


# Built-in rewards that grade against a record's reference, and the field each reads (countdown reads metadata).
_REFERENCES = {math.math_reward: "answer", text.exact_reward: "answer", text.arithmetic_reward: "answer",
               gym.reasoning_gym_reward: "answer", qa.qa_em_reward: "answer", qa.qa_f1_reward: "answer",
               code.code_reward: "tests"}


def missing_reference(name: str, record) -> str | None:
  """The reference field ('answer' or 'tests') that reward `name` grades `record` against and the record lacks;
  None when it has it or nothing needs one (a judge, format, countdown, a user's reward). Caller:
  rlax.builders.read_files."""
  for part in name.split("+"):
    fn = _task_fn(record) if part == "auto" else _REGISTRY.get(part)
    field = _REFERENCES.get(fn)
    if field == "answer" and record.answer is None or field == "tests" and not record.tests:
      return field
  return None


def _task_fn(record) -> RewardFn | None:
  """The reward `record.task` names (None: no such reward)."""
  return _REGISTRY.get(_TASK_ALIASES.get(record.task, record.task))


def _task_reward(record) -> RewardFn:
  fn = _task_fn(record)
  if fn is None:
    raise ValueError(f"record {record.id}: no reward for task {record.task!r}")
  return fn


def auto_reward(completion: str, record) -> tuple[float, dict]:
  """Grades with the reward named by `record.task`."""
  return _task_reward(record)(completion, record)


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
