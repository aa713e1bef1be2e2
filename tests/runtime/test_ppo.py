"""PPO with a critic in the runtime: critic metrics, checkpointed and resumed bitwise, restored onto a new mesh."""

import jax
import numpy as np
import pytest

from configs import algorithm
from rlax.runtime import Controller
from tiny import tiny_config

PPO = {"algorithm.name": "ppo", "algorithm.overrides": {"value_warmup_steps": 1, "critic_lr": 1e-3}}
DET = dict(PPO, **{"controller.max_staleness": 1, "deterministic": True, "controller.steps": 4})
# The tiny untrained policy scores 0 on the task; a reward that varies gives the critic something to fit.
REWARD = lambda text, record: (float(len(text) % 2), {})


def _equal(a, b):
  a, b = jax.device_get(a), jax.device_get(b)
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_ppo_preset_is_offered_and_validated(tmp_path):
  preset = algorithm.get_config("ppo")
  assert preset.algorithm.name == "ppo" and preset.algorithm.overrides["value_warmup_steps"] >= 1
  bad = tiny_config(tmp_path, **dict(PPO, **{"algorithm.overrides": {"value_warmup_steps": 4}}))
  with pytest.raises(ValueError, match="value_warmup_steps=4 must be < controller.steps=4"):
    Controller(bad, progress=False)


def test_preempted_ppo_run_resumes_policy_and_critic_bitwise(tmp_path):
  ref = Controller(tiny_config(tmp_path / "ref", **DET), progress=False, reward_fn=REWARD)
  ref.run()
  rows = ref.metrics.history
  for key in ("value_loss", "value_clip_frac", "explained_variance"):
    assert all(np.isfinite(r[key]) for r in rows), key
  assert [r["value_warmup"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
  assert int(ref.final_state.critic.step) == 4
  head = jax.device_get(ref.final_state.critic.params["head"])
  assert np.any(head["w"] != 0)  # the critic moved away from its zero-initialized head

  def stop_after_2(ctl, step, row):
    if step == 1:
      ctl.request_stop()

  first = Controller(tiny_config(tmp_path / "run", **DET), progress=False, callbacks=[stop_after_2], reward_fn=REWARD)
  assert first.run()["preempted"]
  second = Controller(tiny_config(tmp_path / "run", **DET), progress=False, reward_fn=REWARD)
  assert second.run()["steps"] == 4
  assert _equal(second.final_state.params, ref.final_state.params)
  assert _equal(second.final_state.critic, ref.final_state.critic)


def test_critic_restored_onto_a_smaller_trainer_mesh(tmp_path):
  # As tests/runtime/test_failover.py: colocated on 8 devices; losing slices 0 and 1 leaves 4.
  over = dict(PPO, **{"topology.colocated": True, "topology.trainer_slices": 4, "topology.sampler_slices": -1,
                      "rollout.prompts_per_step": 8, "data.n_eval": 8, "controller.max_staleness": 0,
                      "controller.steps": 4, "faults.lose_slice_at": "0:3,1:3"})
  ctl = Controller(tiny_config(tmp_path, **over), progress=False, reward_fn=REWARD)
  out = ctl.run()
  assert out["steps"] == 4
  critic = ctl.final_state.critic
  assert int(critic.step) == 4
  for leaf in jax.tree.leaves(critic):
    assert {d.id for d in leaf.sharding.device_set} <= {4, 5, 6, 7}
    assert np.isfinite(np.asarray(jax.device_get(leaf))).all()
