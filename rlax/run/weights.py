"""How many weight versions the run keeps, decided once: read by the weights service (rlax.builders) and the
memory estimate (rlax.memory)."""

from __future__ import annotations

from rlax.config import RunConfig


def versions_kept(run: RunConfig) -> int:
  """Versions the sampler side holds besides the one in use: deterministic mode hands batch s exactly version
  s - k, so it keeps the k + 1 newest; otherwise one arriving next to the one in use."""
  return run.controller.max_staleness + 1 if run.deterministic else 1


def versions_replayable(run: RunConfig) -> int:
  """Trainer-side copies of the newest pushes a rebuilt sampler may need (deterministic runs with scheduled
  slice faults: batch `first` after a rebuild needs versions first - k .. step, k + 1 of them); 0: none."""
  k, faults = run.controller.max_staleness, run.faults
  return k + 1 if run.deterministic and k and (faults.lose_slice_at or faults.restore_slice_at) else 0
