"""The prompt record every task, curation step and verifier shares, and its JSONL/Parquet I/O.

A record is one problem: the prompt shown to the policy, and what a verifier needs to grade a
completion — a reference `answer` (math, arithmetic) or `tests` (code), which the rewards that grade against
one require when a run reads its files (a judge needs neither). `task` selects
the reward function by name (see `rlax.rewards.registry`), `source` names the data set it came from
(mixture weights and per-source pass@k and reward are keyed by it).

The file schema (JSONL: one object per line; Parquet: one column per field):

    {"id": "gsm-17",                      # optional: the file name and line number when absent
     "prompt": "What is 3 + 4?",          # the user turn, or instead:
     "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "answer": "7",                       # reference final answer (or "tests": ["assert f(1) == 2"])
     "task": "math", "source": "gsm8k", "difficulty": 0.3, "metadata": {...}}   # optional

Any other field of a row is kept in `metadata` (reward functions read it there). A file with other column
names is mapped onto the record by `Columns` (data.prompt_key, messages_key, answer_key: dotted paths into
the row), with `answer_format="gsm8k"` taking the answer after GSM8K's `####`. Besides JSONL and Parquet,
a Hugging Face `datasets` directory (`save_to_disk`; `DIR#split` picks a split of a DatasetDict) is read
through `datasets`. A bad row is one error naming the file and the line (JSONL) or row (Parquet, datasets).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Iterator, Optional

_FIELDS = ("id", "prompt", "messages", "answer", "tests", "task", "source", "difficulty", "metadata")
ANSWER_FORMATS = ("", "gsm8k")


@dataclasses.dataclass(frozen=True)
class Columns:
  """Where a file's rows keep the record's fields: dotted paths ("" : the field's own name), and how the
  answer is written ("": as is; "gsm8k": the text after `####`, thousands separators dropped)."""
  prompt: str = ""
  messages: str = ""
  answer: str = ""
  answer_format: str = ""

  def __post_init__(self):
    if self.answer_format not in ANSWER_FORMATS:
      raise ValueError(f"data.answer_format={self.answer_format!r}: use one of {ANSWER_FORMATS}")

  def apply(self, d: dict, where: str) -> dict:
    """The row with the mapped fields under their record names; every other field goes to metadata."""
    out, used = {}, set()
    for field in ("prompt", "messages", "answer"):
      path = getattr(self, field)
      if not path:
        continue
      value = _lookup(d, path)
      if value is _MISSING:
        raise ValueError(f"{where}: data.{field}_key={path!r} is not in the row; its keys: {_keys(d)}")
      out[field] = value
      used.add(path.split(".")[0])
    if self.answer_format == "gsm8k" and out.get("answer", d.get("answer")) is not None:
      text = str(out.get("answer", d.get("answer")))
      if "####" not in text:
        raise ValueError(f"{where}: data.answer_format='gsm8k' needs '#### <answer>' in the answer, got {text[-60:]!r}")
      out["answer"] = text.split("####")[-1].strip().replace(",", "")
    meta = dict(d.get("metadata") or {})
    for k, v in d.items():
      if k in out or k in used or k == "metadata":
        continue
      if k in _FIELDS:
        out[k] = v
      else:
        meta[k] = v
    return {**out, "metadata": meta}


_MISSING = object()


def _lookup(d: Any, path: str) -> Any:
  for part in path.split("."):
    if isinstance(d, dict) and part in d:
      d = d[part]
    elif isinstance(d, (list, tuple)) and part.isdigit() and int(part) < len(d):
      d = d[int(part)]
    else:
      return _MISSING
  return d


def _keys(d: dict) -> list[str]:
  """Top-level keys, with one level of nested keys as dotted paths."""
  out = []
  for k, v in d.items():
    out += [f"{k}.{j}" for j in v] if isinstance(v, dict) and v else [k]
  return sorted(out)


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
    if self.tests is not None:
      # A bare string is iterable too: it would become one test per character.
      if isinstance(self.tests, (str, bytes)) or not all(isinstance(t, str) for t in self.tests):
        raise ValueError(f"Record {self.id}: tests must be a list of Python statements (strings), "
                         f"got {self.tests!r:.80}")
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


def _writable(path: str) -> None:
  """Creates `path`'s directory; a path that cannot be written raises one ValueError naming it."""
  if os.path.isdir(path):
    raise ValueError(f"cannot write records to {path}: it is a directory")
  parent = os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(parent, exist_ok=True)
  except OSError as e:
    raise ValueError(f"cannot write records to {path}: cannot create directory {parent} "
                     f"({e.strerror})") from None


def write_jsonl(records: Iterable[Record], path: str) -> int:
  """Writes records one JSON object per line; returns how many were written."""
  _writable(path)
  n = 0
  try:
    with open(path, "w", encoding="utf-8") as f:
      for r in records:
        f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
        n += 1
  except OSError as e:
    raise ValueError(f"cannot write records to {path}: {e.strerror}") from None
  return n


def write_parquet(records: Iterable[Record], path: str) -> int:
  """Writes records as Parquet, one column per field (nested ones as JSON text); needs `pyarrow`."""
  try:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f"writing {path} needs pyarrow, which is not installed (pip install pyarrow), "
                     "or write .jsonl") from None
  _writable(path)
  rows = [r.to_dict() for r in records]
  for row in rows:  # free-form dicts have no fixed Parquet type; `_row` parses them back
    row["metadata"] = json.dumps(row["metadata"], ensure_ascii=False)
    # Every row needs every column: pyarrow takes the column names from the first row.
    row["messages"] = None if row.get("messages") is None else json.dumps(row["messages"],
                                                                          ensure_ascii=False)
  try:
    pq.write_table(pa.Table.from_pylist(rows), path)
  except OSError as e:
    raise ValueError(f"cannot write records to {path}: {e}") from None
  return len(rows)


def write_records(records: Iterable[Record], path: str) -> int:
  """Writes `.jsonl` (or `.json`) or `.parquet`, by the file's suffix; returns the record count."""
  _writable(path)
  if path.endswith((".jsonl", ".json")):
    return write_jsonl(records, path)
  if path.endswith(".parquet"):
    return write_parquet(records, path)
  raise ValueError(f"unsupported record file {path!r}: expected .jsonl or .parquet")


def _row(d: Any, where: str, columns: Optional[Columns] = None) -> Record:
  if not isinstance(d, dict):
    raise ValueError(f"{where}: bad record: expected a JSON object, got {type(d).__name__}")
  d = {k: v for k, v in d.items() if v is not None}
  for key in ("metadata", "messages"):  # Parquet files written by `write_parquet` hold JSON text
    if isinstance(d.get(key), str):
      try:
        d[key] = json.loads(d[key])
      except json.JSONDecodeError:
        raise ValueError(f"{where}: bad record: {key} is a string, not a JSON object") from None
  if not isinstance(d.get("metadata", {}), dict):
    raise ValueError(f"{where}: bad record: metadata must be an object, got {type(d['metadata']).__name__}")
  d = (columns or Columns()).apply(d, where)
  d.setdefault("id", where)
  try:
    return Record.from_dict(d)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: bad record: {e}") from None


def iter_jsonl(path: str, columns: Optional[Columns] = None) -> Iterator[Record]:
  """Yields the records of a JSONL file; a malformed line raises naming file and line number."""
  with open(path, "rb") as f:  # decoded per line, so bad bytes are reported with their line
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: bad record: not UTF-8 text ({e.reason} at byte "
                         f"{e.start} of the line)") from None
      if not line.strip():
        continue
      try:
        d = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: bad record: not JSON ({e})") from None
      yield _row(d, f"{path}:{lineno}", columns)


def read_parquet(path: str, columns: Optional[Columns] = None) -> list[Record]:
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
  return [_row(row, f"{path}:row {i}", columns) for i, row in enumerate(rows)]


def read_dataset(path: str, columns: Optional[Columns] = None) -> list[Record]:
  """Reads a Hugging Face `datasets` directory (`save_to_disk`); `DIR#split` names a DatasetDict's split
  (default "train")."""
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f"reading {path} needs the `datasets` package: pip install 'rlax-llm[datasets]'") from None
  root, _, split = path.partition("#")
  try:
    ds = datasets.load_from_disk(root)
  except Exception as e:  # FileNotFoundError or datasets' own errors for a directory that is not a dataset
    raise ValueError(f"{root}: not a datasets directory (save_to_disk): {type(e).__name__}: {e}") from None
  if isinstance(ds, datasets.DatasetDict):
    split = split or "train"
    if split not in ds:
      raise ValueError(f"{root}: no split {split!r}; it has {sorted(ds)} (name one as {root}#<split>)")
    ds = ds[split]
  elif split:
    raise ValueError(f"{root}: a single dataset has no splits; drop '#{split}'")
  return [_row(row, f"{path}:row {i}", columns) for i, row in enumerate(ds)]


def is_dataset_dir(path: str) -> bool:
  root = path.partition("#")[0]
  return os.path.isdir(root)


def _starts_with(path: str, prefix: bytes) -> bool:
  with open(path, "rb") as f:
    return f.read(4096).lstrip().startswith(prefix)


def read_records(path: str, columns: Optional[Columns] = None) -> list[Record]:
  """Reads a `.jsonl`, `.json` or `.parquet` file or a `datasets` directory into memory (prompt sets are
  small next to models); `columns` maps other field names onto the record."""
  if is_dataset_dir(path):
    return read_dataset(path, columns)
  if path.endswith(".json") and _starts_with(path, b"["):  # one JSON array of rows
    with open(path, "rb") as f:
      try:
        rows = json.load(f)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON array of records ({e})") from None
    return [_row(row, f"{path}:row {i}", columns) for i, row in enumerate(rows)]
  if path.endswith(".jsonl") or path.endswith(".json"):
    return list(iter_jsonl(path, columns))
  if path.endswith(".parquet"):
    return read_parquet(path, columns)
  raise ValueError(f"unsupported record file {path!r}: expected .jsonl, .parquet or a datasets directory")
