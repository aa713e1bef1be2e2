"""The prompt record every task, curation step and verifier shares, and its JSONL/Parquet I/O.

A record is one problem: the prompt shown to the policy, and what a verifier needs to grade a
completion — a reference `answer` (math, arithmetic, countdown) or `tests` (code). `task` selects
the reward function by name (see `rlax.rewards.registry`), `source` names the data set it came from
(mixture weights and per-source pass@k and reward are keyed by it).

The file schema (JSONL: one object per line; Parquet: one column per field):

    {"id": "gsm-17",                      # optional: the file name and line number when absent
     "prompt": "What is 3 + 4?",          # the user turn, or instead:
     "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "answer": "7",                       # reference final answer (or "tests": ["assert f(1) == 2"])
     "task": "math", "source": "gsm8k", "difficulty": 0.3, "metadata": {...}}   # optional

A bad row is one error naming the file and the line (JSONL) or row (Parquet).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Iterator, Optional

_FIELDS = ("id", "prompt", "messages", "answer", "tests", "task", "source", "difficulty", "metadata")


@dataclasses.dataclass(frozen=True)
class Record:
  """One problem. `tests` is a list of Python statements (e.g. `assert f(2) == 4`) for code tasks.

  `messages` (role/content dicts) replaces the single user turn `prompt`; `prompt` then holds the last
  user turn's text (dedup and logs key on it).
  """
  id: str
  prompt: str
  messages: Optional[tuple[dict, ...]] = None
  answer: Optional[str] = None
  tests: Optional[tuple[str, ...]] = None
  task: str = "math"
  source: str = "default"
  difficulty: Optional[float] = None
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.id, str) or not self.id:
      raise ValueError(f"Record.id must be a non-empty string, got {self.id!r}")
    if self.messages is not None:
      msgs = tuple(self.messages)
      if not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                             and isinstance(m.get("content"), str) for m in msgs):
        raise ValueError(f"Record {self.id}: messages must be a non-empty list of "
                         "{'role': str, 'content': str} objects")
      object.__setattr__(self, "messages", tuple(dict(role=m["role"], content=m["content"]) for m in msgs))
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
    if d["messages"] is None:
      del d["messages"]
    else:
      d["messages"] = list(d["messages"])
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Record":
    unknown = set(d) - set(_FIELDS)
    if unknown:
      raise ValueError(f"record has unknown fields {sorted(unknown)}; allowed: {_FIELDS}")
    d = dict(d)
    if d.get("messages") is not None and d.get("prompt") is None:
      users = [m.get("content") for m in d["messages"] if isinstance(m, dict) and m.get("role") == "user"]
      d["prompt"] = users[-1] if users and isinstance(users[-1], str) else ""
    if "id" not in d or "prompt" not in d:
      raise ValueError(f"record is missing 'id' or 'prompt'/'messages': keys {sorted(d)}")
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


def _row(d: Any, where: str) -> Record:
  if not isinstance(d, dict):
    raise ValueError(f"{where}: bad record: expected a JSON object, got {type(d).__name__}")
  d = {k: v for k, v in d.items() if v is not None}
  d.setdefault("id", where)
  try:
    return Record.from_dict(d)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: bad record: {e}") from None


def iter_jsonl(path: str) -> Iterator[Record]:
  """Yields the records of a JSONL file; a malformed line raises naming file and line number."""
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        d = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: bad record: not JSON ({e})") from None
      yield _row(d, f"{path}:{lineno}")


def read_parquet(path: str) -> list[Record]:
  """Reads records from Parquet (columns named like the Record fields); needs `pyarrow`."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError(f"reading {path} needs pyarrow, which is not installed (pip install pyarrow), "
                     "or convert it to JSONL") from e
  try:
    rows = pq.read_table(path).to_pylist()
  except Exception as e:  # pyarrow raises OSError or its own ArrowInvalid
    raise ValueError(f"{path}: cannot read as Parquet: {e}") from None
  return [_row(row, f"{path}:row {i}") for i, row in enumerate(rows)]


def read_records(path: str) -> list[Record]:
  """Reads a `.jsonl` or `.parquet` file into memory (prompt sets are small next to models)."""
  if path.endswith(".jsonl") or path.endswith(".json"):
    return list(iter_jsonl(path))
  if path.endswith(".parquet"):
    return read_parquet(path)
  raise ValueError(f"unsupported record file {path!r}: expected .jsonl or .parquet")
