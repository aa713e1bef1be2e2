"""The tool-result journal: every finished tool call of a training episode, on disk as it returns, so that a
run killed mid-episode and resumed from its checkpoint replays the calls it had already made instead of
running them again (a tool with side effects, a paid API, a slow sandbox).

    journal = ToolJournal(os.path.join(workdir, FILE))
    view = journal.bind(tools, available, output_chars, timeout_s)   # a ToolRunner's view of it
    results = view.get(key, raw_calls)         # None unless this turn's calls were journaled
    view.put(key, raw_calls, results)
    journal.prune(step)                        # at a checkpoint: what no resume can need is dropped

A key names one turn of one episode: (seed, step, prompt id, sample, turn), which the resumed run regenerates
(exactly so in deterministic mode). An entry is used only when the turn asked for the same calls (their raw
text) under the same tool configuration (schemas, availability, output limit, deadline: `bind`); a different
turn under the same key runs its calls and replaces the entry. One JSON line per turn, flushed as written.
The file is not trusted on load: a line of the wrong shape or size (a kill tears the last one) is skipped and
counted (`skipped`), and a replayed output is cut to the current output limit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import weakref
from typing import Optional, Sequence

from absl import logging

from rlax.envs.base import CALL_OUTCOMES
from rlax.envs.renderers import json_value

FILE = "tool_journal.jsonl"  # in the run's workdir
KEY_LEN = 5  # (seed, step, prompt id, sample, turn)
MAX_LINE = 1 << 20  # bytes; a longer line is neither written nor loaded
_OPEN: "weakref.WeakValueDictionary[str, ToolJournal]" = weakref.WeakValueDictionary()


def fingerprint(tools: Sequence, available: bool, output_chars: int, timeout_s: float) -> str:
  """The tool configuration a result depends on: the tools' schemas (names included) and versions, whether they
  run, the output limit and the deadline."""
  schemas = sorted(json.dumps([t.schema(), t.version], sort_keys=True) for t in tools)
  blob = json.dumps([schemas, bool(available), int(output_chars), float(timeout_s)])
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prune(path: str, step: int) -> None:
  """Prunes the journal open on `path` in this process (the rollout producer's; no-op where none is)."""
  j = _OPEN.get(os.path.abspath(path))
  if j is not None:
    j.prune(step)


def _entry(line: bytes) -> Optional[tuple]:
  """(key, config, calls, results) of one journal line, or None when it is not a well-formed entry."""
  try:
    e, why = json_value(line.decode("utf-8"), max_depth=4)
  except UnicodeDecodeError:
    return None
  if why or not isinstance(e, dict) or not set(e) <= {"key", "config", "calls", "results"}:
    return None
  key, config, calls, results = e.get("key"), e.get("config", ""), e.get("calls"), e.get("results")
  if not (isinstance(key, list) and len(key) == KEY_LEN and all(type(k) is int for k in key)):
    return None
  if not (isinstance(config, str) and isinstance(calls, list) and all(isinstance(c, str) for c in calls)):
    return None
  if not (isinstance(results, list) and len(results) == len(calls) and all(
      isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and r[1] in CALL_OUTCOMES for r in results)):
    return None
  return tuple(key), config, calls, results


def _line(key: tuple, config: str, calls: list, results: list) -> str:
  return json.dumps({"key": list(key), "config": config, "calls": calls, "results": results})


class ToolJournal:
  """See the module docstring. Counters: `replayed` (turns answered from the journal), `skipped` (bad lines
  on load), `foreign` (entries not replayed as written under another tool configuration)."""

  def __init__(self, path: str):
    self.path = path
    self._lock = threading.Lock()
    self._entries: dict[tuple, tuple[str, list, list]] = {}
    self.replayed = self.skipped = self.foreign = 0
    self._stale = 0  # lines in the file that no entry is read from (replaced, malformed): a prune drops them
    torn = os.path.exists(path) and self._load()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._file = open(path, "a")
    if torn:  # the next entry starts on a line of its own
      self._file.write("\n")
      self._file.flush()
    _OPEN[os.path.abspath(path)] = self

  def _load(self) -> bool:
    """Reads the file's entries (the last per key); True when it does not end with a newline (torn)."""
    last = b"\n"
    with open(self.path, "rb") as f:
      while line := f.readline(MAX_LINE + 1):
        last = line
        if len(line) > MAX_LINE:
          while line and not line.endswith(b"\n"):  # the rest of an oversized line
            last = line = f.readline(MAX_LINE + 1)
          self.skipped += 1
          self._stale += 1
          continue
        if not line.strip():
          continue
        e = _entry(line)
        if e is None:
          self.skipped += 1
          self._stale += 1
          continue
        self._stale += e[0] in self._entries
        self._entries[e[0]] = e[1:]
    if self.skipped:
      logging.warning("tool journal %s: skipped %d malformed or oversized lines (their turns run again)",
                      self.path, self.skipped)
    return not last.endswith(b"\n")

  def __len__(self) -> int:
    return len(self._entries)

  @staticmethod
  def _key(key: Sequence) -> tuple:
    k = tuple(int(x) for x in key)
    if len(k) != KEY_LEN:
      raise ValueError(f"a tool journal key is (seed, step, prompt id, sample, turn), got {key!r}")
    return k

  def bind(self, tools: Sequence, available: bool, output_chars: int, timeout_s: float) -> "Bound":
    """This journal as a ToolRunner over `tools` uses it: its entries carry the configuration's fingerprint
    and a replayed output is cut to `output_chars`."""
    return Bound(self, fingerprint(tools, available, output_chars, timeout_s), int(output_chars))

  def get(self, key: Sequence, calls: Sequence[str], *, config: str = "",
          output_chars: Optional[int] = None) -> Optional[list]:
    """The results journaled for `key` if its turn made the same `calls` (raw text) under the same tool
    `config`, else None; an output longer than `output_chars` is cut ('truncated' where it was 'ok')."""
    with self._lock:
      hit = self._entries.get(self._key(key))
      if hit is None or hit[1] != list(calls):
        return None
      if hit[0] != config:
        self.foreign += 1
        logging.log_first_n(logging.WARNING, "tool journal %s: an entry written under another tool "
                            "configuration is not replayed (ToolJournal.foreign counts them)", 1, self.path)
        return None
      self.replayed += 1
      results = hit[2]
    if output_chars is None:
      return [list(r) for r in results]
    return [[out[:output_chars], "truncated" if how == "ok" and len(out) > output_chars else how]
            for out, how in results]

  def put(self, key: Sequence, calls: Sequence[str], results: Sequence, *, config: str = "") -> None:
    """Journals one turn's calls and their [output, outcome] results (written and flushed before returning;
    a line over MAX_LINE is kept in memory only)."""
    k, calls, results = self._key(key), list(calls), [list(r) for r in results]
    line = _line(k, config, calls, results)
    with self._lock:
      self._stale += k in self._entries
      self._entries[k] = (config, calls, results)
      if len(line) >= MAX_LINE:
        logging.log_first_n(logging.WARNING, "tool journal %s: a turn's line is over %d bytes, not written",
                            1, self.path, MAX_LINE)
        return
      self._file.write(line + "\n")
      self._file.flush()

  def prune(self, step: int) -> None:
    """Drops the entries of steps before `step` (no resume goes back past it) and the replaced lines,
    rewriting the file atomically (a temporary file renamed over it)."""
    with self._lock:
      kept = {k: v for k, v in self._entries.items() if k[1] >= step}
      if (len(kept) == len(self._entries) and not self._stale) or self._file.closed:
        return
      self._entries = kept
      tmp = f"{self.path}.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        for k, v in self._entries.items():
          line = _line(k, *v)
          if len(line) < MAX_LINE:
            f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
      self._file.close()
      os.replace(tmp, self.path)
      self._file = open(self.path, "a")
      self._stale = 0

  def close(self) -> None:
    with self._lock:
      self._file.close()
    if _OPEN.get(os.path.abspath(self.path)) is self:
      del _OPEN[os.path.abspath(self.path)]


@dataclasses.dataclass(frozen=True)
class Bound:
  """A ToolRunner's view of a journal (`ToolJournal.bind`): get/put under its tool configuration."""
  journal: ToolJournal
  config: str
  output_chars: int

  def get(self, key: Sequence, calls: Sequence[str]) -> Optional[list]:
    return self.journal.get(key, calls, config=self.config, output_chars=self.output_chars)

  def put(self, key: Sequence, calls: Sequence[str], results: Sequence) -> None:
    self.journal.put(key, calls, results, config=self.config)
