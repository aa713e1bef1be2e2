"""Seeded synthetic tasks with controllable difficulty: arithmetic, Countdown, small programs.

Every generator is a pure function of (n, difficulty, seed): the same arguments give the same
records, ids included, on any machine (`random.Random(seed)`, no global state). Difficulty is an
integer ≥ 1; what it controls is stated per task. The prompts ask for the final answer inside
`<answer>...</answer>` (code: a ```python block), which is what the matching rewards in
`rlax.rewards` parse.
"""

from __future__ import annotations

import inspect
import json
import random
from typing import Callable

from rlax.data import entities
from rlax.data import expr
from rlax.data import gym
from rlax.data.records import Record

ANSWER_INSTRUCTION = "Give the final answer inside <answer></answer>."


def _check(n: int, difficulty: int):
  if n < 0:
    raise ValueError(f"n must be non-negative, got {n}")
  if difficulty < 1:
    raise ValueError(f"difficulty must be >= 1, got {difficulty}")


def arithmetic(n: int, difficulty: int = 1, seed: int = 0) -> list[Record]:
  """Multi-digit integer arithmetic. Difficulty d: operands have d digits, there are
  2 + (d >= 3) + (d >= 5) operands, ops are + - (d = 1) or + - * (d >= 2); usual precedence."""
  _check(n, difficulty)
  rng = random.Random(f"arithmetic/{difficulty}/{seed}")
  n_operands = 2 + (difficulty >= 3) + (difficulty >= 5)
  ops = "+-" if difficulty == 1 else "+-*"
  lo, hi = (0 if difficulty == 1 else 10 ** (difficulty - 1)), 10**difficulty - 1
  out = []
  for i in range(n):
    nums = [rng.randint(lo, hi) for _ in range(n_operands)]
    text = str(nums[0])
    for x in nums[1:]:
      text += f" {rng.choice(ops)} {x}"
    value, _ = expr.evaluate(text)
    out.append(Record(
        id=f"arithmetic-d{difficulty}-s{seed}-{i}", prompt=f"What is {text}? {ANSWER_INSTRUCTION}",
        answer=str(int(value)), task="arithmetic", source="synthetic/arithmetic",
        difficulty=float(difficulty), metadata={"expression": text, "compact": text.replace(" ", "") + "="}))
  return out


def multiplication(n: int, difficulty: int = 2, seed: int = 0) -> list[Record]:
  """a * b with both operands of `difficulty` digits, from 12 up (no trivial 10 or 11 factors at 2 digits)."""
  _check(n, difficulty)
  rng = random.Random(f"multiplication/{difficulty}/{seed}")
  lo, hi = max(2, 10 ** (difficulty - 1) + 2 * (difficulty == 2)), 10**difficulty - 1
  out = []
  for i in range(n):
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    out.append(Record(id=f"multiplication-d{difficulty}-s{seed}-{i}", prompt=f"What is {a} * {b}?",
                      answer=str(a * b), task="arithmetic", source="synthetic/multiplication",
                      difficulty=float(difficulty), metadata={"expression": f"{a} * {b}"}))
  return out


def _random_expression(rng: random.Random, nums: list[int]) -> tuple[str, int] | None:
  """A random full binary expression over `nums` (each used once) with an integer value, or None."""
  items = [(str(x), x) for x in nums]
  while len(items) > 1:
    i, j = rng.sample(range(len(items)), 2)
    (ta, a), (tb, b) = items[i], items[j]
    choices = [("+", a + b), ("*", a * b)]
    if a > b:
      choices.append(("-", a - b))
    if b and a % b == 0 and b != 1:
      choices.append(("/", a // b))
    op, v = rng.choice(choices)
    items = [it for k, it in enumerate(items) if k not in (i, j)] + [(f"({ta} {op} {tb})", v)]
  return items[0]


def countdown(n: int, difficulty: int = 1, seed: int = 0) -> list[Record]:
  """Countdown: reach the target using each given number exactly once with + - * / and parentheses.
  Difficulty d: 2 + d numbers drawn from 1..(10 + 15 d); targets are integers in [10, 999] built
  from a random expression, so every problem is solvable (`metadata['solution']`)."""
  _check(n, difficulty)
  rng = random.Random(f"countdown/{difficulty}/{seed}")
  k, top = 2 + difficulty, 10 + 15 * difficulty
  out = []
  while len(out) < n:
    nums = [rng.randint(1, top) for _ in range(k)]
    solution, target = _random_expression(rng, nums)
    if not 10 <= target <= 999:
      continue
    i = len(out)
    out.append(Record(
        id=f"countdown-d{difficulty}-s{seed}-{i}",
        prompt=(f"Using the numbers {nums}, each exactly once, and the operations + - * / with "
                f"parentheses, write an expression equal to {target}. Put the expression inside "
                "<answer></answer>."),
        answer=str(target), task="countdown", source="synthetic/countdown",
        difficulty=float(difficulty), metadata={"numbers": nums, "target": target,
                                                "solution": solution[1:-1]}))
  return out


def _args_int(rng):
  return (rng.randint(-50, 50),)


def _args_list(rng):
  return ([rng.randint(-20, 20) for _ in range(rng.randint(0, 8))],)


def _args_str(rng):
  return ("".join(rng.choice("abcdeiou xyz") for _ in range(rng.randint(0, 12))),)


def _args_nat(rng):
  return (rng.randint(0, 20),)


# (name, signature, description, reference source, argument generator, difficulty tier)
_PROGRAMS: list[tuple[str, str, str, str, Callable, int]] = [
    ("affine", "f(x)", "returns {a} * x + {b}", "def f(x):\n    return {a} * x + {b}\n", _args_int, 1),
    ("clip", "f(x)", "returns x clipped to the range [{lo}, {hi}]",
     "def f(x):\n    return max({lo}, min({hi}, x))\n", _args_int, 1),
    ("count_char", "f(s)", "returns how many times the character '{c}' occurs in the string s",
     "def f(s):\n    return s.count('{c}')\n", _args_str, 1),
    ("sum_over", "f(xs)", "returns the sum of the elements of the list xs that are greater than {a}",
     "def f(xs):\n    return sum(x for x in xs if x > {a})\n", _args_list, 2),
    ("reverse_words", "f(s)", "returns the words of s (split on whitespace) in reverse order, joined by "
     "'{sep}'", "def f(s):\n    return '{sep}'.join(reversed(s.split()))\n", _args_str, 2),
    ("digit_sum", "f(x)", "returns the sum of the decimal digits of abs(x) times {a}",
     "def f(x):\n    return {a} * sum(int(d) for d in str(abs(x)))\n", _args_int, 2),
    ("fib_mod", "f(n)", "returns the n-th Fibonacci number (f(0) = 0, f(1) = 1) modulo {m}",
     "def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a % {m}\n",
     _args_nat, 3),
    ("running_max", "f(xs)", "returns the list of running maxima of xs, plus {a} each",
     "def f(xs):\n    out, m = [], None\n    for x in xs:\n        m = x if m is None else max(m, x)\n"
     "        out.append(m + {a})\n    return out\n", _args_list, 3),
]


def program(n: int, difficulty: int = 1, seed: int = 0, n_tests: int = 5) -> list[Record]:
  """Small Python functions checked by asserts. Difficulty d draws templates of tier ≤ d (1–3:
  one-liners, list/string processing, loops) with random constants; `tests` are `assert` lines
  computed from the reference solution (`metadata['solution']`)."""
  _check(n, difficulty)
  rng = random.Random(f"program/{difficulty}/{seed}")
  pool = [p for p in _PROGRAMS if p[5] <= difficulty]
  out = []
  for i in range(n):
    name, sig, desc, src, argfn, _ = rng.choice(pool)
    consts = {"a": rng.randint(2, 9), "b": rng.randint(-9, 9), "lo": rng.randint(-10, 0),
              "hi": rng.randint(1, 10), "c": rng.choice("aeiouxyz"), "sep": rng.choice(["-", ",", " "]),
              "m": rng.choice([7, 11, 97, 1000])}
    solution = src.format(**consts)
    scope: dict = {}
    exec(solution, scope)  # pylint: disable=exec-used  # our own template, not model output
    tests = []
    for _ in range(n_tests):
      args = argfn(rng)
      tests.append(f"assert f({', '.join(map(repr, args))}) == {scope['f'](*args)!r}")
    out.append(Record(
        id=f"program-d{difficulty}-s{seed}-{i}",
        prompt=(f"Write a Python function `{sig}` that {desc.format(**consts)}. Reply with the code "
                "in a ```python block."),
        tests=tuple(tests), task="code", source="synthetic/program", difficulty=float(difficulty),
        metadata={"template": name, "solution": solution}))
  return out


def digit_sort(n: int, difficulty: int = 1, seed: int = 0) -> list[Record]:
  """Sort a string of digits ascending. Difficulty d: 3 + d digits (10^(3+d) distinct problems).

  Learnable by a tiny transformer in minutes on a CPU, yet far too many problems to memorize:
  the demo's task, where held-out pass@k measures a skill, not recall.
  """
  _check(n, difficulty)
  rng = random.Random(f"digit_sort/{difficulty}/{seed}")
  out = []
  for i in range(n):
    digits = "".join(str(rng.randint(0, 9)) for _ in range(3 + difficulty))
    answer = "".join(sorted(digits))
    out.append(Record(
        id=f"digit_sort-d{difficulty}-s{seed}-{i}",
        prompt=f"Sort the digits {digits} in ascending order. {ANSWER_INSTRUCTION}", answer=answer,
        task="digit_sort", source="synthetic/digit_sort", difficulty=float(difficulty),
        metadata={"digits": digits, "compact": f"{digits}="}))
  return out


GENERATORS = {"arithmetic": arithmetic, "countdown": countdown, "program": program, "digit_sort": digit_sort,
              "multiplication": multiplication, "entities": entities.generate}


def _mixture(spec: str) -> list[tuple[str, float]]:
  """"a" or "a=2,b=1" → [(task, weight)]."""
  out = []
  for part in (p.strip() for p in spec.split(",") if p.strip()):
    name, _, w = part.rpartition("=") if "=" in part.split(":")[-1] else (part, "", "1")
    try:
      weight = float(w)
    except ValueError:
      raise ValueError(f"data.task={spec!r}: weight {w!r} of {name!r} is not a number") from None
    if weight <= 0:
      raise ValueError(f"data.task={spec!r}: weight of {name!r} must be positive")
    out.append((name.strip(), weight))
  if not out:
    raise ValueError("data.task is empty")
  return out


def _own(name: str, n: int, difficulty: int, seed: int, split: str, options: dict) -> list[Record]:
  """A generator of GENERATORS with its options (keyword arguments) and, where it takes one, the split ("train"
  or "eval": a task whose held-out records must ask what training never does, `entities`)."""
  fn = GENERATORS[name]
  params = inspect.signature(fn).parameters
  unknown = [k for k in options if k not in params or k in ("n", "difficulty", "seed", "split")]
  if unknown:
    takes = [k for k in params if k not in ("n", "difficulty", "seed", "split")]
    raise ValueError(f"data.task_options: task {name!r} has no option {unknown[0]!r} (its options: {takes or 'none'})")
  return fn(n, difficulty=difficulty, seed=seed, **options, **({"split": split} if "split" in params else {}))


def generate(task: str, n: int, difficulty: int = 1, seed: int = 0, options: str = "", split: str = "train"
             ) -> list[Record]:
  """The records of `task`: a generator of GENERATORS, "reasoning_gym:<dataset>" (rlax.data.gym), or a
  weighted mixture "a=2,b=1" of those (n split by weight, shuffled together).
  options: JSON, a task's options (reasoning-gym dataset config, a generator's keyword arguments), or
  {task: options} for a mixture. split: "train" or "eval" (rlax.builders.datasets draws each)."""
  try:
    opts = json.loads(options) if options else {}
  except json.JSONDecodeError as e:
    raise ValueError(f"data.task_options is not JSON: {e}") from None
  if not isinstance(opts, dict):
    raise ValueError(f"data.task_options must be a JSON object, got {options!r}")
  mix = _mixture(task)
  total = sum(w for _, w in mix)
  counts = [int(n * w / total) for _, w in mix]
  counts[-1] += n - sum(counts)
  out = []
  for (name, _), k in zip(mix, counts):
    own = opts.get(name, opts if len(mix) == 1 else {})
    if name.startswith(gym.PREFIX):
      out += gym.records(name[len(gym.PREFIX):], k, seed=seed, options=own)
    elif name in GENERATORS:
      out += _own(name, k, difficulty, seed, split, own)
    else:
      raise ValueError(f"unknown task {name!r}; choose from {sorted(GENERATORS)} or reasoning_gym:<dataset>")
  if len(mix) > 1:  # interleaved: a held-out set drawn from the front has every task
    random.Random(f"mix/{task}/{seed}").shuffle(out)
  return out
