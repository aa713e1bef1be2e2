"""What a run does with bad numbers and bad endings: non-finite rewards/updates, corrupt checkpoints, signals."""

import json
import os
import zlib

import jax
import numpy as np
import pytest

from rlax import builders
from rlax.runtime import Controller, NonFiniteError
from tiny import tiny_config


def _finite(tree) -> bool:
  return all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(tree)))


def _nan_for_about_one_in_three():
  # Stateless (graders run in several processes, so a shared call counter would not be shared): NaN for
  # about one completion in three, by a hash of its text that is the same in every process.
  return lambda text, record: (float("nan") if zlib.crc32(text.encode()) % 3 == 0 else float(len(text) % 2), {})


def test_nonfinite_rewards_skip_the_batch_and_never_reach_params_or_checkpoints(tmp_path):
  c = tiny_config(tmp_path, **{"checkpoint.every_steps": 1, "controller.steps": 3})
  ctl = Controller(c, progress=False, reward_fn=_nan_for_about_one_in_three())
  out = ctl.run()
  assert out["steps"] == 3 and not out["preempted"]
  rows = ctl.metrics.history
  assert [r["nonfinite_skipped"] for r in rows] == [1.0] * 3  # 16 rows per batch: every batch has a NaN
  assert out["nonfinite_skipped"] == 3
  assert _finite(ctl.final_state)
  # Skipped batches leave the parameters exactly as they started.
  init = builders.initial_params(ctl.run_cfg, ctl.topo.trainer_mesh)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(init)),
                                                 jax.tree.leaves(jax.device_get(ctl.final_state.params))))
  assert ctl.run_state.ckpt.all_steps()[-1] == 3
  _, tree, _ = ctl.run_state.ckpt.restore(3, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                          sharding=x.sharding), {"train": ctl.final_state, "pending": []}))
  assert _finite(tree["train"])
  lines = [json.loads(ln) for ln in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
  assert [r["step"] for r in lines] == [0, 1, 2] and all(r["reward"] is None for r in lines)  # strict JSON


def test_nonfinite_rewards_stop_with_one_line(tmp_path):
  c = tiny_config(tmp_path, **{"controller.on_nonfinite": "stop"})
  ctl = Controller(c, progress=False, reward_fn=_nan_for_about_one_in_three())
  with pytest.raises(NonFiniteError, match=r"step 0: \d+ of 16 rewards are not finite \(nan"):
    ctl.run()
  assert ctl.run_state.ckpt.all_steps() == [] or _finite(ctl.final_state)


def test_on_nonfinite_is_validated(tmp_path):
  with pytest.raises(ValueError, match="controller.on_nonfinite='sometimes'"):
    Controller(tiny_config(tmp_path, **{"controller.on_nonfinite": "sometimes"}), progress=False)


def test_nonfinite_loss_is_skipped_inside_the_step(tmp_path):
  """NaN rewards that reach the step (the host check bypassed) make the loss NaN: the jitted step's guard keeps the state
  and the controller skips that batch; the next one trains."""
  c = tiny_config(tmp_path, **{"controller.steps": 2, "checkpoint.every_steps": 1})
  ctl = Controller(c, progress=False)
  step, states = ctl.trainer.step, []

  def poisoned_first_step(state, batch):
    if not states:
      batch = batch.replace(rewards=batch.rewards * np.nan)  # past the host check: the guard must catch it
    states.append(jax.device_get(state.params))
    return step(state, batch)

  ctl.trainer.step = poisoned_first_step
  out = ctl.run()
  assert out["steps"] == 2 and out["nonfinite_skipped"] == 1
  rows = ctl.metrics.history
  assert [r["nonfinite_skipped"] for r in rows] == [1.0, 0.0] and not np.isfinite(rows[0]["loss"])
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])))
  assert _finite(ctl.final_state) and int(ctl.final_state.step) == 1


def test_a_nonfinite_state_is_never_checkpointed(tmp_path):
  ctl = Controller(tiny_config(tmp_path), progress=False)
  state = ctl.trainer.init_state(builders.initial_params(ctl.run_cfg, ctl.topo.trainer_mesh))
  bad = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
  kw = dict(pending=[], data_state={}, version=0, history=[], eval_before=None)
  with pytest.raises(NonFiniteError, match="refusing to checkpoint step 1"):
    ctl.run_state.save(1, bad, **kw)
  ctl.run_state.save(1, state, **kw)
  ctl.run_state.wait()
  assert ctl.run_state.ckpt.all_steps() == [1]
  ctl.run_state.close()


_CURRENT = [None]  # the controller that _stop_sft_after signals
SFT = {"init.sft_steps": 6, "init.sft_batch": 8, "algorithm.kl_coef": 0.1, "controller.steps": 2}


def _stop_sft_after(monkeypatch, n, calls):
  """builders.sft_trainer whose updates are counted in `calls`; the n-th sends a preemption notice."""
  make = builders.sft_trainer

  def counting(run, mesh):
    sft = make(run, mesh)
    step = sft.sft_step

    def sft_step(state, batch):
      calls.append(1)
      if len(calls) == n:
        _CURRENT[0].request_stop()
      return step(state, batch)
    sft.sft_step = sft_step
    return sft
  monkeypatch.setattr(builders, "sft_trainer", counting)


def test_preemption_during_the_warm_start_saves_it_and_the_rerun_continues(tmp_path, monkeypatch):
  ref = Controller(tiny_config(tmp_path / "ref", **SFT), progress=False)
  assert ref.run()["steps"] == 2
  calls = []
  _stop_sft_after(monkeypatch, 3, calls)
  first = Controller(tiny_config(tmp_path / "run", **SFT), progress=False)
  _CURRENT[0] = first
  out = first.run()
  _CURRENT[0] = None
  assert out["preempted"] and out["steps"] == 0 and out["sft_steps_done"] == 3 and len(calls) == 3
  assert json.load(open(tmp_path / "run" / "summary.json"))["sft_steps_done"] == 3
  second = Controller(tiny_config(tmp_path / "run", **SFT), progress=False)
  out = second.run()
  assert out["steps"] == 2 and not out["preempted"] and len(calls) == 6  # 3 more updates, not 6
  # The warm start ended where an uninterrupted one does (its optimizer state was saved too).
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(second.ref_params)),
                                                 jax.tree.leaves(jax.device_get(ref.ref_params))))
  assert second.run_state.ckpt.all_steps() == [0, 2]  # step 0: the weights RL started from


def test_trainer_slice_lost_before_the_first_periodic_checkpoint_restarts_from_step_0(tmp_path):
  c = tiny_config(tmp_path, **{"faults.lose_slice_at": "0:1", "checkpoint.every_steps": 3, "controller.steps": 3})
  ctl = Controller(c, progress=False)
  out = ctl.run()
  assert out["steps"] == 3 and not out["preempted"] and out["failovers"] == 1
  (event,) = [e for e in map(json.loads, open(tmp_path / "failover.jsonl")) if e.get("event") == "recovered"]
  assert event["resume_step"] == 0 and event["steps_lost"] == 1
  assert [r["step"] for r in map(json.loads, open(tmp_path / "logs" / "metrics.jsonl"))] == [0, 1, 2]


def _truncate_newest(workdir) -> int:
  ck = os.path.join(workdir, "checkpoints")
  step = max(int(d) for d in os.listdir(ck) if d.isdigit())
  for root, _, files in os.walk(os.path.join(ck, str(step), "state")):
    for f in files:
      if os.path.basename(root) == "d":
        os.truncate(os.path.join(root, f), os.path.getsize(os.path.join(root, f)) // 2)
  return step


# A failed tensorstore read leaves a callback on orbax's closed asyncio loop: noise from orbax, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_latest_checkpoint_then_every_rerun_finishes(tmp_path):
  over = {"controller.steps": 3, "checkpoint.every_steps": 1}
  assert Controller(tiny_config(tmp_path, **over), progress=False).run()["steps"] == 3
  assert _truncate_newest(tmp_path) == 3
  for _ in range(2):  # the rerun retrains step 3 and saves it again; the one after finds it done
    ctl = Controller(tiny_config(tmp_path, **over), progress=False)
    out = ctl.run()
    assert out["steps"] == 3 and not out["preempted"]
    assert ctl.run_state.ckpt.all_steps()[-1] == 3
    # One row per step in the file, whatever was retrained.
    assert [r["step"] for r in map(json.loads, open(tmp_path / "logs" / "metrics.jsonl"))] == [0, 1, 2]
  assert len([p for p in os.listdir(tmp_path / "checkpoints") if p.startswith("3.unreadable.")]) == 1
