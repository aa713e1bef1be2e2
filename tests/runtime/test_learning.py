"""The demo, shrunk: a warm-started policy's reward rises under RL, colocated and disaggregated."""

import numpy as np
import pytest

from rlax.runtime import Controller
from tiny import demo_config


def _shrunk(workdir, colocated: bool):
  # deterministic: the same outcome on every run, so the assertion cannot flake.
  return demo_config(workdir, **{"deterministic": True, "topology.colocated": colocated, "init.sft_steps": 40,
                                 "controller.steps": 150, "rollout.prompts_per_step": 8, "data.n_eval": 16,
                                 "eval.n_samples": 2, "checkpoint.every_steps": 0,
                                 "checkpoint.every_seconds": 0.0})


@pytest.mark.parametrize("colocated", [False, True])
def test_reward_rises(tmp_path, colocated):
  ctl = Controller(_shrunk(tmp_path, colocated), progress=False)
  assert ctl.topo.colocated == colocated
  shared = set(ctl.topo.trainer_mesh.devices.flat) & set(ctl.topo.sampler_mesh.devices.flat)
  assert bool(shared) == colocated
  ctl.run()
  reward = np.array([r["reward"] for r in ctl.metrics.history])
  first, last = reward[:30].mean(), reward[-30:].mean()
  assert last > first + 0.05, (first, last)
