"""The prompt record every task, curation step and verifier shares, and its JSONL/Parquet I/O.

A record is one problem: the prompt shown to the policy, and what a verifier needs to grade a
completion — a reference `answer` (math, arithmetic, countdown) or `tests` (code). `task` selects
the reward function by name (see `rlax.rewards.registry`), `source` names the data set it came from
(mixture weights and per-source pass@k are keyed by it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Iterator, Optional

_FIELDS = ("id", "prompt", "answer", "tests", "task", "source", "difficulty", "metadata")


@dataclasses.dataclass(frozen=True)
class Record:
  """One problem. `tests` is a list of Python statements (e.g. `assert f(2) == 4`) for code tasks."""
  id: str
  prompt: str
  answer: Optional[str] = None
  tests: Optional[tuple[str, ...]] = None
  task: str = "math"
  source: str = "default"
  difficulty: Optional[float] = None
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.id, str) or not self.id:
      raise ValueError(f"Record.id must be a non-empty string, got {self.id!r}")
    if not isinstance(self.prompt, str):
      raise ValueError(f"Record {self.id}: prompt must be a string, got {type(self.prompt).__name__}")
    if self.answer is None and not self.tests:
      raise ValueError(f"Record {self.id}: needs a reference `answer` or non-empty `tests`")
    if self.tests is not None and not isinstance(self.tests, tuple):
      object.__setattr__(self, "tests", tuple(self.tests))

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    if d["tests"] is not None:
      d["tests"] = list(d["tests"])
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Record":
    unknown = set(d) - set(_FIELDS)
    if unknown:
      raise ValueError(f"record has unknown fields {sorted(unknown)}; allowed: {_FIELDS}")
    if "id" not in d or "prompt" not in d:
      raise ValueError(f"record is missing 'id' or 'prompt': keys {sorted(d)}")
    d = dict(d)
    if d.get("answer") is not None and not isinstance(d["answer"], str):
      d["answer"] = str(d["answer"])  # numeric answers in JSON are graded as text
    d["id"] = str(d["id"])
    d["metadata"] = dict(d.get("metadata") or {})
    return cls(**d)


def write_jsonl(records: Iterable[Record], path: str) -> int:
  """Writes records one JSON object per line; returns how many were written."""
  n = 0
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
      n += 1
  return n


def iter_jsonl(path: str) -> Iterator[Record]:
  """Yields the records of a JSONL file; a malformed line raises naming file and line number."""
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield Record.from_dict(json.loads(line))
      except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise ValueError(f"{path}:{lineno}: bad record: {e}") from e


def read_parquet(path: str) -> list[Record]:
  """Reads records from Parquet (columns named like the Record fields); needs `pyarrow`."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError(f"reading {path} needs pyarrow, which is not installed (pip install pyarrow), "
                     "or convert it to JSONL") from e
  rows = pq.read_table(path).to_pylist()
  return [Record.from_dict({k: v for k, v in row.items() if v is not None or k == "answer"})
          for row in rows]


def read_records(path: str) -> list[Record]:
  """Reads a `.jsonl` or `.parquet` file into memory (prompt sets are small next to models)."""
  if path.endswith(".jsonl") or path.endswith(".json"):
    return list(iter_jsonl(path))
  if path.endswith(".parquet"):
    return read_parquet(path)
  raise ValueError(f"unsupported record file {path!r}: expected .jsonl or .parquet")
