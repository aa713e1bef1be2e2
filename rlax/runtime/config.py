"""The runtime's config sections: `controller` (the loop), `eval`, `checkpoint` and `faults`.

No runtime module is imported here: rlax.config composes these sections and the controller imports rlax.config.
"""

from __future__ import annotations

import dataclasses
import os


def _check(checks) -> None:
  for ok, msg in checks:
    if not ok:
      raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
  """The loop: `steps` RL steps; a sample is at most `max_staleness` (k) policy versions old."""
  steps: int = 100
  max_staleness: int = 1
  stale_policy: str = "drop"     # or "importance_weight"
  push_every: int = 1            # the trainer pushes weights every N steps
  queue_size: int = 2
  dynamic_sampling: bool = False
  on_nonfinite: str = "skip"     # a batch with a non-finite reward, loss or gradient norm: "skip" it or "stop"

  def validate(self) -> "ControllerConfig":
    _check((
        (self.steps >= 0, f"controller.steps={self.steps} must be >= 0"),
        (self.max_staleness >= 0, f"controller.max_staleness={self.max_staleness} must be >= 0"),
        (self.push_every >= 1, f"controller.push_every={self.push_every} must be >= 1"),
        (self.queue_size >= 1, f"controller.queue_size={self.queue_size} must be >= 1"),
        (self.on_nonfinite in ("skip", "stop"), f"controller.on_nonfinite={self.on_nonfinite!r}: use 'skip' or 'stop'"),
        (self.stale_policy in ("drop", "importance_weight"),
         f"controller.stale_policy={self.stale_policy!r}: use 'drop' or 'importance_weight'"),
        (self.push_every <= self.max_staleness + 1,
         f"controller.push_every={self.push_every} > max_staleness+1={self.max_staleness + 1}: the sampler would "
         "wait forever for fresh enough weights")))
    return self


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out pass@k before and after training (and every `every` steps between: the learning curve, in the
  metrics rows and the summary's `curve`): `n_samples` samples per eval prompt."""
  n_samples: int = 8
  temperature: float = 1.0
  greedy: bool = False            # also greedy accuracy (one more greedy completion per prompt)
  every: int = 0                  # 0: before and after only

  def validate(self) -> "EvalConfig":
    _check(((self.n_samples >= 1, f"eval.n_samples={self.n_samples} must be >= 1"),
            (self.temperature > 0, f"eval.temperature={self.temperature} must be > 0"),
            (self.every >= 0, f"eval.every={self.every} must be >= 0")))
    return self


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints of the train state; `export_every` > 0 also writes an HF directory every N steps
  (the final policy is always exported to <workdir>/export)."""
  every_steps: int = 50
  every_seconds: float = 600.0
  keep: int = 3
  grace_seconds: float = 30.0
  export_every: int = 0

  def validate(self) -> "CheckpointConfig":
    _check((
        (self.keep >= 1, f"checkpoint.keep={self.keep} must be >= 1"),
        (self.every_steps >= 0, f"checkpoint.every_steps={self.every_steps} must be >= 0 (0: off)"),
        (self.every_seconds >= 0, f"checkpoint.every_seconds={self.every_seconds} must be >= 0 (0: off)"),
        (self.grace_seconds > 0, f"checkpoint.grace_seconds={self.grace_seconds} must be > 0"),
        (self.export_every >= 0, f"checkpoint.export_every={self.export_every} must be >= 0 (0: final export only)")))
    return self


# Phases of a slice-fault recovery (rlax.runtime.failover.recover), in order; "restore" only when the
# trainer moved.
RECOVERY_PHASES = ("reassign", "build", "restore", "push", "commit")
_SIGNALS = {"kill": "SIGKILL", "term": "SIGTERM"}


def parse_schedule(spec: str, field: str) -> tuple[tuple[int, int], ...]:
  """'2:5,0:9' → ((slice 2, step 5), (slice 0, step 9)); empty string → ()."""
  out = []
  for part in (p.strip() for p in (spec or "").split(",")):
    if not part:
      continue
    try:
      sl, st = (int(x) for x in part.split(":"))
    except ValueError:
      raise ValueError(f"{field}={spec!r}: entries must look like 'slice:step', got {part!r}") from None
    if sl < 0 or st < 0:
      raise ValueError(f"{field}={spec!r}: slice and step must be >= 0, got {part!r}")
    out.append((sl, st))
  return tuple(out)


def parse_recovery_kills(spec: str) -> tuple[tuple[str, str], ...]:
  """'restore,build:term' → (("restore", "SIGKILL"), ("build", "SIGTERM")); empty string → ()."""
  out = []
  for part in (p.strip() for p in (spec or "").split(",")):
    if not part:
      continue
    phase, _, how = part.partition(":")
    sig = {"": "SIGKILL", **_SIGNALS}.get(how)
    if phase not in RECOVERY_PHASES or sig is None:
      raise ValueError(f"faults.kill_in_recovery={spec!r}: entries must look like 'phase' or 'phase:kill|term' "
                       f"with phase one of {', '.join(RECOVERY_PHASES)}; got {part!r}")
    out.append((phase, sig))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class FaultsConfig:
  """Simulated slice preemption: (slice, step) pairs lost / restored at step boundaries, and signals sent
  to the process during recoveries: (phase, "SIGKILL" | "SIGTERM"), one per recovery, in order.

  The ConfigDict spells each field as a string ("slice:step,...", "phase[:kill|term],..."): `parse` reads
  those strings, `specs` writes them (configs/base.py's defaults)."""
  lose_slice_at: tuple[tuple[int, int], ...] = ()
  restore_slice_at: tuple[tuple[int, int], ...] = ()
  kill_in_recovery: tuple[tuple[str, str], ...] = ()

  @property
  def any(self) -> bool:
    return bool(self.lose_slice_at or self.restore_slice_at)

  @classmethod
  def parse(cls, **specs: str) -> "FaultsConfig":
    s = {**cls().specs(), **specs}
    return cls(parse_schedule(s["lose_slice_at"], "faults.lose_slice_at"),
               parse_schedule(s["restore_slice_at"], "faults.restore_slice_at"),
               parse_recovery_kills(s["kill_in_recovery"]))

  def validate(self) -> "FaultsConfig":
    FaultsConfig.parse(**self.specs())  # the rules of the strings: slices and steps >= 0, known phases
    return self

  def specs(self) -> dict[str, str]:
    """The strings `parse` reads back into this config."""
    how = {sig: name for name, sig in _SIGNALS.items()}
    schedule = lambda pairs: ",".join(f"{sl}:{st}" for sl, st in pairs)
    return dict(lose_slice_at=schedule(self.lose_slice_at), restore_slice_at=schedule(self.restore_slice_at),
                kill_in_recovery=",".join(f"{phase}:{how.get(sig, sig)}" for phase, sig in self.kill_in_recovery))


def check_workdir(path: str) -> None:
  """The workdir, or the nearest existing directory above it, must be a writable directory: else the run
  would fail only when it first writes a log or checkpoint (rlax.config.validate)."""
  probe = path
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise ValueError(f"workdir={path!r}: {probe!r} exists and is not a directory")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise ValueError(f"workdir={path!r}: {probe!r} is not writable")
