"""Multi-host without Pathways: the collective weight push, 2 processes on 127.0.0.1, the restart supervisor."""

import json
import os
import signal
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import mh_worker
from launch._supervisor import Supervisor
from rlax import models as M
from rlax import multihost
from rlax.topology import build_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "harness", "mh_worker.py")


def _bits(x):
  return np.asarray(x).view(np.uint16)


def _single_process_push(steps=0):
  """The same updates and push as the 2-process job, with both roles in this process's 8 devices."""
  cfg = mh_worker.tiny_model()
  topo = build_topology(mh_worker.topology_config(4))
  params = M.create_params(cfg, topo.trainer_mesh, seed=0)
  update = jax.jit(mh_worker.stand_in_update)
  for _ in range(steps):
    params = update(params)
  dst = M.param_shardings(cfg, topo.sampler_mesh)
  push = multihost.CrossMeshPush(topo.trainer_mesh, topo.sampler_mesh, dst, dtype=jnp.bfloat16)
  return params, push(params), dst


def test_push_in_one_process_is_exact_and_lands_on_sampler_shardings():
  params, out, dst = _single_process_push()
  for a, b, sh in zip(jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(dst)):
    assert b.dtype == jnp.bfloat16
    assert b.sharding.is_equivalent_to(sh, b.ndim)
    np.testing.assert_array_equal(_bits(a.astype(jnp.bfloat16)), _bits(b))


@pytest.mark.parametrize("trainer_shape,src_spec,sampler_shape,dst_spec", [
    ((1, 2, 2), (None, "fsdp", None, "tensor"), (2, 2, 1), (None, "fsdp", None, None)),
    # the trainer leaves 'data' unused: the push first splits the leaf over it on the trainer mesh
    ((2, 2, 1), (None, "fsdp", None, None), (1, 2, 2), (None, "fsdp", "tensor", None))])
def test_push_moves_pieces_never_whole_leaves(trainer_shape, src_spec, sampler_shape, dst_spec):
  """A trainer mesh pushing to a sampler mesh of another shape, an expert-like leaf whose splits sit on other
  dims on each side: no part of the push holds a whole leaf (the old transport layout did here: 1.5 leaves of
  temporaries in the first case; 290 GiB a chip for Qwen3-235B on 512 v5p chips, 4.3 GiB now), and the sampler
  receives the trainer's values exactly on its own sharding."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = np.asarray(jax.devices()[:8])
  trainer = Mesh(devs[:4].reshape(trainer_shape), ("data", "fsdp", "tensor"))
  sampler = Mesh(devs[4:].reshape(sampler_shape), ("data", "fsdp", "tensor"))
  shape = (4, 16, 512, 256)  # [L, E, D, F]: 32 MiB in f32
  src, dst = NamedSharding(trainer, P(*src_spec)), NamedSharding(sampler, P(*dst_spec))
  x = jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape), src)
  push = multihost.CrossMeshPush(trainer, sampler, [dst])
  leaf = np.prod(shape) * 4
  for name, low in push.lowered([jax.ShapeDtypeStruct(shape, jnp.float32, sharding=src)]).items():
    assert low.compile().memory_analysis().temp_size_in_bytes < leaf, name
  out = push([x])[0]
  assert out.sharding.is_equivalent_to(dst, 4)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


def test_push_rejects_unequal_or_overlapping_meshes():
  cfg = mh_worker.tiny_model()
  topo = build_topology(dict(slice_size=2, trainer_slices=1, sampler_slices=3))
  with pytest.raises(ValueError, match="equal device counts per role"):
    multihost.CrossMeshPush(topo.trainer_mesh, topo.sampler_mesh, M.param_shardings(cfg, topo.sampler_mesh))
  topo = build_topology(dict(slice_size=4, trainer_slices=1, colocated=True))
  with pytest.raises(ValueError, match="disjoint meshes"):
    multihost.CrossMeshPush(topo.trainer_mesh, topo.sampler_mesh, M.param_shardings(cfg, topo.sampler_mesh))


def _run_job(tmp_path, env, worker_args, max_restarts=0, timeout=240):
  cmd = [sys.executable, "-m", "launch.multihost", "--num_processes=2", f"--max_restarts={max_restarts}",
         f"--process_logs={tmp_path}/logs", f"--pid_file={tmp_path}/pids.json", "--",
         sys.executable, WORKER, *worker_args]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(pred, timeout, what):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if pred():
      return
    time.sleep(0.1)
  raise AssertionError(f"timed out waiting for {what}")


def _progress(tmp_path, pid):
  try:
    return int((tmp_path / "job" / f"progress_{pid}.txt").read_text() or 0)
  except (FileNotFoundError, ValueError):
    return 0


def test_two_processes_survive_a_kill_and_match_single_process_bit_for_bit(tmp_path, own_devices_env):
  """2 processes x 4 CPU devices: 12 updates + pushes; process 1 is killed after 3; the supervisor restarts
  the job, which resumes from process 0's checkpoint; the sampler's final weights equal, bit for bit,
  the same 12 updates + push run in this one process."""
  steps = 12
  out = tmp_path / "w.npz"
  job = _run_job(tmp_path, own_devices_env, ["--mode=steps", f"--steps={steps}", "--step_s=0.3",
                                             f"--workdir={tmp_path}/job", f"--out={out}"], max_restarts=2)
  _wait_for(lambda: _progress(tmp_path, 1) >= 3, 200, "3 steps of the first attempt")
  victim = json.loads((tmp_path / "pids.json").read_text())["pids"][1]
  os.kill(victim, signal.SIGKILL)  # the sampler process dies mid-run
  stdout, stderr = job.communicate(timeout=240)
  assert job.returncode == 0, stderr[-3000:]
  result = json.loads(stdout.strip().splitlines()[-1])
  assert result["ok"] and result["restarts"] == 1
  assert result["attempts"][0][1] == -signal.SIGKILL and result["attempts"][1] == [0, 0]
  assert _progress(tmp_path, 0) == steps and _progress(tmp_path, 1) == steps
  logs = [json.loads(l) for l in (tmp_path / "logs" / "process_1.log").read_text().splitlines()
          if l.startswith("{")]
  starts = [l for l in logs if "resume_step" in l]
  assert starts[0] == {"process": 1, "attempt": "0", "resume_step": 0}
  assert starts[1]["attempt"] == "1" and starts[1]["resume_step"] >= 3  # resumed from the checkpoint
  assert {"process": 1, "done": steps} in logs
  got = np.load(out)
  _, single, _ = _single_process_push(steps)
  flat = jax.tree.flatten_with_path(single)[0]
  assert sorted(got.files) == sorted(jax.tree_util.keystr(k) for k, _ in flat)
  for k, v in flat:
    np.testing.assert_array_equal(got[jax.tree_util.keystr(k)], _bits(v))


def test_supervisor_gives_up_after_max_restarts(tmp_path):
  code = "import os, sys; sys.exit(3 if os.environ['RLAX_PROCESS_ID'] == '1' else 0)"
  result = Supervisor([sys.executable, "-c", code], 2, max_restarts=1, poll_s=0.02).run()
  assert not result["ok"] and result["restarts"] == 1
  assert [a[1] for a in result["attempts"]] == [3, 3]  # process 0 may be stopped (-15) or done (0)


def test_supervisor_env_and_substitution(tmp_path):
  code = ("import os, sys; p = os.environ['RLAX_PROCESS_ID']; assert sys.argv[1] == 'w' + p; "
          "assert os.environ['RLAX_NUM_PROCESSES'] == '3'; "
          "sys.exit(0 if os.environ['RLAX_ATTEMPT'] == '1' or p != '2' else 5)")
  result = Supervisor([sys.executable, "-c", code, "w{process_id}"], 3, max_restarts=2, poll_s=0.02).run()
  assert result["ok"] and result["restarts"] == 1 and result["attempts"][1] == [0, 0, 0]
  assert result["attempts"][0][2] == 5


def test_maybe_init_pathways(monkeypatch):
  monkeypatch.delenv("RLAX_NO_PATHWAYS", raising=False)
  calls = []
  monkeypatch.setitem(sys.modules, "pathwaysutils", types.SimpleNamespace(initialize=lambda: calls.append(1)))
  assert multihost.maybe_init_pathways() is True and calls == [1]
  monkeypatch.setenv("RLAX_NO_PATHWAYS", "1")
  assert multihost.maybe_init_pathways() is False and calls == [1]
  monkeypatch.delenv("RLAX_NO_PATHWAYS")
  monkeypatch.setitem(sys.modules, "pathwaysutils", None)  # import fails: not installed
  assert multihost.maybe_init_pathways() is False


def test_init_from_env_names_missing_variables(monkeypatch):
  for k in ("RLAX_COORDINATOR", "RLAX_NUM_PROCESSES", "RLAX_PROCESS_ID"):
    monkeypatch.delenv(k, raising=False)
  with pytest.raises(ValueError, match="launch.multihost"):
    multihost.init_from_env()
