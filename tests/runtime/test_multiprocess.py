"""The Controller as a 2-process job (one process per role) under launch.multihost's supervisor.

Process 0 owns devices 0-3 (the trainer's slices of the demo topology), process 1 devices 4-7 (the
sampler's): weights cross by CrossMeshPush, rollouts by the coordination service. A deterministic run
ends with parameters bitwise equal to the same config in one process, also when either process is
SIGKILLed mid-run and the supervisor restarts the job from the trainer's checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rlax.runtime import Controller
from tiny import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVER = {"deterministic": True, "controller.steps": 6, "controller.max_staleness": 1}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return Controller(tiny_config(tmp_path_factory.mktemp("ref"), **OVER), progress=False).run()


def _steps_done(workdir):
  try:
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
      return max((json.loads(l)["step"] for l in f if l.strip()), default=-1) + 1
  except FileNotFoundError:
    return 0


def _checkpoints(workdir):
  d = os.path.join(workdir, "checkpoints")
  return [x for x in os.listdir(d) if x.isdigit()] if os.path.isdir(d) else []


# The trainer's process is killed (a lost sampler process is tests/test_multihost.py's, under the same supervisor).
@pytest.mark.parametrize("victim", [0])
def test_two_process_run_survives_a_kill_and_equals_one_process(tmp_path, reference, victim, own_devices_env):
  workdir = tmp_path / "run"
  over = [f"--config.{k}={v}" for k, v in OVER.items()]
  cmd = [sys.executable, "-m", "launch.multihost", "--num_processes=2", "--max_restarts=2",
         f"--process_logs={tmp_path}/logs", f"--pid_file={tmp_path}/pids.json", "--",
         sys.executable, "-m", "launch.main", "--cpu_devices=4", "--progress=false", "--config=configs/demo.py:tiny",
         f"--config.workdir={workdir}", *over]
  job = subprocess.Popen(cmd, cwd=ROOT, env=own_devices_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  # Kill once a checkpoint is finalized (an async save still in flight would leave nothing to resume from).
  while ((_steps_done(workdir) < 3 or not _checkpoints(workdir)) and job.poll() is None
         and time.time() < deadline):
    time.sleep(0.1)
  assert job.poll() is None, job.communicate()[1][-3000:]
  os.kill(json.loads((tmp_path / "pids.json").read_text())["pids"][victim], signal.SIGKILL)
  stdout, stderr = job.communicate(timeout=400)
  assert job.returncode == 0, stderr[-3000:]
  result = json.loads(stdout.strip().splitlines()[-1])
  assert result["ok"] and result["restarts"] == 1
  assert result["attempts"][0][victim] == -signal.SIGKILL and result["attempts"][1] == [0, 0]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["processes"] == 2 and summary["steps"] == 6 and not summary["preempted"]
  assert "resumed from checkpoint step" in (tmp_path / "logs" / "process_0.log").read_text()
  assert summary["params_sha256"] == reference["params_sha256"]


def test_two_process_packed_update_equals_one_process_padded(tmp_path, own_devices_env):
  """The trainer's packed rows (the default) in a 2-process job: the first update's metrics and parameters
  equal the padded rows' of a 1-process run (f32; AdamW's ~lr * sign(g) step compared at 1e-3 of lr)."""
  from safetensors.numpy import load_file
  over = {"deterministic": True, "controller.steps": 1, "controller.max_staleness": 0}
  padded = Controller(tiny_config(tmp_path / "padded", **over, **{"optimizer.pack_tokens": 0}), progress=False).run()
  workdir = tmp_path / "packed"
  cmd = [sys.executable, "-m", "launch.multihost", "--num_processes=2", f"--process_logs={tmp_path}/logs", "--",
         sys.executable, "-m", "launch.main", "--cpu_devices=4", "--progress=false", "--config=configs/demo.py:tiny",
         f"--config.workdir={workdir}", *[f"--config.{k}={v}" for k, v in over.items()]]
  job = subprocess.run(cmd, cwd=ROOT, env=own_devices_env, capture_output=True, text=True, timeout=400)
  assert job.returncode == 0, job.stderr[-3000:]
  rows = [json.loads((w / "logs" / "metrics.jsonl").read_text().splitlines()[0])
          for w in (tmp_path / "padded", workdir)]
  for k in ("loss", "pg_loss", "grad_norm", "entropy", "ratio_mean", "tokens", "logp_diff_mean"):
    np.testing.assert_allclose(rows[1][k], rows[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
  a = load_file(os.path.join(padded["export_dir"], "model.safetensors"))
  b = load_file(str(workdir / "export" / "model.safetensors"))
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-3 * 1e-4, err_msg=k)
