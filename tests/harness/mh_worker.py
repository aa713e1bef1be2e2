"""One process of a 2-process CPU test job (started by `launch.multihost`); trainer on process 0, sampler on 1.

  python -m launch.multihost --num_processes=2 -- python tests/harness/mh_worker.py --mode=push --out=/tmp/w.npz

--mode=push: process 0 creates a tiny model's parameters on the trainer mesh and pushes them once;
  process 1 saves what it received (bf16 as uint16 bits) to --out.
--mode=steps: --steps trainer updates, each followed by a push; process 0 checkpoints (step, params) to
  --workdir after every step and a restarted job resumes from it. Process 1 checks each pushed version
  and saves the last one to --out when given.
"""

import json
import os
import time

from absl import app, flags

from launch.flags_util import define_cpu_devices

MODE = flags.DEFINE_enum("mode", "push", ["push", "steps"], "What the job does.")
OUT = flags.DEFINE_string("out", "", "push mode: where process 1 saves the received weights (.npz).")
WORKDIR = flags.DEFINE_string("workdir", "", "steps mode: checkpoint and progress directory.")
STEPS = flags.DEFINE_integer("steps", 10, "steps mode: number of updates.")
STEP_S = flags.DEFINE_float("step_s", 0.2, "steps mode: sleep per step (gives a test time to kill one).")
CPU_DEVICES = define_cpu_devices(4)
SEED = flags.DEFINE_integer("seed", 0, "Parameter seed.")


def tiny_model():
  from rlax import models as M
  return M.preset("w1").replace(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                mlp_dim=128)


def topology_config(cpu_devices: int) -> dict:
  """One simulated slice per process: slice 0 (process 0) trains, slice 1 (process 1) samples."""
  return dict(slice_size=cpu_devices, trainer_slices=1, sampler_slices=1, trainer_mesh=dict(fsdp=-1),
              sampler_mesh=dict(data=2, tensor=-1))


def stand_in_update(params):
  """The job's stand-in optimizer step, w -> w / 2 + 1 (exact to check: w_s = (w_0 - 2) / 2^s + 2)."""
  import jax
  return jax.tree.map(lambda x: x * 0.5 + 1.0, params)


def _save_bits(path, tree):
  import jax
  import numpy as np
  flat = {jax.tree_util.keystr(k): np.asarray(v).view(np.uint16) for k, v in jax.tree.flatten_with_path(tree)[0]}
  np.savez(path + ".tmp.npz", **flat)
  os.replace(path + ".tmp.npz", path)


def main(argv):
  del argv
  from rlax import multihost
  pid, _ = multihost.init_from_env(cpu_devices=CPU_DEVICES.value)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from rlax import models as M
  from rlax.topology import build_topology
  cfg = tiny_model()
  topo = build_topology(topology_config(CPU_DEVICES.value))
  push = multihost.CrossMeshPush(topo.trainer_mesh, topo.sampler_mesh, M.param_shardings(cfg, topo.sampler_mesh),
                                 dtype=jnp.bfloat16)
  shapes = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
  if MODE.value == "push":
    params = M.create_params(cfg, topo.trainer_mesh, seed=SEED.value) if pid == 0 else None
    t0 = time.perf_counter()
    out = push(params, shapes=shapes)
    if out is not None:
      jax.block_until_ready(out)
      print(json.dumps({"process": pid, "push_s": time.perf_counter() - t0}), flush=True)
      _save_bits(OUT.value, out)
    return
  os.makedirs(WORKDIR.value, exist_ok=True)
  ckpt = os.path.join(WORKDIR.value, "ckpt.npz")
  start = int(np.load(ckpt)["step"]) if os.path.exists(ckpt) else 0
  print(json.dumps({"process": pid, "attempt": os.environ.get("RLAX_ATTEMPT"), "resume_step": start}), flush=True)
  params = None
  if pid == 0:
    params = M.create_params(cfg, topo.trainer_mesh, seed=SEED.value)
    if start:
      saved = np.load(ckpt)
      names = jax.tree_util.tree_map_with_path(lambda k, _: jax.tree_util.keystr(k), params)
      params = jax.tree.map(lambda x, n: jax.device_put(saved[n], x.sharding), params, names)
  update = jax.jit(stand_in_update)
  for step in range(start, STEPS.value):
    if pid == 0:
      params = update(params)
    out = push(params, shapes=shapes)
    if pid == 1:
      # After step s every weight w_s = (w_0 - 2) / 2^(s+1) + 2, so the norm weights (w_0 = 1) are known.
      want = (1.0 - 2.0) / 2.0 ** (step + 1) + 2.0
      got = float(out["final_norm"][0].astype(jnp.float32))
      if abs(got - float(jnp.bfloat16(want))) > 1e-6:
        raise SystemExit(f"sampler got final_norm {got} after step {step}, expected {want}")
    if pid == 0:
      flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.flatten_with_path(params)[0]}
      np.savez(ckpt + ".tmp.npz", step=step + 1, **flat)
      os.replace(ckpt + ".tmp.npz", ckpt)
    with open(os.path.join(WORKDIR.value, f"progress_{pid}.txt"), "w") as f:
      f.write(str(step + 1))
    time.sleep(STEP_S.value)
  if pid == 1 and OUT.value:
    _save_bits(OUT.value, out)
  print(json.dumps({"process": pid, "done": STEPS.value}), flush=True)


if __name__ == "__main__":
  app.run(main)
