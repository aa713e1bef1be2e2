"""Slice preemption inside a live controller (rlax.runtime.failover) on 8 fake CPU devices = 4 slices of 2.

The tiny config trains on slices 0-1 and samples on slices 2-3; faults are scheduled through
`faults.lose_slice_at` / `faults.restore_slice_at` ("slice:step") and fire at trainer step boundaries.
"""

import json
import os

import jax
import numpy as np
import pytest

from rlax import config as config_lib
from rlax.runtime import Controller
from tiny import tiny_config

DET = {"controller.max_staleness": 1, "deterministic": True, "controller.steps": 6}


def _devices(mesh):
  return {d.id for d in mesh.devices.flat}


def _events(ctl):
  with open(os.path.join(ctl.workdir, "failover.jsonl")) as f:
    return [json.loads(line) for line in f]


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
