"""launch/: each entry point runs (--help or a cheap call), optional extras fail in one line, flags are defined once."""

import ast
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")


def _tree(path):
  with open(path) as f:
    return ast.parse(f.read())


def _calls(tree):
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      yield (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")), node


def _defines(tree) -> set[str]:
  """Names of the flags DEFINE'd in a module's source (absl or ml_collections)."""
  return {n.args[0].value for name, n in _calls(tree) if name.startswith("DEFINE_") and n.args
          and isinstance(n.args[0], ast.Constant)}


def _flag_helpers() -> dict[str, set[str]]:
  """flags_util's functions -> the flags each defines."""
  tree = _tree(os.path.join(LAUNCH, "flags_util.py"))
  return {f.name: _defines(f) for f in tree.body if isinstance(f, ast.FunctionDef) and _defines(f)}


def _modules():
  return {os.path.basename(p): _tree(p) for p in sorted(glob.glob(os.path.join(LAUNCH, "*.py")))}


def _entry_points():
  return sorted(name[:-3] for name, tree in _modules().items()
                if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body))


def _run(*args, env=None, timeout=120):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                        env=env)


def test_no_flag_is_defined_in_two_launch_modules():
  where: dict[str, list[str]] = {}
  for name, tree in _modules().items():
    for flag in _defines(tree):
      where.setdefault(flag, []).append(name)
  twice = {f: m for f, m in where.items() if len(m) > 1}
  assert not twice, f"define these once in launch/flags_util.py: {twice}"
  assert where["cpu_devices"] == ["flags_util.py"] and where["config"] == ["flags_util.py"]


_HELP = ["curves", "evaluate", "export", "fault_inject", "fetch_model", "main", "make_data", "multihost", "plan",
         "search_index", "tpu", "upcycle", "xm_launch"]


def test_every_entry_point_has_a_check_here():
  assert _entry_points() == sorted(set(_HELP) | {"gen_build"})


@pytest.mark.parametrize("module", _HELP)
def test_help_lists_the_entry_points_flags(module):
  r = _run("-m", f"launch.{module}", "--help")
  assert r.returncode == 0, r.stderr[-2000:]
  tree = _modules()[f"{module}.py"]
  helpers = _flag_helpers()
  want = _defines(tree).union(*(helpers.get(name, set()) for name, _ in _calls(tree)))
  assert want
  for flag in want:
    assert f"--{flag}:" in r.stdout or f"--[no]{flag}:" in r.stdout, (flag, r.stdout)


def test_gen_build_prints_a_target_per_entry_point():
  r = _run("-m", "launch.gen_build")
  assert r.returncode == 0, r.stderr[-2000:]
  for module in _entry_points():
    assert f'name = "launch_{module}"' in r.stdout
  assert 'name = "launch_flags_util"' not in r.stdout  # shared code goes into the `launch` library


def test_make_data_writes_records(tmp_path):
  out = tmp_path / "x.jsonl"
  r = _run("-m", "launch.make_data", "--task=arithmetic", "--n=5", f"--out={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  assert len([json.loads(l) for l in out.read_text().splitlines()]) == 5
  r = _run("-m", "launch.make_data", "--task=arithmetic")
  assert r.returncode == 2 and r.stderr.strip() == (
      "rlax: bad command line: flag --out=None: Flag --out must have a value other than None.")


@pytest.mark.skipif(importlib.util.find_spec("xmanager") is not None, reason="the xmanager extra is installed")
def test_xm_launch_without_the_extra_says_so_in_one_line():
  r = _run("-m", "launch.xm_launch", "--config=configs/demo.py", "--sweep=optimizer.lr=1e-3,3e-3")
  assert r.returncode == 2 and r.stderr.strip() == (
      "rlax: xm_launch: xmanager is not installed; install the optional extra in its own venv: "
      "pip install -e '.[xmanager]'")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="the tpu extra is installed")
def test_plan_without_the_tpu_extra_says_so_in_one_line():
  r = _run("-m", "launch.plan", "--config=configs/paper_qwq32b.py", timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("rlax: plan: bad config: plan.topology='v5p:8x8x8'") and "`tpu` extra" in last


_APPLY = """
import jax
from absl import flags
from launch import flags_util
flags_util.define_cpu_devices()
flags.FLAGS(["x", "--cpu_devices=3"])
flags_util.apply_cpu_devices()
print(jax.config.jax_num_cpu_devices)
"""


@pytest.mark.parametrize("env, want", [({}, 3), ({"JAX_PLATFORMS": "tpu"}, -1), ({"RLAX_PROCESS_ID": "0"}, -1)])
def test_apply_cpu_devices_leaves_accelerators_and_multihost_jobs_alone(env, want):
  base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "RLAX_PROCESS_ID")}
  r = _run("-c", _APPLY, env={**base, **env})
  assert r.returncode == 0, r.stderr[-2000:]
  assert int(r.stdout.split()[-1]) == want


def test_config_overrides_reach_the_launched_jobs():
  r = _run("-m", "launch.tpu", "--config=configs/v5p_128.py", "--method=xpk", "--cluster=k",
           "--config.rollout.max_new_tokens=100", "--config.deterministic=true")
  assert r.returncode == 0, r.stderr[-2000:]
  assert ("launch.main --config=configs/v5p_128.py --config.rollout.max_new_tokens=100 --config.deterministic=true"
          in r.stdout)
  from launch import xm_launch
  assert xm_launch.job_args("c.py", "optimizer.lr=1,2", {"config.seed": "3"}) == [
      {"config": "c.py", "config.seed": "3", "config.optimizer.lr": "1"},
      {"config": "c.py", "config.seed": "3", "config.optimizer.lr": "2"}]


_ENV = {**os.environ, "RLAX_TCMALLOC": "0"}


@pytest.mark.parametrize("args,want", [
    (["--config=/nonexistent/cfg.py"],
     "rlax: bad command line: --config=/nonexistent/cfg.py: [Errno 2] No such file or directory: "
     "'/nonexistent/cfg.py'"),
    (["--config.model.overrides.dtipe=bfloat16"], "rlax: bad config: model: unknown model config field(s): dtipe"),
    (["--config.controller.on_nonfinite=maybe"], "rlax: bad config: controller.on_nonfinite='maybe'"),
    (["--config.workdir=/proc/version/run"], "rlax: bad config: workdir='/proc/version/run': '/proc/version' "
                                             "exists and is not a directory"),
    (["--config.rollout.max_prompt_len=6"], "rlax: bad config: rollout.max_prompt_len=6 is shorter than"),
])
def test_main_bad_input_is_one_line(args, want):
  r = _run("-m", "launch.main", "--config=configs/demo.py:tiny", "--progress=false", *args, env=_ENV)
  lines = [ln for ln in r.stderr.splitlines() if not ln.startswith(("I1", "W1"))]
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(want), r.stderr[-3000:]


def test_model_overrides_the_config_file_does_not_set_are_accepted():
  """`--config.model.overrides.dtype=bfloat16` on a config whose overrides dict has no `dtype` key (and a teacher
  route, `teacher.routes` being such a dict too)."""
  code = ("import sys; from absl import flags; from launch import flags_util as f\n"
          "C = f.define_config(f.DEMO_CONFIG); f.parse_or_exit(sys.argv)\n"
          "print(dict(C.value.teacher.routes), dict(C.value.model.overrides), "
          "f.config_args()['config.model.overrides.dtype'])\n")
  r = _run("-c", code, "--config=configs/demo.py:tiny", "--config.model.overrides.dtype=bfloat16",
           "--config.model.overrides.d_model=64", "--config.teacher.routes.code=/models/coder", env=_ENV)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "'dtype': 'bfloat16'" in r.stdout and "'d_model': 64" in r.stdout and r.stdout.split()[-1] == "bfloat16"
  assert r.stdout.startswith("{'code': '/models/coder'}")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_during_the_warm_start_checkpoints_it(tmp_path, sig):
  """Ctrl-C is a preemption notice like SIGTERM: the warm start stops, is saved, and the run says so (exit 0)."""
  import signal
  import time
  err_path = tmp_path / "stderr.txt"
  with open(err_path, "w") as err_file:
    proc = subprocess.Popen([sys.executable, "-m", "launch.main", "--config=configs/demo.py:tiny", "--progress=false",
                             f"--config.workdir={tmp_path / 'run'}", "--config.init.sft_steps=100000",
                             "--config.init.sft_batch=8"],
                            cwd=ROOT, env=_ENV, stdout=subprocess.PIPE, stderr=err_file, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and "sft step 1/" not in err_path.read_text():
      time.sleep(0.5)
    proc.send_signal(getattr(signal, sig))
    out, _ = proc.communicate(timeout=120)
  err = err_path.read_text()
  assert proc.returncode == 0, err[-3000:]
  summary = json.loads(out.splitlines()[-1])
  assert summary["preempted"] and summary["steps"] == 0 and summary["sft_steps_done"] > 0, out
  assert os.listdir(tmp_path / "run" / "checkpoints_sft") == [str(summary["sft_steps_done"])]
  assert "Traceback" not in err and "grace period" not in err


def test_curves_plots_the_runs_held_out_curves(tmp_path):
  runs = []
  for name, algo, pass1 in (("rl", "grpo", [0.1, 0.4, 0.6]), ("distill", "distill", [0.1, 0.55])):
    (tmp_path / name).mkdir()
    step = [0, 4, 8][:len(pass1)]
    (tmp_path / name / "summary.json").write_text(json.dumps({"algorithm": algo, "curve": {"step": step,
                                                                                         "pass1": pass1}}))
    runs.append(str(tmp_path / name))
  out = tmp_path / "curves.png"
  r = _run("-m", "launch.curves", f"--runs={','.join(runs)}", f"--out={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  res = json.loads(r.stdout.strip().splitlines()[-1])
  assert res["curves"][runs[1]] == {"step": [0, 4], "pass1": [0.1, 0.55], "algorithm": "distill"}
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  (tmp_path / "rl" / "summary.json").write_text(json.dumps({"steps": 3}))  # a run without a curve: one line
  r = _run("-m", "launch.curves", f"--runs={runs[0]}", f"--out={out}")
  assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("rlax: curves:") and "no held-out curve" in r.stderr
