"""The single-controller runtime on 8 fake CPU devices: submeshes, weight sync, staleness, resume."""

import jax
import numpy as np
import pytest

from configs import algorithm
from rlax import run as run_lib
from rlax.runtime import Controller
from tiny import tiny_config


def _params_equal(a, b):
  a, b = jax.device_get(a), jax.device_get(b)  # they live on different submeshes
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_synchronous_k0_versions_and_weight_sync(tmp_path):
  c = tiny_config(tmp_path, **{"controller.max_staleness": 0, "deterministic": True})
  ctl = Controller(c, progress=False)
  trainer_devs = set(ctl.topo.trainer_mesh.devices.flat)
  sampler_devs = set(ctl.topo.sampler_mesh.devices.flat)
  assert trainer_devs and sampler_devs and not trainer_devs & sampler_devs  # disjoint submeshes
  out = ctl.run()
  assert out["steps"] == 4 and not out["preempted"]
  rows = ctl.metrics.history
  assert [r["staleness"] for r in rows] == [0.0] * 4  # every sample came from the trainer's own version
  assert out["staleness_hist"] == {"0": 4}
  # The trained batch's shape and its micro-batch split are in every row (what sizes the step's memory).
  # The batch ran in one of the run's programs (rlax.run.train_plan), in the micro-batches that hold its rows;
  # they were compiled before the first step, so no row after the first counts a compile.
  progs = run_lib.train_plan(ctl.run_cfg, ctl.trainer).programs
  for r in rows:
    p = next(p for p in progs if p.length == r["train_row_len"])
    assert 1 <= r["micro_batches"] <= p.micro_batches
    assert r["train_rows"] == (r["micro_batches"] * p.micro_rows if p.packed else p.rows)
  assert [r["compiles"] for r in rows[1:]] == [0.0] * 3 and rows[0]["compile_s"] >= 0
  # After the last push the sampler holds exactly the trainer's weights, on the sampler's devices.
  sampler_params, version = ctl.weights.latest()
  assert version == 4
  assert _params_equal(sampler_params, ctl.final_state.params)
  for leaf in jax.tree.leaves(sampler_params):
    assert set(leaf.sharding.device_set) <= sampler_devs


def test_k2_staleness_bounded_and_recorded(tmp_path):
  c = tiny_config(tmp_path, **{"controller.max_staleness": 2, "controller.queue_size": 3,
                               "controller.steps": 6})
  ctl = Controller(c, progress=False)
  ctl.run()
  stale = [r["staleness"] for r in ctl.metrics.history]
  assert len(stale) == 6 and max(stale) <= 2 and min(stale) >= 0


def test_preempted_run_resumes_bitwise_equal(tmp_path):
  over = {"controller.max_staleness": 1, "deterministic": True, "controller.steps": 5}
  ref = Controller(tiny_config(tmp_path / "ref", **over), progress=False)
  ref.run()

  def stop_after_2(ctl, step, row):
    if step == 1:
      ctl.request_stop()

  first = Controller(tiny_config(tmp_path / "run", **over), progress=False, callbacks=[stop_after_2])
  out = first.run()
  assert out["preempted"] and out["steps"] == 2
  second = Controller(tiny_config(tmp_path / "run", **over), progress=False)
  out = second.run()
  assert out["steps"] == 5 and not out["preempted"]
  assert [r["step"] for r in second.metrics.history] == list(range(5))  # history survived the restart
  assert _params_equal(second.final_state.params, ref.final_state.params)


def test_contradictory_config_fails_with_field_name(tmp_path):
  c = tiny_config(tmp_path, **{"controller.push_every": 4, "controller.max_staleness": 0})
  with pytest.raises(ValueError, match="push_every"):
    Controller(c, progress=False)
  c = tiny_config(tmp_path, **{"rollout.samples_per_prompt": 1})
  with pytest.raises(ValueError, match="samples_per_prompt"):
    Controller(c, progress=False)


def test_dynamic_sampling_drops_tied_groups_and_keeps_batch_shape(tmp_path):
  c = tiny_config(tmp_path, **{"controller.dynamic_sampling": True, "controller.steps": 2,
                               "rollout.samples_per_prompt": 2})
  ctl = Controller(c, progress=False, reward_fn=lambda text, record: (float(len(text) % 2), {}))
  seen = []
  step = ctl.trainer.step

  def recording_step(state, batch):
    seen.append(np.asarray(batch.rewards))
    return step(state, batch)

  ctl.trainer.step = recording_step
  ctl.run()
  assert len(seen) == 2
  for rewards, row in zip(seen, ctl.metrics.history):
    assert rewards.shape == (4 * 2,)
    assert row["dyn_dropped_groups"] > 0  # random rewards: some groups tied and were refilled
    groups = rewards.reshape(4, 2)
    n_tied = int(np.sum(groups.max(1) == groups.min(1)))
    assert n_tied == row["dyn_tied_in_batch"]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "cispo"])
def test_every_algorithm_preset_trains(tmp_path, name):
  """What configs/algorithm.py offers runs: each preset's algorithm section on the tiny model, 2 steps."""
  preset = algorithm.get_config(name)
  c = tiny_config(tmp_path, **{"algorithm": preset.algorithm, "controller.steps": 2,
                               "controller.dynamic_sampling": preset.controller.dynamic_sampling})
  ctl = Controller(c, progress=False)
  out = ctl.run()
  assert out["steps"] == 2 and not out["preempted"]
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in ctl.metrics.history)
  assert ctl.run_cfg.algorithm.name == name and (ctl.run_cfg.algorithm.kl_coef > 0) == (name == "grpo")


def test_trainer_steps_run_under_a_transfer_guard(tmp_path):
  """One host→device crossing per rollout: from step 1 on, the trainer thread's whole step (place the
  numpy batch, reference log-probs, update, push, metrics, checkpoint) runs with implicit transfers
  disallowed; only explicit device_put / device_get may move data."""
  guard = jax.transfer_guard("disallow")  # thread-local: the trainer thread only

  def toggle(ctl, step, row):
    if step == 0:
      guard.__enter__()
    elif step == 3:
      guard.__exit__(None, None, None)

  c = tiny_config(tmp_path, **{"algorithm.kl_coef": 0.04, "checkpoint.every_steps": 1})
  out = Controller(c, progress=False, callbacks=[toggle]).run()
  assert out["steps"] == 4 and not out["preempted"]


@pytest.mark.parametrize("sft_steps", [0, 3])
def test_kl_reference_is_the_starting_policy_after_a_resume(tmp_path, sft_steps):
  over = {"algorithm.kl_coef": 0.1, "init.sft_steps": sft_steps, "init.sft_batch": 8, "controller.steps": 3}

  def stop_after_1(ctl, step, row):
    if step == 0:
      ctl.request_stop()

  reward = lambda text, record: (float(len(text) % 2), {})  # varies, so the policy moves away from the start
  first = Controller(tiny_config(tmp_path, **over), progress=False, callbacks=[stop_after_1], reward_fn=reward)
  assert first.run()["preempted"]
  start = jax.device_get(first.ref_params)  # the policy RL started from (after any warm start)
  second = Controller(tiny_config(tmp_path, **over), progress=False, reward_fn=reward)
  assert second.run()["steps"] == 3
  assert _params_equal(second.ref_params, start)
  assert not _params_equal(second.final_state.params, start)


def test_eval_every_records_the_held_out_curve(tmp_path):
  """eval.every=2 over 5 steps: held-out pass@k after steps 2 and 4 (the newest weights, beside the running
  producer) in those steps' rows, and the curve 0, 2, 4, 5 in the summary, its ends the before/after figures."""
  ctl = Controller(tiny_config(tmp_path, **{"controller.steps": 5, "eval.every": 2}), progress=False)
  out = ctl.run()
  rows = ctl.metrics.history
  assert [r["step"] for r in rows if "eval_pass1" in r] == [1, 3]
  n = ctl.run_cfg.eval.n_samples
  assert all(0 <= r["eval_pass1"] <= r[f"eval_pass{n}"] <= 1 and r["eval_s"] > 0 for r in rows if "eval_pass1" in r)
  assert out["curve"]["step"] == [0, 2, 4, 5]
  assert out["curve"]["pass1"] == [out["pass1_before"], rows[1]["eval_pass1"], rows[3]["eval_pass1"],
                                   out["pass1_after"]]
