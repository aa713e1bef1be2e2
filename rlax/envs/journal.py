"""The tool-result journal: every finished tool call of a training episode, on disk as it returns, so that a
run killed mid-episode and resumed from its checkpoint replays the calls it had already made instead of
running them again (a tool with side effects, a paid API, a slow sandbox).

    journal = ToolJournal(os.path.join(workdir, "tool_journal.jsonl"))
    results = journal.get(key, raw_calls)      # None unless this turn's calls were journaled
    journal.put(key, raw_calls, results)

A key names one turn of one episode: (seed, step, prompt id, sample, turn), which the resumed run regenerates
(exactly so in deterministic mode). An entry is used only when the turn asked for the same calls (their raw
text); a different turn under the same key runs its calls and replaces the entry. One JSON line per turn,
flushed as written; a line torn by the kill is skipped on load.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Optional, Sequence


class ToolJournal:

  def __init__(self, path: str):
    self.path = path
    self._lock = threading.Lock()
    self._entries: dict[str, tuple[list, list]] = {}
    self.replayed = 0
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          try:
            e = json.loads(line)
            self._entries[e["key"]] = (e["calls"], e["results"])
          except (ValueError, KeyError, TypeError):  # the line a kill cut short
            continue
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._file = open(path, "a")

  def __len__(self) -> int:
    return len(self._entries)

  @staticmethod
  def _key(key: Sequence) -> str:
    return json.dumps([int(k) for k in key])

  def get(self, key: Sequence, calls: Sequence[str]) -> Optional[list]:
    """The results journaled for `key` if its turn made the same `calls` (raw text), else None."""
    with self._lock:
      hit = self._entries.get(self._key(key))
      if hit is None or hit[0] != list(calls):
        return None
      self.replayed += 1
      return hit[1]

  def put(self, key: Sequence, calls: Sequence[str], results: Sequence) -> None:
    """Journals one turn's calls and their JSON-able results (written and flushed before returning)."""
    k = self._key(key)
    line = json.dumps({"key": k, "calls": list(calls), "results": list(results)})
    with self._lock:
      self._entries[k] = (list(calls), list(results))
      self._file.write(line + "\n")
      self._file.flush()

  def close(self) -> None:
    with self._lock:
      self._file.close()
