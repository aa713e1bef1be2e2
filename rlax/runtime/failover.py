"""Slice preemption inside a live run: detect at a step boundary, reassign roles, rebuild, carry on.

`Faults` tracks slice health and fires the config's scheduled faults: the loop calls `at_step(s)` before
every trainer step (raises SlicesReturned when a lost slice came back, SliceLostError when the trainer's
slices are gone) and `ensure_alive(mesh)` before work on the sampler mesh or a push. `recover` is a
function from (parts, lost/returned slices, where the loop stood) to (new parts, resume point):

- sampler slice lost / slice returned: roles are reassigned (topology.reassign), a new sampler and
  weights service are built on the new sampler mesh (rlax.builders), the rollouts already generated
  stay queued, and the interrupted batch is regenerated: its keys derive from (seed, step, prompt id)
  and, in deterministic mode, its weight version comes from the weights service's trainer-side history, so no
  trainer step is lost.
- trainer slice lost: the trainer takes a sampler slice (its mesh keeps its shape when it can), is
  rebuilt on the new mesh and restores the newest checkpoint onto it; the step, data position and
  metric history rewind to the checkpoint's and the steps since are redone.

Every event is appended to `<workdir>/failover.jsonl`. Faults persist like real ones: a fault that fired
is recorded there, so a restarted process does not fire it again, and a slice lost before the restart is
still lost after it (the restarted controller starts on the reduced topology, as a job restarted after a
slice preemption finds fewer slices) until its scheduled return.

Recovery is preemptible: it writes nothing but its log lines, so a SIGKILL in any of its phases
(`RECOVERY_PHASES`) leaves the newest checkpoint and the failover log, from which the next process resumes
on the reduced topology; a SIGTERM lets it finish and checkpoint. `faults.kill_in_recovery` sends those
signals deliberately, at a named phase, for tests and launch.fault_inject.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any, Callable, Optional

from absl import logging
import jax

from rlax import builders
from rlax.config import RECOVERY_PHASES, RunConfig
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
    past = self._read()
    injected = [e for e in past if e.get("event") == "injected"]
    self._fired = {(e["kind"], e["slice"], e["at_step"]) for e in injected}
    self._replayed = bool(injected)
    self._why: dict[int, dict] = {}  # slice → the injection that took it, for the restart log
    for e in injected:  # replay the health changes of earlier processes
      if e["kind"] == "lose":
        self.injector.lose(e["slice"])
        self._why[e["slice"]] = e
      else:
        self.injector.restore(e["slice"])
    self._kills_done = sum(1 for e in past if e.get("event") == "killed")
    self._recovery: Optional[dict] = None  # the recovery in progress: where a deliberate signal lands

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

  def restart_topology(self, topology: Topology) -> Topology:
    """The topology this process starts on: without the slices earlier processes lost (and did not get back)."""
    if not self._replayed:
      return topology
    missing = sorted(self.injector.lost)
    topo = reassign(topology, missing) if missing else topology
    why = {}
    for sl in missing:
      e = self._why[sl]
      back = sorted(st for kind, s, st in self._schedule
                    if kind == "restore" and s == sl and (kind, s, st) not in self._fired)
      why[str(sl)] = (f"lost at step {e['step']} (faults.lose_slice_at {sl}:{e['at_step']}); "
                      + (f"returns at step {back[0]}" if back else "no return scheduled"))
    self.log({"event": "restart", "missing": missing, "why": why, "trainer": list(topo.assignment.trainer),
              "sampler": list(topo.assignment.sampler), "service": list(topo.assignment.service),
              "colocated": topo.assignment.colocated, "pid": os.getpid(),
              "time": time.time()})
    logging.warning("restart after slice faults: %s → trainer %s, sampler %s, service %s%s",
                    "; ".join(f"slice {k} missing: {v}" for k, v in why.items()) or "no slice missing",
                    list(topo.assignment.trainer), list(topo.assignment.sampler), list(topo.assignment.service),
                    " (colocated)" if topo.assignment.colocated else "")
    return topo

  def phase(self, name: str) -> None:
    """Recovery reached phase `name`: the next deliberate signal of `faults.kill_in_recovery` lands here if due."""
    assert name in RECOVERY_PHASES, name
    plan = self.run.faults.kill_in_recovery
    if self._kills_done >= len(plan) or plan[self._kills_done][0] != name:
      return
    sig = plan[self._kills_done][1]
    self._kills_done += 1
    self.log({"event": "killed", "phase": name, "signal": sig, **(self._recovery or {}), "pid": os.getpid(),
              "time": time.time()})
    logging.warning("fault injection: %s during recovery phase %r", sig, name)
    send_signal(getattr(signal, sig))

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

  def begin_recovery(self, what: dict) -> None:
    self._recovery = what
    self.log({"event": "recovering", **what, "time": time.time()})

  def end_recovery(self) -> None:
    self._recovery = None


def send_signal(sig: int) -> None:
  """Signals this process (a SIGKILL ends it here; a SIGTERM reaches the preemption handler)."""
  os.kill(os.getpid(), sig)


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
  faults.begin_recovery({"lost": sorted(lost), "returned": sorted(back), "step": step})
  faults.phase("reassign")
  topo = reassign(old, lost, back)
  faults.phase("build")
  new = builders.components(run, topo, reuse=parts)
  from_step, history = step, None
  if new.trainer is not parts.trainer:
    faults.phase("restore")
    if new.trainer.variation.frozen_base:  # checkpoints hold what trains only: the base is read again onto the new mesh
      new.trainer.set_base(builders.initial_params(run, topo.trainer_mesh))
    resume = restore(new.trainer.abstract_state())  # the new mesh's own layout
    new.weights.forget_history()
    if resume is None:
      raise RuntimeError(f"trainer slices {sorted(lost & set(old.assignment.trainer))} lost at step {step} "
                         "before the first checkpoint; restart the run")
    step, state, kept, data_state, history = (resume.step, resume.state, resume.pending, resume.data_state,
                                               resume.history)
    if ref_params is not None:  # a frozen base is the reference; else the saved one, or this one moved
      moved = lambda: jax.device_put(ref_params, new.trainer.state_shardings().params)
      ref_params = (new.trainer.base if new.trainer.variation.frozen_base else resume.ref_params
                    if resume.ref_params is not None else moved())
  elif kept:
    data_state = kept[-1].data_state
  faults.phase("push")
  for params, v in new.weights.replay(step + len(kept), step, state.params, run.controller.max_staleness,
                                      exact=run.deterministic):
    new.weights.push(params, v)
  faults.phase("commit")
  faults.end_recovery()
  event = {"event": "recovered", "kind": type(err).__name__, "lost": sorted(lost), "returned": sorted(back),
           "trainer": list(topo.assignment.trainer), "sampler": list(topo.assignment.sampler),
           "service": list(topo.assignment.service), "colocated": topo.assignment.colocated, "step": from_step,
           "resume_step": step, "steps_lost": from_step - step, "recovery_s": time.perf_counter() - t0,
           "time": time.time()}
  faults.events.append(event)
  faults.log(event)
  logging.warning("failover: lost %s, returned %s → trainer %s, sampler %s%s; resuming at step %d (%d steps lost) "
                  "after %.2fs", event["lost"], event["returned"], event["trainer"], event["sampler"],
                  " (colocated)" if event["colocated"] else "", step, event["steps_lost"], event["recovery_s"])
  return Recovered(new, step, state, ref_params, list(kept), data_state, history, event)
