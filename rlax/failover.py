"""Slice preemption inside a live controller: detect at a step boundary, reassign roles, rebuild, carry on.

The Controller owns one `Failover`. It calls `at_step(s)` before every trainer step (fires the config's
scheduled faults, raises SlicesReturned when a lost slice came back, checks the trainer mesh) and
`ensure_alive(mesh)` before dispatching work on the sampler mesh or pushing weights. Any of these
raises a `TopologyChange`; the controller's `run` tears down its sampler thread and queue and calls
`recover`, then re-enters its loop from the step `recover` returns:

- sampler slice lost / slice returned: roles are reassigned (topology.reassign), a new Sampler and
  ParameterServer are built on the new sampler mesh, and the rollouts already generated stay queued.
  The interrupted batch is regenerated: its keys derive from (seed, step, prompt id) and, in
  deterministic mode, its weight version is pushed from `remember`'s trainer-side copies, so no
  trainer step is lost.
- trainer slice lost: the trainer steals a sampler slice (so its mesh keeps its shape when it can), is
  rebuilt on the new mesh, and restores the newest checkpoint onto it (a target of ShapeDtypeStructs
  carrying the new shardings); the step counter, data position and metric history rewind to the
  checkpoint's and the steps since are redone. Redone steps are written to metrics.jsonl again, so a
  reader keeps the last row per step; the in-memory history is truncated, so it stays monotone.

Every event is logged and appended to `<workdir>/failover.jsonl` (kind, slices, roles, steps lost,
recovery seconds). Scheduled faults that fired are recorded there too, so a restarted process does
not fire them again.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from absl import logging
import jax
from jax.sharding import NamedSharding

from rlax import models as M
from rlax import rollout as rollout_lib
from rlax.rollout_queue import RolloutQueue
from rlax.topology import FaultInjector, SliceLostError, reassign


class SlicesReturned(RuntimeError):
  """Lost slices are healthy again; they rejoin as samplers at this batch boundary."""


TopologyChange = (SliceLostError, SlicesReturned)


def parse_schedule(spec: str, field: str) -> list[tuple[int, int]]:
  """'2:5,0:9' → [(slice 2, step 5), (slice 0, step 9)]; empty string → []."""
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
  return out


def respec(x: Any, mesh) -> jax.ShapeDtypeStruct:
  """A restore target for array `x` with its NamedSharding's spec moved onto `mesh`."""
  sh = x.sharding
  if isinstance(sh, NamedSharding):
    sh = NamedSharding(mesh, sh.spec)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)


class Failover:
  """Slice health, scheduled faults and recovery for one Controller (see the module docstring)."""

  def __init__(self, ctl):
    self.ctl = ctl
    self.injector = FaultInjector(ctl.topo.slices)
    f = ctl.c.get("faults", None)
    self._schedule = ([("lose", sl, st) for sl, st in parse_schedule(f.lose_slice_at, "faults.lose_slice_at")]
                      + [("restore", sl, st) for sl, st in
                         parse_schedule(f.restore_slice_at, "faults.restore_slice_at")]) if f else []
    known = {s.index for s in ctl.topo.slices}
    for kind, sl, _ in self._schedule:
      if sl not in known:
        raise ValueError(f"faults: slice {sl} to {kind} does not exist; slices are {sorted(known)}")
    self.path = os.path.join(ctl.workdir, "failover.jsonl")
    self.events: list[dict] = []
    self._fired = {(e["kind"], e["slice"], e["at_step"]) for e in self._read() if e.get("event") == "injected"}
    self._versions: dict[int, Any] = {}  # deterministic mode: trainer-side copies of recent pushed weights
    self._owed: int | None = None        # version to push once the sampler has started its first batch

  def _read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def _log(self, row: dict) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")

  # -- detection ---------------------------------------------------------------------------------------
  def ensure_alive(self, x: Any) -> None:
    self.injector.ensure_alive(x)

  def at_step(self, step: int) -> None:
    """Step boundary: fire due faults, surface returned slices, and check the trainer mesh."""
    for kind, sl, st in self._schedule:
      if st <= step and (kind, sl, st) not in self._fired:
        self._fired.add((kind, sl, st))
        (self.injector.lose if kind == "lose" else self.injector.restore)(sl)
        self._log({"event": "injected", "kind": kind, "slice": sl, "at_step": st, "step": step,
                   "time": time.time()})
        logging.warning("fault injection: %s slice %d at step %d", kind, sl, step)
    back = set(self.ctl.topo.assignment.lost) - set(self.injector.lost)
    if back:
      raise SlicesReturned(f"slices {sorted(back)} returned")
    self.injector.ensure_alive(self.ctl.topo.trainer_mesh)

  # -- deterministic weight versions ---------------------------------------------------------------------
  def remember(self, params: Any, version: int) -> None:
    """Keep a trainer-side copy of pushed `version` so a rebuilt sampler can regenerate its batch exactly."""
    k = self.ctl.c.controller.max_staleness
    if not self.ctl.c.deterministic or k == 0:
      return
    self._versions[version] = jax.tree.map(lambda x: x.copy(), params)  # the trainer donates its state
    for v in [v for v in self._versions if v <= version - k]:
      del self._versions[v]

  def settle(self, state: Any, step: int) -> None:
    """After a re-entry's sampler thread started its first batch: push the trainer's own version if owed."""
    if self._owed is None:
      return
    ctl, v = self.ctl, self._owed
    self._owed = None
    ctl._wait_sampler_started(v - 1 + ctl.c.controller.max_staleness, ctl.c.controller.steps)
    ctl.push(state.params, v)

  def _prime(self, state: Any, step: int) -> None:
    """Push what the next generated batch needs into the fresh parameter server."""
    ctl = self.ctl
    first = step + len(ctl.queue)
    need = max(0, first - ctl.c.controller.max_staleness)
    if not ctl.c.deterministic or need >= step:
      ctl.push(state.params, step)
      return
    if need not in self._versions:
      raise RuntimeError(f"deterministic failover needs weight version {need} to regenerate batch {first}, "
                         f"but only versions {sorted(self._versions)} are kept")
    ctl.push(self._versions[need], need)
    self._owed = step

  # -- recovery ----------------------------------------------------------------------------------------
  def recover(self, err: BaseException, step: int, state: Any, ref_params: Any) -> tuple[int, Any, Any]:
    """Reassign roles after `err`, rebuild what lived on changed slices; returns (step, state, ref_params)."""
    t0 = time.perf_counter()
    ctl = self.ctl
    old = ctl.topo
    lost = set(self.injector.lost) - set(old.assignment.lost)
    back = set(old.assignment.lost) - set(self.injector.lost)
    ctl.topo = topo = reassign(old, lost, back)
    trainer_hit = bool(lost & set(old.assignment.trainer))
    old_queue = ctl.queue
    kept = old_queue.peek(len(old_queue))
    ctl.queue = RolloutQueue(ctl.c.controller.queue_size, ctl.c.controller.max_staleness,
                             ctl.c.controller.stale_policy)
    ctl.queue.staleness_hist, ctl.queue.dropped = old_queue.staleness_hist, old_queue.dropped
    ctl.versions = type(ctl.versions)()
    if topo.sampler_mesh != old.sampler_mesh:
      ctl.sampler = rollout_lib.make_sampler(ctl.c, ctl.model_cfg, topo.sampler_mesh)
    ctl.ps = ctl._build_ps(topo.sampler_mesh)  # a fresh server on the sampler's shardings; _prime fills it
    from_step = step
    if trainer_hit or topo.trainer_mesh != old.trainer_mesh:
      ctl.trainer = ctl._build_trainer(topo.trainer_mesh)
      target = jax.tree.map(lambda x: respec(x, topo.trainer_mesh), state)
      restored = ctl._restore(target)
      self._versions.clear()
      if restored is None:
        raise RuntimeError(f"trainer slices {sorted(lost & set(old.assignment.trainer))} lost at step {step} "
                           "before the first checkpoint; restart the run")
      step, state, meta, pending = restored
      ctl.data.set_state(meta["data"])
      ctl.metrics.history[:] = meta["history"]
      for r in pending:
        ctl.queue.put(r)
      if ref_params is not None:
        ref_params = jax.device_put(ref_params, M.param_shardings(ctl.model_cfg, topo.trainer_mesh))
    else:
      for r in kept:
        ctl.queue.put(r)
      ctl.data.set_state(ctl._data_after[step + len(kept) - 1])
    self._prime(state, step)
    row = {"event": "recovered", "kind": type(err).__name__, "lost": sorted(lost), "returned": sorted(back),
           "trainer": list(topo.assignment.trainer), "sampler": list(topo.assignment.sampler),
           "colocated": topo.assignment.colocated, "step": from_step, "resume_step": step,
           "steps_lost": from_step - step, "recovery_s": time.perf_counter() - t0, "time": time.time()}
    self.events.append(row)
    self._log(row)
    logging.warning("failover: lost %s, returned %s → trainer %s, sampler %s%s; resuming at step %d "
                    "(%d steps lost) after %.2fs", row["lost"], row["returned"], row["trainer"], row["sampler"],
                    " (colocated)" if row["colocated"] else "", step, row["steps_lost"], row["recovery_s"])
    return step, state, ref_params
