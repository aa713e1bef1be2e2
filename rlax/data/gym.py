"""reasoning-gym tasks as records: `data.task="reasoning_gym:<dataset>"` draws procedural problems from the
`reasoning-gym` package (its dataset options from `data.task_options`), graded by the dataset's own scorer
(the `reasoning_gym` reward, in the verifier processes).

    records("leg_counting", 512, seed=0, options={"min_animals": 2, "max_animals": 3})

A record keeps the dataset's name and options and the entry's index in `metadata`; the scorer rebuilds the
entry from them (a pure function of name, options, seed and index), so no large object crosses to the graders.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping

from rlax.data.records import Record

PREFIX = "reasoning_gym:"
INSTRUCTION = "Give the final answer inside <answer></answer>."


def _module():
  try:
    import reasoning_gym  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError("data.task=reasoning_gym:... needs the reasoning-gym package: "
                     "pip install 'rlax-llm[reasoning_gym]'") from None
  return reasoning_gym


@functools.lru_cache(maxsize=32)
def dataset(name: str, size: int, seed: int, options: str):
  """The reasoning-gym dataset (cached per process: graders score many entries of one dataset)."""
  rg = _module()
  if name not in rg.factory.DATASETS:
    raise ValueError(f"data.task={PREFIX}{name}: reasoning-gym has no dataset {name!r}; it has "
                     f"{', '.join(sorted(rg.factory.DATASETS))}")
  try:
    return rg.create_dataset(name, size=size, seed=seed, **json.loads(options))
  except (TypeError, ValueError, AssertionError) as e:  # a bad option: its config class rejects it
    raise ValueError(f"data.task={PREFIX}{name}: bad options {options}: {type(e).__name__}: {e}") from None


def records(name: str, n: int, seed: int = 0, options: Mapping[str, Any] | None = None) -> list[Record]:
  opts = json.dumps(dict(options or {}), sort_keys=True)
  ds = dataset(name, max(n, 1), seed, opts)
  out = []
  for i in range(n):
    entry = ds[i]
    out.append(Record(id=f"rg-{name}-s{seed}-{i}", prompt=f"{entry['question'].strip()}\n{INSTRUCTION}",
                      answer=str(entry["answer"]), task="reasoning_gym", source=f"reasoning_gym/{name}",
                      metadata={"rg": {"dataset": name, "size": max(n, 1), "seed": seed, "options": opts,
                                       "index": i}}))
  return out


def score(record, answer: str) -> float:
  """The record's dataset's own score of `answer` (in [0, 1])."""
  rg = record.metadata.get("rg")
  if not rg:
    raise ValueError(f"record {record.id} is not a reasoning-gym record (no metadata['rg'])")
  ds = dataset(rg["dataset"], rg["size"], rg["seed"], rg["options"])
  return float(ds.score_answer(answer, ds[rg["index"]]) or 0.0)
