"""The typed run config: frozen dataclasses made once, at the launch boundary, from the user's ConfigDict.

ml_collections stays the user's interface (`--config=configs/demo.py --config.rollout.max_new_tokens=16`);
`load(config_dict)` turns it into a `RunConfig`: every field type-checked, paths made absolute, and every
rule checked, each failure one ValueError naming the field. Each section is a dataclass in the package that
reads it, with its defaults and a `validate()` of its own fields; this module composes them and checks the
rules that span sections. It is the only module that sees a ConfigDict; library code reads `RunConfig`. A
field that no code reads does not exist, and an unknown field in the ConfigDict is an error naming it.

Where each section lives: init, optimizer: rlax.trainer.config; rollout: rlax.rollout.config; controller, eval,
checkpoint, faults: rlax.runtime.config; data: rlax.data.config; reward: rlax.rewards.config; env: rlax.envs.config;
teacher: rlax.teachers.config; judge: rlax.judges.config; plan: rlax.planning_config; topology: rlax.topology;
algorithm: rlax.algorithms.registry; model: rlax.models (model.lora: rlax.models.lora).
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from typing import Any, Callable, Optional

from rlax import algorithms
from rlax import models
from rlax import services
from rlax.data.config import DataConfig
from rlax.envs import registry as env_registry
from rlax.envs.config import EnvConfig
from rlax.judges.config import JudgeConfig
from rlax.models.lora import LoraConfig, parse_targets, target_spec
from rlax.planning_config import PlanConfig
from rlax.rewards.config import RewardConfig
from rlax.rollout.config import RolloutConfig
# RECOVERY_PHASES and the parse_* functions are re-exported: callers import them from here.
from rlax.runtime.config import (RECOVERY_PHASES, CheckpointConfig, ControllerConfig, EvalConfig, FaultsConfig,
                                 check_workdir, parse_recovery_kills, parse_schedule)
from rlax.teachers.config import TeacherConfig
from rlax.topology import TopologyConfig
from rlax.trainer.config import InitConfig, OptimizerSection


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """Everything one run reads. `model` and `algorithm` are resolved (preset + overrides applied)."""
  seed: int = 0
  workdir: str
  deterministic: bool = False     # a fixed staleness schedule: bitwise-reproducible resume
  model_preset: str = "w1"
  model: models.ModelConfig
  hf_checkpoint: str = ""         # absolute path of the HF directory the policy starts from; "" = random init
  init: InitConfig
  topology: TopologyConfig
  algorithm: algorithms.AlgorithmConfig
  optimizer: OptimizerSection
  rollout: RolloutConfig
  controller: ControllerConfig
  data: DataConfig
  reward: RewardConfig
  eval: EvalConfig
  env: EnvConfig
  checkpoint: CheckpointConfig
  faults: FaultsConfig
  plan: Optional[PlanConfig] = None
  teacher: TeacherConfig = TeacherConfig()
  judge: JudgeConfig = JudgeConfig()
  lora: LoraConfig = LoraConfig()  # model.lora: low-rank adapters (rank 0: every weight trains)

  def replace(self, **kw) -> "RunConfig":
    """A copy with top-level fields replaced (sections are frozen: replace them whole)."""
    return dataclasses.replace(self, **kw)


# Sections whose ConfigDict node holds exactly their dataclass's fields.
_SECTIONS = {"init": InitConfig, "optimizer": OptimizerSection, "rollout": RolloutConfig,
             "controller": ControllerConfig, "data": DataConfig, "reward": RewardConfig, "eval": EvalConfig,
             "env": EnvConfig, "checkpoint": CheckpointConfig, "teacher": TeacherConfig, "judge": JudgeConfig,
             "plan": PlanConfig}
_TOP = ("seed", "workdir", "deterministic", "model", "topology", "algorithm", "faults", *_SECTIONS)
_RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.default is not dataclasses.MISSING}


def defaults() -> dict[str, Any]:
  """Every ConfigDict field at its default, all taken from the dataclasses (configs/base.py starts here).
  `workdir` has none; `plan` is absent (planning configs add it)."""
  lora, algo = LoraConfig(), algorithms.AlgorithmConfig()
  return dict(
      seed=_RUN_DEFAULTS["seed"], deterministic=_RUN_DEFAULTS["deterministic"],
      model=dict(preset=_RUN_DEFAULTS["model_preset"], overrides={}, hf_checkpoint=_RUN_DEFAULTS["hf_checkpoint"],
                 lora=dict(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=target_spec(lora.targets))),
      topology=dataclasses.asdict(TopologyConfig()),
      # An algorithm's own defaults (e.g. GRPO's kl_coef) apply only where these keys are absent from the node.
      algorithm=dict(name=algo.name, kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
                     entropy_coef=algo.entropy_coef, overrides={}),
      faults=FaultsConfig().specs(),
      **{k: dataclasses.asdict(cls()) for k, cls in _SECTIONS.items() if k != "plan"})


def _plain(node: Any) -> Any:
  return node.to_dict() if hasattr(node, "to_dict") else node


def _coerce(value: Any, typ: Any, field: str) -> Any:
  """`value` as `typ` (int, float, bool, str, dict[str, str]); ints are accepted for floats; ValueError names it."""
  if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if typ in (int, bool, str) and isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
    return value
  if typing.get_origin(typ) is dict and isinstance(m := _plain(value), dict):
    if all(isinstance(x, str) for x in (*m, *m.values())):
      return dict(m)
  raise ValueError(f"{field}={_plain(value)!r}: expected {typ.__name__ if isinstance(typ, type) else typ}, "
                   f"got {type(value).__name__}")


def _fields(node: Any, names: list[str], path: str) -> dict[str, Any]:
  """The ConfigDict node `path` as a dict; a key outside `names` is an error naming it."""
  values = dict(_plain(node) or {})
  if unknown := sorted(set(values) - set(names)):
    raise ValueError(f"{path}.{unknown[0]} is not a config field; {path} has {', '.join(names)}")
  return values


def _section(cls, node: Any, path: str, **parsers: Callable[[Any], Any]):
  """`cls` from the node's fields (the rest at their defaults), each typed, or read by its parser."""
  hints = typing.get_type_hints(cls)
  values = _fields(node, [f.name for f in dataclasses.fields(cls)], path)
  return cls(**{k: parsers[k](v) if k in parsers else _coerce(v, hints[k], f"{path}.{k}") for k, v in values.items()})


def _hf_model(path: str, overrides: dict) -> tuple[str, models.ModelConfig]:
  """(absolute dir, ModelConfig from its config.json): f32 master weights and bf16 compute unless overridden."""
  from rlax.models import hf  # pylint: disable=g-import-not-at-top
  from rlax.models import config as model_config  # pylint: disable=g-import-not-at-top
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ValueError(f"model.hf_checkpoint={path!r}: no config.json there (an HF model directory is needed)")
  try:
    base = hf.read_config(path)
    fields = {**dataclasses.asdict(base), "param_dtype": "float32", "dtype": "bfloat16", **overrides}
    if "moe" in overrides and base.moe is None:
      raise ValueError("model.overrides.moe: the checkpoint has no experts (a dense model)")
    if "moe" in overrides:  # e.g. moe.routing_replay alone: the checkpoint's experts stay
      fields["moe"] = {**dataclasses.asdict(base.moe), **dict(overrides["moe"] or {})}
    return path, model_config.from_dict(fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"model.hf_checkpoint={path!r}: {e}") from None


def _model(node: Any, default: dict) -> tuple[str, models.ModelConfig, str, LoraConfig]:
  """The `model` node → (preset name, ModelConfig, absolute HF directory or "", LoraConfig)."""
  model = {**default, **_fields(node, list(default), "model")}
  try:
    lora = _section(LoraConfig, model["lora"], "model.lora", targets=parse_targets).validate()
  except TypeError as e:
    raise ValueError(f"model.lora: {e}") from None
  hf_dir = _coerce(model["hf_checkpoint"], str, "model.hf_checkpoint")
  overrides = dict(_plain(model["overrides"]) or {})
  if hf_dir:
    hf_dir, model_cfg = _hf_model(hf_dir, overrides)
    return "hf", model_cfg, hf_dir, lora
  try:
    return model["preset"], models.preset(model["preset"], **overrides), "", lora
  except (TypeError, ValueError) as e:  # an unknown preset, override or value
    raise ValueError(f"model: {e}") from None


def _algorithm(node: Any, default: dict) -> algorithms.AlgorithmConfig:
  """The named algorithm with the node's fields over its own defaults (absent keys keep the algorithm's)."""
  algo = _fields(node, list(default), "algorithm")
  name = algo.pop("name", default["name"])
  overrides = dict(_plain(algo.pop("overrides", None)) or {})
  try:
    return algorithms.get_algorithm(name, **{**algo, **overrides})
  except (TypeError, ValueError) as e:
    raise ValueError(f"algorithm: {e}") from None


def load(cd: Any) -> RunConfig:
  """ConfigDict (or nested dict) → validated RunConfig; raises ValueError naming the offending field."""
  top = dict(_plain(cd))
  if unknown := sorted(set(top) - set(_TOP)):
    raise ValueError(f"{unknown[0]} is not a config field; top-level fields are {', '.join(_TOP)}")
  workdir = top.get("workdir", "")
  if not isinstance(workdir, str) or not workdir.strip():
    raise ValueError(f"workdir={workdir!r}: give a directory for checkpoints and logs")
  default = defaults()
  preset, model_cfg, hf_dir, lora = _model(top.get("model"), default["model"])
  sections = {k: _section(cls, top.get(k), k) for k, cls in _SECTIONS.items() if k != "plan"}
  sections.update({k: sections[k].absolute() for k in ("data", "teacher", "judge")})
  run = RunConfig(
      seed=_coerce(top.get("seed", default["seed"]), int, "seed"),
      workdir=os.path.abspath(os.path.expanduser(workdir)),  # orbax refuses relative paths
      deterministic=_coerce(top.get("deterministic", default["deterministic"]), bool, "deterministic"),
      model_preset=preset, model=model_cfg, hf_checkpoint=hf_dir, lora=lora,
      topology=TopologyConfig.from_dict(_plain(top.get("topology")) or {}),
      algorithm=_algorithm(top.get("algorithm"), default["algorithm"]),
      faults=FaultsConfig.parse(**_fields(top.get("faults"), list(default["faults"]), "faults")),
      plan=_section(PlanConfig, top["plan"], "plan") if top.get("plan") is not None else None, **sections)
  validate(run)
  return run


def validate(run: RunConfig) -> None:
  """Each section's own rules, then the rules across sections; raises ValueError naming the fields."""
  for section in (run.controller, run.rollout, run.optimizer, run.eval, run.init, run.checkpoint, run.reward,
                  run.data, run.env, run.faults, run.lora, run.teacher, run.judge, *([run.plan] if run.plan else [])):
    section.validate()
  if run.env.name:
    env_registry.get(run.env.name)  # a registered environment or an importable "module:Class"
  ctl, r, o, e, algo = run.controller, run.rollout, run.optimizer, run.eval, run.algorithm
  checks = [
      (not run.deterministic or ctl.push_every == 1,
       "deterministic=True needs controller.push_every=1 (a fixed staleness schedule)"),
      (not run.deterministic or ctl.queue_size >= ctl.max_staleness,
       f"deterministic=True needs controller.queue_size >= max_staleness={ctl.max_staleness} (checkpoints carry "
       "the rollouts generated ahead of the trainer)"),
      (not (run.deterministic and r.inflight_updates),
       "deterministic=True is incompatible with rollout.inflight_updates=True"),
      (r.slots <= 0 or r.slots % math.lcm(r.samples_per_prompt, max(1, e.n_samples)) == 0,
       f"rollout.slots={r.slots} must be a multiple of rollout.samples_per_prompt={r.samples_per_prompt} and "
       f"eval.n_samples={e.n_samples} (whole groups share a prefill)"),
      (algo.value_warmup_steps < ctl.steps or ctl.steps == 0 or not algo.has_value_model,
       f"algorithm.overrides.value_warmup_steps={algo.value_warmup_steps} must be < controller.steps="
       f"{ctl.steps} (the policy would never be trained)"),
      (not algo.needs_groups or r.samples_per_prompt >= 2,
       f"algorithm {algo.name!r} normalizes within groups: rollout.samples_per_prompt must be >= 2, "
       f"got {r.samples_per_prompt}"),
      (o.micro_batches >= 1 and r.rows % o.micro_batches == 0,
       f"optimizer.micro_batches={o.micro_batches} does not divide the batch of {r.rows} rows "
       "(rollout.prompts_per_step x samples_per_prompt)"),
      (o.pack_tokens in (-1, 0) or o.pack_tokens >= r.max_prompt_len + r.max_new_tokens,
       f"optimizer.pack_tokens={o.pack_tokens} is shorter than the longest sequence, rollout.max_prompt_len + "
       f"max_new_tokens = {r.max_prompt_len + r.max_new_tokens}: raise it (or -1: that length, 0: no packing)"),
      (run.model.param_dtype != "float16",
       "model.overrides.param_dtype='float16': Adam's moments underflow in float16 and the first update turns the "
       "weights to inf/NaN; keep master weights in float32 or bfloat16 (dtype='float16' compute is fine)"),
      (not (run.lora.enabled and run.init.sft_steps),
       "model.lora: a warm start (init.sft_steps) with adapters is not supported yet"),
  ]
  for ok, msg in checks:
    if not ok:
      raise ValueError(msg)
  services.check(run)  # the teacher's and the judge's rules
  check_workdir(run.workdir)


def to_dict(run: RunConfig) -> dict[str, Any]:
  """JSON-able dict of the run config (what checkpoints record)."""
  return dataclasses.asdict(run)
