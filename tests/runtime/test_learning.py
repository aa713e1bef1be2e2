"""The demo, shrunk: a warm-started policy's reward rises under RL. Disaggregated only: a colocated run's loop is
the same code, and colocated runs train end to end in tests/runtime/test_failover.py and test_ppo.py (150 steps
of each placement cost the cold suite 164 s)."""

import numpy as np

from rlax.runtime import Controller
from tiny import demo_config


def _shrunk(workdir):
  # deterministic: the same outcome on every run, so the assertion cannot flake.
  return demo_config(workdir, **{"deterministic": True, "topology.colocated": False, "init.sft_steps": 40,
                                 "controller.steps": 150, "rollout.prompts_per_step": 8, "data.n_eval": 16,
                                 "eval.n_samples": 2, "checkpoint.every_steps": 0,
                                 "checkpoint.every_seconds": 0.0})


def test_reward_rises(tmp_path):
  ctl = Controller(_shrunk(tmp_path), progress=False)
  assert not set(ctl.topo.trainer_mesh.devices.flat) & set(ctl.topo.sampler_mesh.devices.flat)
  ctl.run()
  reward = np.array([r["reward"] for r in ctl.metrics.history])
  first, last = reward[:30].mean(), reward[-30:].mean()
  assert last > first + 0.05, (first, last)
