"""Slice preemption inside a live controller (rlax.runtime.failover) on 8 fake CPU devices = 4 slices of 2.

The tiny config trains on slices 0-1 and samples on slices 2-3; faults are scheduled through
`faults.lose_slice_at` / `faults.restore_slice_at` ("slice:step") and fire at trainer step boundaries.
"""

import json
import os
import signal

import jax
import numpy as np
import pytest

from rlax import config as config_lib
from rlax.runtime import Controller, failover
from tiny import tiny_config

DET = {"controller.max_staleness": 1, "deterministic": True, "controller.steps": 6}


def _devices(mesh):
  return {d.id for d in mesh.devices.flat}


def _events_in(workdir):
  with open(os.path.join(workdir, "failover.jsonl")) as f:
    return [json.loads(line) for line in f]


def _events(ctl):
  return _events_in(ctl.workdir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  ctl = Controller(tiny_config(tmp_path_factory.mktemp("ref"), **DET), progress=False)
  return ctl.run()


def test_parse_schedule():
  assert config_lib.parse_schedule("2:5, 0:9", "f") == ((2, 5), (0, 9))
  assert config_lib.parse_schedule("", "f") == ()
  with pytest.raises(ValueError, match="faults.lose_slice_at"):
    config_lib.parse_schedule("2-5", "faults.lose_slice_at")


def test_unknown_slice_in_schedule_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="slice 7"):
    Controller(tiny_config(tmp_path, **{"faults.lose_slice_at": "7:1"}), progress=False)


def test_sampler_loss_rejoin_and_trainer_loss_in_one_run(tmp_path, reference):
  # Step 2: sampler slice 2 lost; step 4: it returns; step 5: trainer slice 0 lost (checkpoint at step 4).
  over = dict(DET, **{"faults.lose_slice_at": "2:2,0:5", "faults.restore_slice_at": "2:4"})
  ctl = Controller(tiny_config(tmp_path, **over), progress=False)
  seen = []
  ctl.callbacks.append(lambda c, s, row: seen.append((s, _devices(c.topo.sampler_mesh))))
  out = ctl.run()
  assert out["steps"] == 6 and not out["preempted"] and out["failovers"] == 3
  lost_s, back, lost_t = [e for e in _events(ctl) if e["event"] == "recovered"]
  # Sampler loss: the fleet shrinks, the trainer keeps its slices, no step is lost.
  assert (lost_s["lost"], lost_s["trainer"], lost_s["sampler"], lost_s["steps_lost"]) == ([2], [0, 1], [3], 0)
  assert seen[3] == (3, {6, 7})  # detected at the weight push after step 2; step 3 ran on the shrunk fleet
  # The returned slice rejoins as a sampler at the next batch boundary.
  assert (back["returned"], back["trainer"], back["sampler"], back["steps_lost"]) == ([2], [0, 1], [2, 3], 0)
  assert seen[4] == (4, {4, 5, 6, 7})
  # Trainer loss: it steals sampler slice 2 (same mesh shape), restores step 4 and redoes step 4.
  assert (lost_t["lost"], lost_t["trainer"], lost_t["sampler"]) == ([0], [1, 2], [3])
  assert (lost_t["step"], lost_t["resume_step"], lost_t["steps_lost"]) == (5, 4, 1)
  assert [s for s, _ in seen] == [0, 1, 2, 3, 4, 4, 5]
  assert _devices(ctl.topo.trainer_mesh) == {2, 3, 4, 5} and ctl.topo.trainer_mesh.devices.shape == (1, 4, 1)
  assert [r["step"] for r in ctl.metrics.history] == list(range(6))  # rewound, then monotone
  # Batches are addressable (seed, step, prompt id): the faulted run ends bitwise where the reference does.
  assert out["params_sha256"] == reference["params_sha256"]


def test_checkpoint_from_8_devices_restored_onto_4(tmp_path):
  # Colocated on all 4 slices (8 devices); losing slices 0 and 1 shrinks the trainer to 4 devices.
  over = {"topology.colocated": True, "topology.trainer_slices": 4, "topology.sampler_slices": -1,
          "rollout.prompts_per_step": 8, "data.n_eval": 8,  # prompt batches divisible by 8 devices
          "controller.max_staleness": 0, "controller.steps": 4, "faults.lose_slice_at": "0:3,1:3"}
  ctl = Controller(tiny_config(tmp_path, **over), progress=False)
  assert len(_devices(ctl.topo.trainer_mesh)) == 8
  out = ctl.run()
  assert out["steps"] == 4
  (ev,) = [e for e in _events(ctl) if e["event"] == "recovered"]
  assert ev["lost"] == [0, 1] and ev["trainer"] == [2, 3] and ev["resume_step"] == 2
  assert _devices(ctl.topo.trainer_mesh) == {4, 5, 6, 7}
  for leaf in jax.tree.leaves(ctl.final_state.params):
    assert {d.id for d in leaf.sharding.device_set} <= {4, 5, 6, 7}
    assert np.isfinite(np.asarray(jax.device_get(leaf))).all()


class _Killed(BaseException):
  """Stands in for SIGKILL in-process: nothing after the kill point runs (the test discards the controller)."""


def _kill_in_process(monkeypatch):
  def send(sig):
    if sig == signal.SIGKILL:
      raise _Killed()
    os.kill(os.getpid(), sig)
  monkeypatch.setattr(failover, "send_signal", send)


def test_a_lost_slice_stays_lost_across_a_restart(tmp_path, reference):
  # Sampler slice 2 is lost at step 2; the process is preempted after step 3 and restarted.
  over = dict(DET, **{"faults.lose_slice_at": "2:2"})
  first = Controller(tiny_config(tmp_path, **over), progress=False)
  first.callbacks.append(lambda c, s, row: c.request_stop() if s == 3 else None)
  assert first.run()["steps"] == 4
  again = Controller(tiny_config(tmp_path, **over), progress=False)
  # The restarted controller starts on the reduced topology, and says why.
  assert again.topo.assignment.lost == (2,) and _devices(again.topo.sampler_mesh) == {6, 7}
  (restart,) = [e for e in _events(again) if e["event"] == "restart"]
  assert restart["missing"] == [2] and restart["sampler"] == [3]
  assert restart["why"]["2"].startswith("lost at step 2") and "no return scheduled" in restart["why"]["2"]
  out = again.run()
  assert out["steps"] == 6 and out["failovers"] == 0
  assert out["params_sha256"] == reference["params_sha256"]


def test_a_lost_slice_returns_on_schedule_after_a_restart(tmp_path, reference):
  over = dict(DET, **{"faults.lose_slice_at": "2:1", "faults.restore_slice_at": "2:4"})
  first = Controller(tiny_config(tmp_path, **over), progress=False)
  first.callbacks.append(lambda c, s, row: c.request_stop() if s == 2 else None)
  first.run()
  again = Controller(tiny_config(tmp_path, **over), progress=False)
  assert again.topo.assignment.lost == (2,)
  assert "returns at step 4" in [e for e in _events(again) if e["event"] == "restart"][0]["why"]["2"]
  out = again.run()
  (back,) = [e for e in _events(again) if e["event"] == "recovered" and e["returned"]]
  assert back["returned"] == [2] and back["sampler"] == [2, 3] and back["step"] == 4
  assert out["params_sha256"] == reference["params_sha256"]


@pytest.mark.parametrize("phase", config_lib.RECOVERY_PHASES)
def test_sigkill_in_each_recovery_phase_resumes_from_the_last_checkpoint(tmp_path, reference, monkeypatch, phase):
  # Trainer slice 0 is lost at step 5 (checkpoint at step 4); the recovery dies in `phase`.
  _kill_in_process(monkeypatch)
  over = dict(DET, **{"faults.lose_slice_at": "0:5", "faults.kill_in_recovery": phase})
  with pytest.raises(_Killed):
    Controller(tiny_config(tmp_path, **over), progress=False).run()
  (killed,) = [e for e in _events_in(tmp_path) if e["event"] == "killed"]
  assert (killed["phase"], killed["signal"], killed["lost"], killed["step"]) == (phase, "SIGKILL", [0], 5)
  again = Controller(tiny_config(tmp_path, **over), progress=False)
  assert again.topo.assignment.trainer == (1, 2) and again.topo.assignment.sampler == (3,)
  out = again.run()
  assert [r["step"] for r in again.metrics.history] == list(range(6))
  assert out["steps"] == 6 and out["params_sha256"] == reference["params_sha256"]
  assert not [e for e in _events(again) if e["event"] == "recovered"]  # the restart needed no recovery


def test_sigterm_during_a_sampler_recovery_checkpoints_the_current_step(tmp_path, reference, monkeypatch):
  # Slice 2 is lost at step 2, found at the push after it; step 3 is not a periodic checkpoint step.
  over = dict(DET, **{"faults.lose_slice_at": "2:2", "faults.kill_in_recovery": "push:term"})
  first = Controller(tiny_config(tmp_path, **over), progress=False)
  out = first.run()
  # The recovery finished, then the preemption notice stopped the loop with a checkpoint of step 3.
  assert out["preempted"] and out["steps"] == 3 and first.run_state.ckpt.all_steps()[-1] == 3
  again = Controller(tiny_config(tmp_path, **over), progress=False)
  assert again.topo.assignment.sampler == (3,)
  out = again.run()
  assert out["steps"] == 6 and out["params_sha256"] == reference["params_sha256"]


def test_kill_in_recovery_is_validated(tmp_path):
  with pytest.raises(ValueError, match="faults.kill_in_recovery.*'rebuild'"):
    Controller(tiny_config(tmp_path, **{"faults.kill_in_recovery": "rebuild"}), progress=False)
