"""The demo, shrunk: a warm-started policy's reward rises under RL, colocated and disaggregated."""

import numpy as np
import pytest

from configs import demo
from rlax.controller import Controller


def _shrunk(workdir, colocated: bool):
  c = demo.get_config()
  c.workdir = str(workdir)
  c.deterministic = True  # same outcome on every run: the assertion cannot flake
  c.topology.colocated = colocated
  c.init.sft_steps = 40
  c.controller.steps = 150
  c.rollout.prompts_per_step = 8
  c.data.n_eval = 16
  c.eval.n_samples = 2
  c.checkpoint.every_steps = 0
  c.checkpoint.every_seconds = 0.0
  return c


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
