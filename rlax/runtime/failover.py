"""Slice preemption inside a live run: detect at a step boundary, reassign roles, rebuild, carry on.

`Faults` tracks slice health and fires the config's scheduled faults: the loop calls `at_step(s)` before
every trainer step (raises SlicesReturned when a lost slice came back, SliceLostError when the trainer's
slices are gone) and `ensure_alive(mesh)` before work on the sampler mesh or a push. `recover` is a
function from (parts, lost/returned slices, where the loop stood) to (new parts, resume point):

- sampler slice lost / slice returned: roles are reassigned (topology.reassign), a new sampler and
  weights service are built on the new sampler mesh (rlax.builders), the rollouts already generated
  stay queued, and the interrupted batch is regenerated: its keys derive from (seed, step, prompt id)
  and, in deterministic mode, its weight version comes from `remember`'s trainer-side copies, so no
  trainer step is lost.
- trainer slice lost: the trainer takes a sampler slice (its mesh keeps its shape when it can), is
  rebuilt on the new mesh and restores the newest checkpoint onto it; the step, data position and
  metric history rewind to the checkpoint's and the steps since are redone.

Every event is appended to `<workdir>/failover.jsonl`; faults that fired are recorded there, so a
restarted process does not fire them again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Optional

from absl import logging
import jax

from rlax import builders
from rlax.config import RunConfig
from rlax.rollout import Rollout
from rlax.runtime.run_state import Resume
from rlax.topology import FaultInjector, SliceLostError, Topology, reassign


class SlicesReturned(RuntimeError):
  """Lost slices are healthy again; they rejoin as samplers at this batch boundary."""


TopologyChange = (SliceLostError, SlicesReturned)


class Faults:
  """Slice health, the scheduled faults of `run.faults`, and the failover log."""

  def __init__(self, run: RunConfig, topology: Topology):
    self.run = run
    self.injector = FaultInjector(topology.slices)
    self._schedule = ([("lose", sl, st) for sl, st in run.faults.lose_slice_at]
                      + [("restore", sl, st) for sl, st in run.faults.restore_slice_at])
    known = {s.index for s in topology.slices}
    for kind, sl, _ in self._schedule:
      if sl not in known:
        raise ValueError(f"faults: slice {sl} to {kind} does not exist; slices are {sorted(known)}")
    self.path = os.path.join(run.workdir, "failover.jsonl")
    self.events: list[dict] = []
    self._fired = {(e["kind"], e["slice"], e["at_step"]) for e in self._read() if e.get("event") == "injected"}
    self._versions: dict[int, Any] = {}  # deterministic mode: trainer-side copies of recent pushed weights

  def _read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def log(self, row: dict) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")

  @property
  def lost(self) -> frozenset[int]:
    return self.injector.lost

  def ensure_alive(self, x: Any) -> None:
    self.injector.ensure_alive(x)

  def at_step(self, step: int, topology: Topology) -> None:
    """Step boundary: fire due faults, surface returned slices, and check the trainer mesh."""
    for kind, sl, st in self._schedule:
      if st <= step and (kind, sl, st) not in self._fired:
        self._fired.add((kind, sl, st))
        (self.injector.lose if kind == "lose" else self.injector.restore)(sl)
        self.log({"event": "injected", "kind": kind, "slice": sl, "at_step": st, "step": step, "time": time.time()})
        logging.warning("fault injection: %s slice %d at step %d", kind, sl, step)
    back = set(topology.assignment.lost) - set(self.injector.lost)
    if back:
      raise SlicesReturned(f"slices {sorted(back)} returned")
    self.injector.ensure_alive(topology.trainer_mesh)

  def remember(self, params: Any, version: int) -> None:
    """Keeps a trainer-side copy of pushed `version` so a rebuilt sampler can regenerate its batch exactly."""
    k = self.run.controller.max_staleness
    if not self.run.deterministic or k == 0 or not self._schedule:
      return
    self._versions[version] = jax.tree.map(lambda x: x.copy(), params)  # the trainer donates its state
    for v in [v for v in self._versions if v < version - k]:
      del self._versions[v]

  def forget_versions(self) -> None:
    """The trainer restored a checkpoint: the remembered versions belong to a discarded future."""
    self._versions.clear()

  def versions_for(self, first: int, step: int, state: Any) -> list[tuple[Any, int]]:
    """(params, version) to push into a fresh weights service so batch `first` gets its exact version."""
    need = max(0, first - self.run.controller.max_staleness)
    if not self.run.deterministic or need >= step:
      return [(state.params, step)]
    missing = [v for v in range(need, step) if v not in self._versions]
    if missing:
      raise RuntimeError(f"deterministic failover needs weight versions {missing} to regenerate batch {first}, "
                         f"but only versions {sorted(self._versions)} are kept")
    return [(self._versions[v], v) for v in range(need, step)] + [(state.params, step)]


@dataclasses.dataclass
class Recovered:
  """What `recover` returns: the new parts and where the loop resumes (`history` None: unchanged)."""
  parts: builders.Components
  step: int
  state: Any
  ref_params: Any
  pending: list[Rollout]
  data_state: dict
  history: Optional[list[dict]]
  event: dict


def recover(run: RunConfig, parts: builders.Components, faults: Faults, err: BaseException, *, step: int, state: Any,
            ref_params: Any, kept: list[Rollout], data_state: dict,
            restore: Callable[[Any], Optional[Resume]]) -> Recovered:
  """Reassigns roles after `err`, rebuilds what lived on changed slices (through rlax.builders)."""
  t0 = time.perf_counter()
  old = parts.topology
  lost = set(faults.lost) - set(old.assignment.lost)
  back = set(old.assignment.lost) - set(faults.lost)
  topo = reassign(old, lost, back)
  new = builders.components(run, topo, reuse=parts)
  from_step, history = step, None
  if new.trainer is not parts.trainer:
    resume = restore(new.trainer.abstract_state())  # the new mesh's own layout
    faults.forget_versions()
    if resume is None:
      raise RuntimeError(f"trainer slices {sorted(lost & set(old.assignment.trainer))} lost at step {step} "
                         "before the first checkpoint; restart the run")
    step, state, kept, data_state, history = (resume.step, resume.state, resume.pending, resume.data_state,
                                               resume.history)
    if ref_params is not None:
      ref_params = (resume.ref_params if resume.ref_params is not None else
                    jax.device_put(ref_params, new.trainer.state_shardings().params))
  elif kept:
    data_state = kept[-1].data_state
  for params, v in faults.versions_for(step + len(kept), step, state):
    new.weights.push(params, v)
  event = {"event": "recovered", "kind": type(err).__name__, "lost": sorted(lost), "returned": sorted(back),
           "trainer": list(topo.assignment.trainer), "sampler": list(topo.assignment.sampler),
           "colocated": topo.assignment.colocated, "step": from_step, "resume_step": step,
           "steps_lost": from_step - step, "recovery_s": time.perf_counter() - t0, "time": time.time()}
  faults.events.append(event)
  faults.log(event)
  logging.warning("failover: lost %s, returned %s → trainer %s, sampler %s%s; resuming at step %d (%d steps lost) "
                  "after %.2fs", event["lost"], event["returned"], event["trainer"], event["sampler"],
                  " (colocated)" if event["colocated"] else "", step, event["steps_lost"], event["recovery_s"])
  return Recovered(new, step, state, ref_params, list(kept), data_state, history, event)
