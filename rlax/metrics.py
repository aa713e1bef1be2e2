"""Run metrics: one JSONL line and TensorBoard scalars per step, and a console progress bar."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

import numpy as np


def _scalar(v):
  if isinstance(v, (bool, np.bool_)):
    return float(v)
  if isinstance(v, (int, float, np.integer, np.floating)):
    return float(v)
  if hasattr(v, "shape") and getattr(v, "shape", None) == ():
    return float(v)
  return None


def _finite_or_none(row: dict) -> dict:
  """NaN/inf floats as null: json.dumps would write `NaN`, which strict JSON readers refuse."""
  return {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in row.items()}


class MetricsWriter:
  """Writes `metrics.jsonl` and TensorBoard event files under `logdir`; keeps the history in memory.

  The history is what checkpoints store, so curves survive a restart.
  """

  def __init__(self, logdir: str, *, total_steps: int | None = None, progress: bool = True,
               history: list | None = None):
    os.makedirs(logdir, exist_ok=True)
    self.logdir = logdir
    self.history: list[dict[str, Any]] = list(history or [])
    self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a")
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(logdir, "tb"))
    except ImportError:  # tensorboardX is a core dependency; degrade to JSONL only if absent.
      self._tb = None
    self._bar = None
    if progress and total_steps:
      from tqdm import tqdm
      self._bar = tqdm(total=total_steps, initial=len(self.history), dynamic_ncols=True, leave=True)

  def reset(self, history: list[dict[str, Any]]) -> None:
    """Makes `history` (a checkpoint's) the run's rows, in memory and in metrics.jsonl.

    Rows written after that checkpoint belong to steps the resumed run trains again; rewriting the file
    (atomically) keeps one row per step, so readers need not de-duplicate.
    """
    self.history[:] = history
    path = os.path.join(self.logdir, "metrics.jsonl")
    with open(path + ".tmp", "w") as f:
      f.writelines(json.dumps(_finite_or_none(row)) + "\n" for row in history)
    self._jsonl.close()
    os.replace(path + ".tmp", path)
    self._jsonl = open(path, "a")
    if self._bar is not None:
      self._bar.n = len(history)
      self._bar.refresh()

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    row = {"step": int(step), "time": time.time()}
    for k, v in metrics.items():
      s = _scalar(v)
      row[k] = s if s is not None else (v.tolist() if hasattr(v, "tolist") else v)
    self.history.append(row)
    self._jsonl.write(json.dumps(_finite_or_none(row)) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k not in ("step", "time") and isinstance(v, float) and np.isfinite(v):
          self._tb.add_scalar(k, v, step)
    if self._bar is not None:
      # The clock starts with the first step (its row's step_s), not with the start-up before it.
      if self._bar.n == self._bar.initial and not self._bar.disable:
        n = self._bar.n
        self._bar.reset()
        self._bar.start_t -= float(row.get("step_s") or 0.0)
        self._bar.n = self._bar.initial = self._bar.last_print_n = n
      self._bar.update(1)
      shown = {k: f"{row[k]:.3g}" for k in ("reward", "pass_rate", "loss", "staleness_mean")
               if isinstance(row.get(k), float)}
      self._bar.set_postfix(shown, refresh=False)

  def close(self) -> None:
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()
