"""The typed run config: every shipped config loads with every documented argument, errors name the field,
and every field is read by the code."""

import dataclasses
import importlib
import os
import pathlib
import re

import ml_collections
import pytest

from configs import base, demo
from harness import hf_models
from rlax import algorithms
from rlax import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Every configs/*.py with every argument its docstring or get_config documents.
CONFIGS = [("base", None), ("demo", None), ("demo", "smoke"), ("demo", "tiny"),
           *[("algorithm", a) for a in ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                        "gspo", "cispo", "ppo")],
           ("paper_qwq32b", None), ("paper_qwq32b", "32k"), ("paper_qwq32b", "tiny"), ("v5p_128", None),
           ("v5p_128", "tiny"), ("v5p_512", None), ("v5p_512", "tiny"), ("smollm2", None), ("smollm2", "smoke"), ("smollm2", "lora"),
           ("smollm2_distill", None), ("smollm2_distill", "smoke"), ("smollm2_judge", None), ("smollm2_judge", "smoke"),
           ("calculator_tool", None), ("calculator_tool", "control"), ("calculator_tool", "smoke"),
           ("search_tool", None), ("search_tool", "control"), ("search_tool", "smoke"),
           ("reasoning_gym", None), ("reasoning_gym", "smoke"), ("demo", "tiny_moe"), ("smollm2_moe", None),
           ("smollm2_moe", "smoke"), ("smollm2_moe", "no_replay"), ("qwen3_moe_30b", None), ("qwen3_moe_30b", "tiny"),
           ("qwen3_moe_235b", None), ("qwen3_moe_235b", "tiny"), ("paper_distill", None)]


def test_every_config_file_is_listed():
  files = {p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__"}
  assert files == {name for name, _ in CONFIGS}


@pytest.mark.parametrize("name,arg", CONFIGS)
def test_config_loads_and_validates(name, arg, tmp_path):
  cd = importlib.import_module(f"configs.{name}").get_config(arg)
  if cd.model.hf_checkpoint:  # a real model directory is not in CI: a tiny one of the same layout stands in
    hf_models.make_dir(tmp_path, "mixtral" if "moe" in name else "llama", tie=True)
    cd.model.hf_checkpoint = str(tmp_path)
  if cd.teacher.hf_checkpoint and not cd.teacher.hf_checkpoint.startswith(str(ROOT / "configs")):  # not shipped
    cd.teacher.hf_checkpoint = str(tmp_path)
  if cd.judge.hf_checkpoint:  # and the judge
    cd.judge.hf_checkpoint = str(tmp_path)
  run = config_lib.load(cd)
  assert os.path.isabs(run.workdir)
  assert run.algorithm.name in algorithms.known_algorithms()
  assert run.rollout.rows % run.optimizer.micro_batches == 0
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.seed = 1  # typed configs are frozen


def test_unknown_argument_is_an_error():
  with pytest.raises(ValueError, match="unknown argument"):
    demo.get_config("smok")


def test_relative_workdir_becomes_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  c = demo.get_config("tiny")
  assert c.workdir == "runs/demo_tiny"
  assert config_lib.load(c).workdir == str(tmp_path / "runs" / "demo_tiny")


@pytest.mark.parametrize("path,value,match", [
    ("controller.log_every", 1, "controller.log_every is not a config field"),
    ("eval.n_prompts", 8, "eval.n_prompts is not a config field"),
    ("init.hf_checkpoint", "/x", "init.hf_checkpoint is not a config field"),
    ("controller.steps", -1, "controller.steps"),
    ("rollout.top_p", 0.0, "rollout.top_p"),
    ("eval.n_samples", 0, "eval.n_samples"),
    ("optimizer.micro_batches", 3, "optimizer.micro_batches=3 does not divide"),
    ("algorithm.name", "ppo2", "unknown algorithm 'ppo2'"),
    ("algorithm.overrides", {"critic_init": "x"}, "critic_init='x'"),
    ("workdir", "", "workdir"),
    ("rollout.decode_chunk", 0, "rollout.decode_chunk=0 must be >= 1"),
    ("controller.on_nonfinite", "ignore", "controller.on_nonfinite='ignore': use 'skip' or 'stop'"),
    ("reward.memory_mb", 0, "reward.memory_mb=0 and reward.max_chars=1048576 must be >= 1"),
])
def test_bad_field_is_one_error_naming_it(path, value, match):
  c = demo.get_config("tiny")
  with c.unlocked():
    *parent, leaf = path.split(".")
    node = c
    for p in parent:
      node = node[p]
    node[leaf] = value
  with pytest.raises(ValueError, match=re.escape(match)):
    config_lib.load(c)


def test_wrong_type_names_the_field():
  d = demo.get_config("tiny").to_dict()  # plain dicts load too (ConfigDict already refuses this override)
  d["controller"]["steps"] = "ten"
  with pytest.raises(ValueError, match=re.escape("controller.steps='ten': expected int")):
    config_lib.load(d)


def test_model_and_algorithm_overrides_are_typed():
  c = base.get_config()
  c.model.overrides = dict(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, dtype="bfloat16")
  c.algorithm.overrides = dict(eps_high=0.28)
  run = config_lib.load(c)
  assert (run.model.d_model, run.model.dtype, run.algorithm.eps_high) == (64, "bfloat16", 0.28)
  c.model.overrides = dict(d_modle=64)
  with pytest.raises(ValueError, match="model: unknown model config field.*d_modle"):
    config_lib.load(c)


def test_every_field_is_read_by_the_code():
  """A knob that nothing reads does not exist: each typed field is read as `.field` somewhere in rlax/."""
  source = "\n".join(p.read_text() for p in (ROOT / "rlax").rglob("*.py"))  # definitions have no leading dot
  sections = [config_lib.RunConfig, config_lib.InitConfig, config_lib.OptimizerSection, config_lib.RolloutConfig,
              config_lib.ControllerConfig, config_lib.DataConfig, config_lib.RewardConfig,
              config_lib.EvalConfig, config_lib.CheckpointConfig, config_lib.FaultsConfig, config_lib.PlanConfig]
  unread = [f"{cls.__name__}.{f.name}" for cls in sections for f in dataclasses.fields(cls)
            if not re.search(rf"\.{f.name}\b", source)]
  assert not unread


def test_base_config_has_only_typed_fields():
  """configs/base.py lists exactly the typed fields (so `--config.x=` overrides reach something)."""
  c = base.get_config()
  typed = {"init": config_lib.InitConfig, "optimizer": config_lib.OptimizerSection,
           "rollout": config_lib.RolloutConfig, "controller": config_lib.ControllerConfig,
           "data": config_lib.DataConfig,
           "reward": config_lib.RewardConfig, "eval": config_lib.EvalConfig,
           "checkpoint": config_lib.CheckpointConfig}
  for name, cls in typed.items():
    assert set(c[name].keys()) == {f.name for f in dataclasses.fields(cls)}, name
  assert isinstance(c, ml_collections.ConfigDict)


def test_workdir_that_cannot_be_a_directory_fails_at_load(tmp_path):
  c = demo.get_config("tiny")
  (tmp_path / "file").write_text("")
  for workdir in (tmp_path / "file", tmp_path / "file" / "run"):
    c.workdir = str(workdir)
    with pytest.raises(ValueError, match=re.escape(f"workdir={str(workdir)!r}: {str(tmp_path / 'file')!r} exists "
                                                   "and is not a directory")):
      config_lib.load(c)
  c.workdir = str(tmp_path / "new" / "run")  # not there yet: created by the run
  assert config_lib.load(c).workdir == str(tmp_path / "new" / "run")


def test_reward_limits_reach_the_verifier_pool():
  from rlax import builders
  c = demo.get_config("tiny")
  c.reward.update(memory_mb=256, max_chars=10, timeout_s=3.0, workers=1)
  with builders.verifier_pool(config_lib.load(c)) as pool:
    assert (pool.memory_mb, pool.max_chars, pool.timeout_s) == (256, 10, 3.0)
    (reward, info), = pool.grade(lambda text, rec: (1.0, {}), ["x" * 11], [None])
    assert reward == 0.0 and info.get("too_long")


def test_a_run_that_grades_code_without_a_jail_stops_in_one_line(monkeypatch):
  from rlax import builders
  from rlax.rewards import jail
  monkeypatch.setattr(jail, "available", lambda: (False, "bwrap cannot build the jail: no user namespaces"))
  c = demo.get_config("tiny")
  c.reward.update(name="code", workers=1)
  with pytest.raises(ValueError, match=r"^reward.sandbox=auto: no sandbox for untrusted code: bwrap cannot build "
                                       r"the jail: no user namespaces; .*reward.sandbox=unsafe"):
    builders.verifier_pool(config_lib.load(c))
  c.reward.sandbox = "unsafe"  # the explicit opt-in
  with builders.verifier_pool(config_lib.load(c)) as pool:
    assert pool.grade(lambda text, rec: (1.0, {}), ["x"], [None])[0][0] == 1.0


def test_sft_warm_start_builds_no_value_model():
  from rlax import builders
  from rlax import models as M
  c = demo.get_config("tiny")
  c.algorithm.name = "ppo"
  run = config_lib.load(c)
  params = M.create_params(run.model)
  assert builders.trainer(run, None).init_state(params).critic is not None
  assert builders.sft_trainer(run, None).init_state(params).critic is None
