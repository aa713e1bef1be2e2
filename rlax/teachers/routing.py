"""A run's teachers: one, or several chosen per record, as one scorer of rollout batches.

    teachers = Teachers({"default": a, "code": b}, field="domain")
    batch = batch.replace(**teachers.scores(batch, records))   # records: each row's Record

A row goes to the teacher its record's `metadata[field]` names, else to the default one (TeacherConfig.dirs).
With one teacher the batch is scored whole. With several, each teacher scores its rows in passes of a fixed
`pass_rows` rows (the last pass filled with copies of a row whose loss mask is cleared, so they score nothing):
one program per teacher, whatever the split, and a teacher no row names costs nothing that step.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Optional, Sequence

import numpy as np

from rlax.rollout import packing
from rlax.teachers.config import DEFAULT
from rlax.teachers.teacher import Teacher
from rlax.trainer.batch import TEACHER_FIELDS, RolloutBatch


def programs_each(forks: bool) -> int:
  """Scoring programs each teacher compiles in a run, at most: a padded batch's, and where episodes fork the
  packed rows' (`Teachers.warm_up`; a call's rows are fixed: `call_rows`). Counted by rlax.compiled; teachers
  rebuilt after their slices return compile theirs again."""
  return 1 + bool(forks)


def route(records: Sequence[Any], names: Sequence[str], field: str) -> np.ndarray:
  """Each record's teacher name: its `metadata[field]` when a teacher has that name, else DEFAULT."""
  known = set(names)
  pick = lambda r: str(v) if (v := (getattr(r, "metadata", None) or {}).get(field)) is not None else DEFAULT
  return np.array([n if (n := pick(r)) in known else DEFAULT for r in records], dtype=object)


def call_rows(rows: int, teachers: int, pass_rows: int) -> int:
  """Rows of each scoring call of a batch of `rows` rows: all of them with one teacher (the teacher splits them
  into its own passes), else `pass_rows` (all when 0). Callers: Teachers.scores, launch.plan."""
  return rows if teachers == 1 else min(pass_rows or rows, rows)


class Teachers:
  """`teachers` {name: Teacher} (DEFAULT among them) on one mesh; `field`: the record metadata key that picks a
  row's teacher ("" with one teacher); `pass_rows`: rows a teacher scores at once when there are several."""

  def __init__(self, teachers: dict[str, Teacher], field: str = "", pass_rows: int = 0):
    if DEFAULT not in teachers:
      raise ValueError(f"no {DEFAULT!r} teacher among {sorted(teachers)}")
    self.teachers, self.field, self.pass_rows = dict(teachers), field, pass_rows
    self.mesh = teachers[DEFAULT].mesh
    self.rows: collections.Counter = collections.Counter()  # rows each teacher scored (of real sequences)
    self.last: dict[str, tuple[int, float]] = {}  # the last batch's (rows, seconds) per teacher that scored it

  @property
  def traces(self) -> collections.Counter:
    """Programs traced, summed over the teachers."""
    return sum((t.traces for t in self.teachers.values()), collections.Counter())

  def warm_up(self, rows: int, prompt_len: int, new_tokens: int, forks: bool) -> None:
    """Each teacher's programs a later batch could first need, compiled (and run on rows that score nothing)
    before the first batch: with several teachers the padded rows of one call (a teacher no record names until a
    later step would compile then; one teacher compiles it on the first batch, which it scores whole), and where
    episodes may split into rows (`forks`), the packed rows such a batch is scored in."""
    n = call_rows(rows, len(self.teachers), self.pass_rows)
    blank = packing.empty_batch(n, prompt_len, new_tokens)
    for teacher in self.teachers.values():
      if len(self.teachers) > 1:
        teacher.scores(blank)
      if forks:
        teacher.scores_packed(blank)

  def scores(self, batch: RolloutBatch, records: Optional[Sequence[Any]] = None) -> dict:
    """The teachers' fields of a host batch (Teacher.scores), each row's from its own teacher; `records`: the
    batch's rows' records (needed with several teachers). Each teacher's rows and seconds go to `last`."""
    if len(self.teachers) == 1:
      t0 = time.perf_counter()
      self.rows[DEFAULT] += batch.batch_size
      out = self.teachers[DEFAULT].scores(batch)
      self.last = {DEFAULT: (batch.batch_size, time.perf_counter() - t0)}
      return out
    if records is None or len(records) != batch.batch_size:
      raise ValueError(f"{len(self.teachers)} teachers route rows by record: give the batch's "
                       f"{batch.batch_size} rows' records")
    names = route(records, list(self.teachers), self.field)
    out: dict = {}
    self.last = {}
    n = call_rows(batch.batch_size, len(self.teachers), self.pass_rows)
    for name, teacher in self.teachers.items():
      rows = np.flatnonzero(names == name)
      if not rows.size:  # no row names it this step: it costs nothing
        self.last[name] = (0, 0.0)
        continue
      t0 = time.perf_counter()
      self.rows[name] += rows.size
      for i in range(0, rows.size, n):
        got = rows[i:i + n]
        part = teacher.scores(_rows(batch, got, n))
        for k, v in part.items():
          out.setdefault(k, np.zeros((batch.batch_size, *v.shape[1:]), v.dtype))[got] = v[:got.size]
      self.last[name] = (int(rows.size), time.perf_counter() - t0)
    return {k: out[k] for k in TEACHER_FIELDS if k in out}


def _rows(batch: RolloutBatch, rows: np.ndarray, n: int) -> RolloutBatch:
  """Rows `rows` of `batch` as a batch of exactly `n` rows: the last repeated with nothing scored."""
  fill = n - rows.size
  part = packing.take_rows(batch, np.concatenate([rows, np.repeat(rows[-1:], fill)]))
  if fill:
    lm = np.array(part.loss_mask)
    lm[rows.size:] = 0.0
    part = part.replace(loss_mask=lm)
  return part
