"""AOT plan: the real programs compile for a small two-slice topology and their numbers add up."""

import importlib.util
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import paper_qwq32b
from rlax import builders
from rlax import run as run_lib
from rlax import config as config_lib
from rlax import models as M
from rlax import planning
from rlax.multihost import transport_spec
from rlax.topology import build_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = list(planning.PROGRAMS)


def tiny_config(topology="local"):
  """The paper config shrunk (same code path): a 2-layer model on 2 slices of 4 devices."""
  c = paper_qwq32b.get_config("tiny")
  c.rollout.on_swap = "recompute"  # so the plan compiles the recompute too (the paper's sizes keep caches)
  if topology != "local":
    c.topology.slice_size = None  # TPU devices carry their slice_index
    c.plan.topology = topology
  return c


def _shard_bytes(shape, dtype, sharding):
  return int(np.prod(sharding.shard_shape(tuple(shape)))) * jnp.dtype(dtype).itemsize


@pytest.fixture(scope="module")
def local_plan():
  c = tiny_config()
  return c, planning.make_plan(c)


def test_local_plan_compiles_every_program(local_plan):
  _, t = local_plan
  progs = {p["name"]: p for p in t["programs"]}
  # the run's further train programs (e.g. the padded one kept beside the packed) are named trainer_step[...]
  assert [n for n in progs if not n.startswith("trainer_step[")] == NAMES
  for p in progs.values():
    assert p["argument_bytes"] > 0 and p["output_bytes"] > 0 and p["peak_bytes"] > 0, p
    assert p["compile_s"] > 0
  assert progs["trainer_step"]["flops"] > 0 and progs["sampler_decode"]["flops"] > 0
  assert t["estimates"]["train_step_s"] > 0 and t["estimates"]["sampler_tokens_per_s"] > 0


def test_trainer_memory_matches_parameter_count(local_plan):
  """Trainer args per chip = (params + 2 AdamW moments) shards + batch shards, from the shardings alone."""
  c, t = local_plan
  cfg = M.preset("w1", **c.model.overrides.to_dict())
  topo = build_topology(c.topology)
  mesh = topo.trainer_mesh
  shapes = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
  shard = M.param_shardings(cfg, mesh)
  params = sum(_shard_bytes(s.shape, s.dtype, sh) for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shard)))
  # The packed rows of real tokens at their largest: 4 int32 [R, L] model inputs, 3 int32 and 2 (3 with a
  # reference) f32 [R, K] scored-slot fields, 3 per-sequence [16] fields.
  run = config_lib.load(c)
  trainer = builders.trainer(run, mesh)
  prog = run_lib.train_plan(run, trainer).largest_micro_batch(mesh)
  R, L = prog.rows, prog.length
  K = prog.packed.slots if prog.packed else L - 1
  row_sh = NamedSharding(mesh, P(("data", "fsdp")))
  f32_slots = 3 if run.algorithm.kl_coef > 0 else 2
  batch = (4 * _shard_bytes((R, L), jnp.int32, row_sh) + (3 + f32_slots) * _shard_bytes((R, K), jnp.int32, row_sh)
           + 3 * _shard_bytes((16,), jnp.int32, row_sh))
  got = {p["name"]: p for p in t["programs"]}["trainer_step"]["argument_bytes"]
  # jit prunes batch fields the loss does not read (e.g. versions); step and optimizer counts are scalars.
  assert 3 * params < got <= 3 * params + batch + 64, (got, params, batch)
  # The donated state comes back in place: outputs alias the params + moments.
  assert {p["name"]: p for p in t["programs"]}["trainer_step"]["alias_bytes"] >= 3 * params
  assert t["config"]["params"] == cfg.num_params()


def test_push_programs_move_each_byte_once(local_plan):
  """The cross-role program's per-chip input is the transport piece: total parameter bytes / 4 devices."""
  _, t = local_plan
  progs = {p["name"]: p for p in t["programs"]}
  push = t["estimates"]["push"]
  total = push["total_bytes"]
  assert total == t["config"]["params"] * 4  # float32 tiny model
  assert push["per_chip_transport_bytes"] == total // 4
  assert progs["push_cross"]["argument_bytes"] == total // 4
  assert push["link"] == "ici"  # simulated slices on one CPU backend have no slice_index: same "slice"
  assert push["seconds"] == pytest.approx(push["transport_s"] + push["cross_s"] + push["gather_s"])


def test_decode_row_counts_weights_and_cache(local_plan):
  """The engine's decode chunk (dense layout on CPU): per-chip weights + cache from the shardings; its bytes per
  token step are XLA's count of the chunk (layers unrolled; no kernel on CPU)."""
  c, t = local_plan
  cfg = M.preset("w1", **c.model.overrides.to_dict())
  row = {p["name"]: p for p in t["programs"]}["sampler_decode"]
  d = t["estimates"]["decode"]
  mesh = build_topology(c.topology).sampler_mesh  # data 2 x tensor 2
  shapes = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
  shard = M.param_shardings(cfg, mesh)
  weights = sum(_shard_bytes(s.shape, s.dtype, sh) for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shard)))
  # 8 slots x (16 prompt + 16 new) tokens x 2 KV heads x 16 dims, f32, K and V: slots over data, heads over tensor.
  kv = 2 * cfg.n_layers * (8 // 2) * 32 * (2 // 2) * 16 * 4
  assert (d["weights_bytes"], d["kv_bytes"], d["layout"], d["slots"]) == (weights, kv, "dense", 8)
  assert d["kernel_bytes"] == 0 and d["step_bytes"] == d["xla_step_bytes"] > 0
  assert d["ratio"] == pytest.approx(d["step_bytes"] / (weights + kv))
  # The slot state is donated and comes back in place; the chunk reads at least the weights and the cache.
  assert row["alias_bytes"] >= kv and row["argument_bytes"] >= weights + kv
  assert row["est_bytes"] == d["step_bytes"]
  assert t["estimates"]["decode_token_step_s"] == pytest.approx(row["roofline_s"])


def test_plan_programs_selects_what_compiles():
  c = tiny_config()
  c.plan.programs = "sampler_decode, push_cross"
  t = planning.make_plan(c)
  assert [p["name"] for p in t["programs"]] == ["sampler_decode", "push_cross"]
  assert "train_step_s" not in t["estimates"] and "decode" in t["estimates"]
  from launch._plan_table import format_table
  assert "decode step >=" in format_table(t) and "train step" not in format_table(t)
  c.plan.programs = "sampler_decoder"
  with pytest.raises(ValueError, match="unknown program.*sampler_decoder"):
    planning.make_plan(c)


def test_plan_compiles_every_train_program_and_the_runs_admissions():
  """The run's own sizes: every train program of `train_plan` (here packed and padded), the sampler with the
  slots the runtime gives it (rollout.slots=0: the batch's rows) and the full admission of each group size
  that admits more prompts than the rollout's (eval.n_samples=2: 8 prompts against 4)."""
  c = tiny_config()
  c.optimizer.share_prompts = False  # the padded program joins the packed one
  c.rollout.slots, c.eval.n_samples = 0, 2
  c.plan.programs = "trainer_step,sampler_prefill"
  t = planning.make_plan(c)
  run = config_lib.load(c)
  topo = build_topology(run.topology)
  trainer = builders.trainer(run, topo.trainer_mesh)
  plan = run_lib.train_plan(run, trainer)
  largest = plan.largest_micro_batch(trainer.mesh)
  assert len(plan.programs) == 2
  names = ["trainer_step"] + [f"trainer_step[{p.rows}x{p.length}{'' if p.packed else ',padded'}]"
                              for p in plan.programs if p != largest]
  progs = {p["name"]: p for p in t["programs"]}
  assert list(progs) == names + ["sampler_prefill", "sampler_prefill[8x2]"]
  assert [(p["rows"], p["length"], p["micro_batches"]) for p in t["config"]["train_programs"]] == [
      (p.rows, p.length, p.micro_batches) for p in [largest] + [p for p in plan.programs if p != largest]]
  for name in names:  # each compiled and checked; the same analytic count (one batch's tokens)
    assert progs[name]["argument_bytes"] > 0 and progs[name]["est_flops"] == progs["trainer_step"]["est_flops"]
  assert t["config"]["sampler_slots"] == builders.slots(run, topo.sampler_mesh) == 16
  assert progs["sampler_prefill"]["shape"] == dict(groups=4, samples=4)
  assert progs["sampler_prefill[8x2]"]["shape"] == dict(groups=8, samples=2)
  assert progs["sampler_prefill[8x2]"]["est_flops"] == 2 * progs["sampler_prefill"]["est_flops"]


def test_plan_sizes_slots_by_the_chip_hbm():
  """rollout.slots=-1: the runtime's sizing with the plan chip's HBM as the budget (here: the cap, the batch and
  the next one's prompts in flight)."""
  c = tiny_config()
  c.rollout.slots = -1
  c.plan.programs = "push_cross"
  t = planning.make_plan(c)
  run = config_lib.load(c)
  mesh = build_topology(run.topology).sampler_mesh
  assert t["config"]["sampler_slots"] == builders.slots(run, mesh, budget=95 * 2 ** 30, platform="cpu") == 32


def test_transport_spec_hand_cases():
  """The sampler's spec plus every axis it leaves unused, on the dim with the largest pieces it divides."""
  mesh = {"data": 2, "fsdp": 1, "tensor": 2}
  assert transport_spec((8, 6), mesh) == P("data", "tensor")
  assert transport_spec((6, 3), mesh) == P(("data",), None)  # tensor divides no dim any more: replicated
  assert transport_spec((3,), mesh) == P(None)
  # an expert leaf [L, E, D, F] on (E: fsdp, F: tensor) of a data 16 x fsdp 8 x tensor 4 sampler: data joins D
  big = {"data": 16, "fsdp": 8, "tensor": 4}
  assert transport_spec((94, 128, 4096, 1536), big, P(None, "fsdp", None, "tensor")) == \
      P(None, ("fsdp",), ("data",), ("tensor",))
  assert transport_spec((4, 6), mesh, P("tensor")) == P("tensor", "data")
  assert transport_spec((8, 3), mesh, P("tensor")) == P(("tensor", "data"), None)


def test_oversized_program_fails_with_one_line(local_plan):
  """A compiled program over HBM: one line naming it, the overshoot and the knob."""
  _, t = local_plan
  trainer = {p["name"]: p for p in t["programs"]}["trainer_step"]
  prog = planning.Program(**{k: trainer[k] for k in ("name", "mesh", "argument_bytes", "output_bytes",
                                                     "alias_bytes", "temp_bytes", "flops", "bytes_accessed",
                                                     "compile_s")})
  hbm = prog.peak_bytes - 1024
  chip = planning.Chip("tiny", hbm, 1e12, 1e12, 1e9, 1e9)
  with pytest.raises(planning.PlanError) as e:
    planning.check_fit([prog], chip)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("trainer_step does not fit: needs ")
  assert f"over by {1024 / 2 ** 30:.3g} GiB" in msg
  knob = "micro_batches" if prog.temp_bytes >= prog.argument_bytes else "FSDP"
  assert knob in msg
  planning.check_fit([prog], planning.Chip("ok", prog.peak_bytes, 1e12, 1e12, 1e9, 1e9))  # exactly fits


def test_oversized_state_fails_before_compiling():
  """Params + AdamW moments over HBM fail at once, from the shardings alone (no minutes-long compile)."""
  c = tiny_config()
  c.plan.hbm_gib = 1e-4  # 105 KB per chip; the tiny trainer state is ~320 KB per chip
  t0 = time.perf_counter()
  with pytest.raises(planning.PlanError, match=r"^trainer_step does not fit: .*params \+ optimizer state alone"):
    planning.make_plan(c)
  assert time.perf_counter() - t0 < 15


def test_plan_cli_oversized_prints_one_line():
  cmd = [sys.executable, "-m", "launch.plan", f"--config={ROOT}/configs/paper_qwq32b.py:tiny",
         "--config.plan.hbm_gib=0.0001"]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 3, r.stderr[-2000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("rlax: plan: trainer_step does not fit"), last


def test_tpu_topology_plan_or_clear_error():
  """With libtpu: the same plan compiles for v5p:2x2x1 x 2 slices. Without: one clear error line."""
  c = tiny_config("v5p:2x2x1")
  if importlib.util.find_spec("libtpu") is None:
    with pytest.raises(ValueError, match="install the `tpu` extra"):
      planning.make_plan(c)
    return
  t = planning.make_plan(c)
  progs = {p["name"]: p for p in t["programs"]}
  assert [n for n in progs if not n.startswith("trainer_step[")] == NAMES  # [..]: the run's other train programs
  assert t["config"]["devices"] == 8
  assert t["estimates"]["push"]["link"] == "dcn"  # trainer and sampler on different TPU slices
  # TPU layouts pad small arrays to (8, 128) tiles, so compiled bytes are at least the logical ones.
  assert progs["push_cross"]["argument_bytes"] >= t["estimates"]["push"]["per_chip_transport_bytes"]
  assert progs["trainer_step"]["argument_bytes"] > 3 * t["config"]["params"] * 4 // 4
  # head_dim 16: the Mosaic kernel does not compile for it, so the engine keeps the dense layout on TPU too.
  assert t["estimates"]["decode"]["layout"] == "dense"


def test_tpu_paged_decode_compiles_the_pallas_kernel():
  """With libtpu and head_dim 128: the engine's decode chunk is the paged layout's, lowering jax's Pallas kernel
  (a Mosaic custom call) for v5p; the kernel's page reads are added to XLA's count."""
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("needs the tpu extra (libtpu) to compile for TPU")
  c = tiny_config("v5p:2x2x1")
  c.model.overrides["head_dim"] = 128
  c.plan.programs = "sampler_decode"
  t = planning.make_plan(c)
  paged = t["estimates"]["decode"]
  assert paged["layout"] == "paged" and paged["attention"] == "kernel"
  # Per chip: 4 slots x 2 pages of 16 tokens, 1 KV head (2 query heads), 2 layers; f32 pool, K and V; f32 q, out.
  assert paged["kernel_pages_read"] == 2 * 4 * 2
  assert paged["kernel_bytes"] == 2 * (2 * 1 * (4 * 2) * 16 * 128 * 4 + 2 * 4 * 2 * 128 * 4)
  assert paged["step_bytes"] == pytest.approx(paged["xla_step_bytes"] + paged["kernel_bytes"])


def test_tpu_launcher_commands_follow_the_plan_topology():
  run = lambda *a: subprocess.run([sys.executable, "-m", "launch.tpu", *a], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60)
  r = run("--config=configs/paper_qwq32b.py", "--config.plan.topology=v5p-1024")
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
      "rlax: tpu: plan.topology='v5p-1024' is not '<generation>:<AxBxC>'")
  r = run("--config=configs/v5p_128.py", "--method=xpk", "--cluster=k")
  assert r.stdout.startswith("xpk workload create --cluster=k --workload=rlax --tpu-type=v5p-64 --num-slices=2")
  r = subprocess.run([sys.executable, "-m", "launch.tpu", "--config=configs/paper_qwq32b.py", "--project=p",
                      "--zone=z"], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr[-2000:]
  lines = r.stdout.strip().splitlines()
  assert lines[0].startswith("gcloud compute tpus queued-resources create rlax --node-count=2 ")
  assert "--accelerator-type=v5p-1024" in lines[0]
  ssh = [l for l in lines if "tpu-vm ssh" in l]
  assert len(ssh) == 2 and all("--worker=all" in l and "--config=configs/paper_qwq32b.py" in l for l in ssh)


def test_xm_launcher_sweep_and_missing_extra():
  from launch import xm_launch
  assert xm_launch.job_args("c.py", "") == [{"config": "c.py"}]
  assert xm_launch.job_args("c.py", "optimizer.lr=1,2") == [{"config": "c.py", "config.optimizer.lr": "1"},
                                                            {"config": "c.py", "config.optimizer.lr": "2"}]
  with pytest.raises(ValueError, match="field=v1,v2"):
    xm_launch.job_args("c.py", "optimizer.lr")
  if importlib.util.find_spec("xmanager") is None:
    r = subprocess.run([sys.executable, "-m", "launch.xm_launch"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (
        "rlax: xm_launch: xmanager is not installed; install the optional extra in its own venv: "
        "pip install -e '.[xmanager]'")


def test_planner_uses_only_public_lowerings():
  """No private attribute of the trainer or sampler is read: a runtime layout change cannot stale the plan."""
  import inspect
  import re
  from rlax import planning_programs
  src = inspect.getsource(planning) + inspect.getsource(planning_programs)
  assert not re.search(r"\b(trainer|sampler|eng)\._", src), re.findall(r"\b(?:trainer|sampler|eng)\._\w+", src)


def test_lora_plan_pushes_adapters_and_merges_into_the_pristine_base(local_plan):
  """model.lora: the trainer step holds the frozen base + adapters + their moments (no moments of the base), a
  push carries the f32 adapters only, and `sampler_merge` reads the pristine base + adapters into the weights."""
  c_full, full = local_plan
  c = tiny_config()
  c.model.lora.update(rank=4, alpha=8.0)
  c.plan.programs = "trainer_step,sampler_merge,push_cross"
  t = planning.make_plan(c)
  run = config_lib.load(c)
  cfg = run.model
  progs = {p["name"]: p for p in t["programs"]}
  assert [n for n in progs if not n.startswith("trainer_step[")] == ["trainer_step", "sampler_merge", "push_cross"]
  n_adapters = cfg.n_layers * 4 * sum(
      i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)])
  lo = t["estimates"]["lora"]
  assert lo["adapter_params"] == n_adapters and t["estimates"]["push"]["total_bytes"] == 4 * n_adapters
  assert lo["push_share_of_full"] == pytest.approx(n_adapters / cfg.num_params())
  assert t["estimates"]["push_base_once"]["total_bytes"] == full["estimates"]["push"]["total_bytes"]
  assert progs["push_cross"]["argument_bytes"] == 4 * n_adapters // 4  # one transport piece per chip
  # The trainer's resident state: the base once (no AdamW moments of it) against the full step's params x 3.
  full_args = {p["name"]: p for p in full["programs"]}["trainer_step"]["argument_bytes"]
  assert progs["trainer_step"]["argument_bytes"] < full_args / 2
  # The merge reads the pristine base and the adapters and writes the weights the sampler decodes with.
  weights = full["estimates"]["decode"]["weights_bytes"]
  assert weights == lo["sampler_pristine_bytes_per_chip"]
  assert weights <= progs["sampler_merge"]["output_bytes"] <= weights + 1024  # + the output tuple's pointers
  assert weights <= progs["sampler_merge"]["argument_bytes"]


def test_a_program_the_tpu_compiler_refuses_is_one_line():
  """XLA:TPU raises RESOURCE_EXHAUSTED itself when temporaries exceed HBM: the plan says which program and what
  to change, in one line."""
  from rlax import planning_programs

  class Refused:
    def compile(self):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                                       "for HLO temporaries (289.79G) exceeds available HBM (95.74G).")

  low = planning_programs.Lowering("sampler_admit[64x8]", lambda: Refused())
  with pytest.raises(planning.PlanError) as e:
    planning._analyze(low, "mesh", planning.Chip("tiny", 2 ** 30, 1e12, 1e12, 1e9, 1e9))
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("sampler_admit[64x8] does not fit: Ran out of memory on HBM")
  assert "rollout.slots" in msg


@pytest.mark.parametrize("placement", ["own", "sampler"])
def test_a_distilling_plan_compiles_the_teachers_scoring_on_its_mesh(tmp_path, placement):
  from harness import hf_models
  hf_models.make_dir(tmp_path / "teacher", "qwen2", tie=False, seed=0)
  c = tiny_config()
  c.topology.update(slice_size=2, trainer_slices=1, sampler_slices=2, service_slices=int(placement == "own"),
                    service_mesh={"data": -1})  # slices of 2: trainer 0, sampler 1-2, (service 3)
  c.algorithm.name = "distill"
  c.teacher.update(hf_checkpoint=str(tmp_path / "teacher"), placement=placement)
  c.plan.programs = "teacher_score"
  t = planning.make_plan(c)
  (prog,) = t["programs"]
  teacher = M.hf.read_config(str(tmp_path / "teacher"), dtype=config_lib.load(c).model.dtype)
  weights = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                for x in jax.tree.leaves(M.init.abstract_params(teacher)))
  assert prog["name"] == "teacher_score" and prog["mesh"] == ("data2" if placement == "own" else "data2xtensor2")
  assert prog["shape"] == dict(rows=16, length=32, params=teacher.num_params())
  # Rows over the data axis: every chip holds the teacher's weights (tensor 2 on the sampler's: half of them).
  assert prog["argument_bytes"] >= weights // (1 if placement == "own" else 2)
  assert t["estimates"]["teacher_score_s"] > 0 and prog["temp_bytes"] > 0
  assert t["config"]["service_mesh"] == ({"data": 2, "fsdp": 1, "tensor": 1} if placement == "own" else None)


def test_a_judging_plan_compiles_the_judges_engine_on_its_mesh(tmp_path):
  from harness import hf_models
  hf_models.make_dir(tmp_path / "judge", "qwen2", tie=False, seed=1)
  c = tiny_config()
  c.reward.name = "judge"
  c.judge.update(hf_checkpoint=str(tmp_path / "judge"), slots=8, max_prompt_len=48, max_new_tokens=8)
  c.plan.programs = "judge_prefill,judge_admit,judge_decode"
  progs = {p["name"]: p for p in planning.make_plan(c)["programs"]}
  assert list(progs) == ["judge_prefill", "judge_admit", "judge_decode"]
  judge = M.hf.read_config(str(tmp_path / "judge"), dtype=config_lib.load(c).model.dtype)
  assert progs["judge_decode"]["shape"] == dict(slots=8) and progs["judge_prefill"]["shape"]["replies"] >= 2
  assert progs["judge_decode"]["argument_bytes"] > 0 and progs["judge_prefill"]["temp_bytes"] > 0
  assert progs["judge_decode"]["est_flops"] > 0 and judge.num_params() > 0
