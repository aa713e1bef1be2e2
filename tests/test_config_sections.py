"""Config sections owned by their packages: each validates its own fields with one error naming the field, the
dataclasses are the one source of defaults, the algorithm registry says which algorithms need groups, and no
rlax module imports itself back."""

import ast
import dataclasses
import pathlib
import re

import pytest

from configs import base
from rlax import algorithms
from rlax import config as config_lib
from rlax import pysource
from rlax.models.lora import LoraConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = {"init": config_lib.InitConfig, "optimizer": config_lib.OptimizerSection,
            "rollout": config_lib.RolloutConfig, "controller": config_lib.ControllerConfig,
            "data": config_lib.DataConfig, "reward": config_lib.RewardConfig, "eval": config_lib.EvalConfig,
            "env": config_lib.EnvConfig, "checkpoint": config_lib.CheckpointConfig, "faults": config_lib.FaultsConfig,
            "plan": config_lib.PlanConfig, "model.lora": LoraConfig, "teacher": config_lib.TeacherConfig}


@pytest.mark.parametrize("cls", SECTIONS.values(), ids=SECTIONS.keys())
def test_every_section_validates_at_its_defaults(cls):
  assert cls().validate() == cls()


@pytest.mark.parametrize("section,field,value", [
    ("init", "sft_steps", -1), ("init", "sft_batch", 0),
    ("optimizer", "lr", 0.0), ("optimizer", "schedule", "linear"), ("optimizer", "micro_batch_tokens", -1),
    *[("rollout", f, v) for f, v in (("prompts_per_step", 0), ("samples_per_prompt", 0), ("max_prompt_len", 0),
                                     ("max_new_tokens", 0), ("temperature", 0.0), ("top_k", -1), ("top_p", 1.5),
                                     ("decode_chunk", 0), ("slots", -2), ("stream_ahead", -2), ("on_swap", "drop"))],
    *[("controller", f, v) for f, v in (("steps", -1), ("max_staleness", -1), ("stale_policy", "keep"),
                                        ("push_every", 0), ("queue_size", 0), ("on_nonfinite", "ignore"))],
    ("data", "n_train", 0), ("data", "prompt_style", "chatty"), ("data", "template", "html"),
    ("data", "instruction", "no placeholder"), ("data", "answer_format", "gsm"),
    ("data", "train_files", "/nonexistent/train.jsonl"), ("data", "train_files", "/nonexistent/train.csv"),
    ("reward", "workers", 0), ("reward", "memory_mb", 0), ("reward", "answer", "box"),
    ("reward", "format_weight", -1.0), ("reward", "sandbox", "off"),
    ("eval", "n_samples", 0), ("eval", "temperature", 0.0),
    ("env", "max_turns", 0), ("env", "renderer", "gemma"), ("env", "tool_timeout_s", 0.0),
    ("checkpoint", "keep", 0), ("checkpoint", "every_steps", -1), ("checkpoint", "grace_seconds", 0.0),
    ("checkpoint", "export_every", -1),
    ("faults", "lose_slice_at", ((-1, 5),)), ("faults", "kill_in_recovery", (("rebuild", "SIGKILL"),)),
    ("faults", "kill_in_recovery", (("build", "SIGSTOP"),)),
    ("plan", "num_slices", 0), ("plan", "hbm_gib", 0.0),
    ("model.lora", "rank", -1), ("model.lora", "dropout", 0.1), ("model.lora", "targets", ("qkv",)),
    ("teacher", "placement", "trainer"), ("teacher", "temperature", 0.0), ("teacher", "chunk", 0),
    ("teacher", "hf_checkpoint", "/nonexistent/teacher"),
])
def test_a_bad_field_is_one_error_naming_it(section, field, value):
  bad = dataclasses.replace(SECTIONS[section](), **{field: value})
  with pytest.raises(ValueError, match=rf"^{re.escape(section)}\.{field}\b") as e:
    bad.validate()
  assert "\n" not in str(e.value)


def test_cross_section_rules_name_both_sections(tmp_path):
  c = base.get_config()
  c.workdir = str(tmp_path)
  c.rollout.slots = 12  # not whole groups of 8
  with pytest.raises(ValueError, match=r"^rollout.slots=12 .*eval.n_samples=8"):
    config_lib.load(c)


def test_base_config_defaults_are_the_dataclass_defaults(tmp_path):
  c = base.get_config().to_dict()
  for name, cls in SECTIONS.items():
    if name not in ("faults", "plan", "model.lora"):
      assert c[name] == dataclasses.asdict(cls()), name
  assert "plan" not in c  # planning configs add it
  lora = c["model"]["lora"]
  assert config_lib.load({"workdir": str(tmp_path), "model": {"lora": lora}}).lora == LoraConfig()
  run = config_lib.RunConfig
  assert (c["seed"], c["deterministic"], c["model"]["preset"], c["model"]["hf_checkpoint"]) == (
      run.seed, run.deterministic, run.model_preset, run.hf_checkpoint)
  assert config_lib.FaultsConfig.parse(**c["faults"]) == config_lib.FaultsConfig()
  algo = algorithms.AlgorithmConfig()
  assert {k: c["algorithm"][k] for k in ("name", "kl_coef", "kl_estimator", "entropy_coef")} == {
      "name": algo.name, "kl_coef": algo.kl_coef, "kl_estimator": algo.kl_estimator, "entropy_coef": algo.entropy_coef}
  topology = dataclasses.asdict(config_lib.TopologyConfig())
  changed = {k for k in topology if topology[k] != c["topology"][k]}
  assert changed == {"slice_size", "trainer_slices", "sampler_slices"}  # base simulates 2 + 2 slices of 2


def test_an_absent_field_loads_as_the_default_of_base(tmp_path):
  """A plain dict naming only the workdir loads as base does, except base's topology and its algorithm
  fields (absent ones keep the algorithm's own defaults: GRPO's kl_coef)."""
  c = base.get_config()
  c.workdir = str(tmp_path)
  from_base, bare = config_lib.load(c), config_lib.load({"workdir": str(tmp_path)})
  assert bare == from_base.replace(topology=config_lib.TopologyConfig(), algorithm=algorithms.get_algorithm("grpo"))


def test_fault_specs_read_back():
  faults = config_lib.FaultsConfig(((2, 5), (0, 9)), ((2, 7),), (("restore", "SIGKILL"), ("build", "SIGTERM")))
  assert config_lib.FaultsConfig.parse(**faults.specs()) == faults
  with pytest.raises(ValueError, match="faults.restore_slice_at='x'"):
    config_lib.FaultsConfig.parse(restore_slice_at="x")


def test_group_algorithms_come_from_the_registry(tmp_path):
  need = {n for n in algorithms.known_algorithms() if algorithms.get_algorithm(n).needs_groups}
  assert need == {"grpo", "dr_grpo", "dapo", "rloo", "gspo", "cispo", "reinforce_pp_baseline"}
  assert not algorithms.get_algorithm("grpo", advantage="reinforce_pp").needs_groups  # follows the estimator
  assert algorithms.get_algorithm("distill", reward_coef=1.0).needs_groups  # GRPO's advantage mixed back in
  c = base.get_config()
  c.workdir, c.rollout.samples_per_prompt, c.optimizer.micro_batches = str(tmp_path), 1, 1
  (tmp_path / "teacher").mkdir()
  (tmp_path / "teacher" / "config.json").write_text("{}")  # read by the run's builders, not by load
  for name in algorithms.known_algorithms():
    c.algorithm.name = name
    c.teacher.hf_checkpoint = str(tmp_path / "teacher") if algorithms.get_algorithm(name).distills else ""
    if name in need:
      with pytest.raises(ValueError, match=f"algorithm {name!r} normalizes within groups"):
        config_lib.load(c)
    else:
      config_lib.load(c)


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for p in (ROOT / "rlax").rglob("*.py"):
    parts = p.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
  return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  """The rlax modules `name` imports, with the packages whose __init__ each import runs (not its own: they are
  already loading). Imports inside functions count too: the circle through rlax.envs.base was one."""
  pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
  targets = set()
  for node in ast.walk(pysource.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base_parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
      mod = ".".join(base_parts + ([node.module] if node.module else []))
      targets.update([mod, *(f"{mod}.{a.name}" for a in node.names)])
  parts = name.split(".")
  own = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
  return {m for t in targets for m in (".".join(t.split(".")[:i]) for i in range(1, t.count(".") + 2))
          if m in modules and m not in own}


def test_no_import_circle():
  modules = _modules()
  graph = {m: _imports(m, p, modules) for m, p in modules.items()}
  state, path = {}, []

  def visit(m):  # depth-first; meeting a module still on the path is a circle
    state[m] = "open"
    path.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        raise AssertionError("import circle: " + " → ".join(path[path.index(n):] + [n]))
      if n not in state:
        visit(n)
    path.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m)
  assert not {m for m in graph["rlax.envs.config"] if m.startswith("rlax.envs")}  # a leaf: nothing of envs
