"""The typed run config: frozen dataclasses made once, at the launch boundary, from the user's ConfigDict.

ml_collections stays the user's interface (`--config=configs/demo.py --config.rollout.max_new_tokens=16`);
`load(config_dict)` turns it into a `RunConfig`: every field type-checked, paths made absolute, and every
cross-field rule checked, each failure one ValueError naming the field. This is the only module that
sees a ConfigDict; library code reads `RunConfig`. A field that no code reads does not exist here, and
an unknown field in the ConfigDict is an error naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from typing import Any, Optional

from rlax import algorithms
from rlax import models
from rlax.envs.base import EnvConfig
from rlax.models.lora import LoraConfig, parse_targets
from rlax.rewards import sandbox
from rlax.topology import TopologyConfig
from rlax.trainer.optimizer import OptimizerConfig

# Algorithms whose advantage normalizes within a prompt's group of samples.
GROUP_ALGORITHMS = ("grpo", "dr_grpo", "dapo", "rloo", "gspo", "cispo", "reinforce_pp_baseline")
# Algorithms this runtime trains end to end (every registry name; 'ppo' trains its value model alongside).
RUNTIME_ALGORITHMS = GROUP_ALGORITHMS + ("reinforce_pp", "ppo")


@dataclasses.dataclass(frozen=True)
class InitConfig:
  """Supervised warm start before RL: `sft_steps` updates of `sft_batch` rows at `sft_lr` (0: none)."""
  sft_steps: int = 0
  sft_batch: int = 64
  sft_lr: float = 1e-3


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
  """AdamW + schedule + clipping, and how a batch splits into micro-batches on the trainer."""
  lr: float = 1e-5
  warmup_steps: int = 0
  schedule: str = "constant"
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  clip_norm: float = 1.0
  micro_batches: int = 1
  micro_batch_tokens: int = 0
  # Rows of packed real tokens the trainer computes on (rlax.rollout.packing.pack_tokens): -1 = per batch the
  # cheaper of the padded row length and a whole group's (packing.auto_row_lens), 0 = padded rows.
  pack_tokens: int = -1
  share_prompts: bool = True     # a group's responses attend to one copy of their prompt

  def optimizer(self, total_steps: int) -> OptimizerConfig:
    return OptimizerConfig(lr=self.lr, schedule=self.schedule, warmup_steps=self.warmup_steps,
                           total_steps=total_steps if self.schedule == "cosine" else None, b1=self.b1, b2=self.b2,
                           weight_decay=self.weight_decay, max_grad_norm=self.clip_norm or None)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Per step: `prompts_per_step` prompts x `samples_per_prompt` samples; lengths and sampling method."""
  prompts_per_step: int = 16
  samples_per_prompt: int = 8
  max_prompt_len: int = 32
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  decode_chunk: int = 16         # decode steps between admissions (and weight swaps)
  inflight_updates: bool = False
  slots: int = 0                 # decode slots (0: the batch's rows; -1: as many as free memory holds)
  stream_ahead: int = -1         # prompts kept in flight for the next batch (-1: prompts_per_step)
  on_swap: str = "recompute"     # unfinished rows' KV cache after new weights: "recompute" or "keep"

  @property
  def rows(self) -> int:
    return self.prompts_per_step * self.samples_per_prompt

  @property
  def ahead(self) -> int:
    """Prompts the engine keeps in flight for the next batch."""
    return self.prompts_per_step if self.stream_ahead < 0 else self.stream_ahead

  def decode_slots(self, eval_samples: int) -> int:
    """The engine's slots: `slots`, or the batch's rows rounded up to whole groups of both the
    rollout's and the evaluation's group size."""
    g = math.lcm(self.samples_per_prompt, eval_samples)
    return self.slots if self.slots > 0 else -(-self.rows // g) * g


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
  """The loop: `steps` RL steps; a sample is at most `max_staleness` (k) policy versions old."""
  steps: int = 100
  max_staleness: int = 1
  stale_policy: str = "drop"     # or "importance_weight"
  push_every: int = 1
  queue_size: int = 2
  dynamic_sampling: bool = False
  on_nonfinite: str = "skip"     # a batch with a non-finite reward, loss or gradient norm: "skip" it or "stop"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Prompts: a built-in synthetic task or the user's files; the held-out split; how prompts are rendered.

  With `train_files` (comma-separated .jsonl / .json / .parquet files or `datasets` directories, schema in
  rlax.data.records; `*_key` map other column names, dotted paths allowed) the task fields are ignored; the
  eval set is `eval_files`, or else `n_eval` prompts held out of the training files.
  Prompts longer than rollout.max_prompt_len tokens after rendering are dropped and counted.
  """
  task: str = "arithmetic"          # a built-in task, "reasoning_gym:<dataset>", or a mixture "a=2,b=1"
  task_options: str = ""            # JSON: the task's options (reasoning-gym dataset config) or {task: options}
  difficulty: int = 1
  n_train: int = 4096
  n_eval: int = 128
  eval_seed: int = 12345
  prompt_style: str = "instruct"  # or "compact" (arithmetic, digit_sort)
  ops: str = ""                   # arithmetic: keep problems using only these operators
  train_files: str = ""
  eval_files: str = ""
  prompt_key: str = ""            # the files' field holding the prompt ("": "prompt")
  messages_key: str = ""          # ... the conversation ("": "messages")
  answer_key: str = ""            # ... the reference answer ("": "answer")
  answer_format: str = ""         # "gsm8k": the answer is the text after "####"
  template: str = "auto"          # "chat" (the tokenizer's chat template), "plain", or "auto"
  system_prompt: str = ""
  instruction: str = "{prompt}"   # the user turn; {prompt} is the record's prompt

  def files(self, which: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in getattr(self, f"{which}_files").split(",") if p.strip())

  def columns(self):
    from rlax.data.records import Columns  # pylint: disable=g-import-not-at-top
    return Columns(self.prompt_key, self.messages_key, self.answer_key, self.answer_format)


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """The reward by name; `answer`: how a final answer is found in free text; `format_weight`: bonus for
  stating it in that format."""
  name: str = "arithmetic"
  answer: str = "auto"            # "auto", "boxed", "last_number" or "answer_tag"
  format_weight: float = 0.0
  workers: int = 4
  timeout_s: float = 5.0
  memory_mb: int = 4096           # address space a grading process may grow by
  max_chars: int = 1 << 20        # longer completions get reward 0 without being graded
  sandbox: str = "auto"           # policy-written code: "auto" (the jail, refused without one), "unsafe" (opt-in)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out pass@k before and after training: `n_samples` samples per eval prompt."""
  n_samples: int = 8
  temperature: float = 1.0
  greedy: bool = False            # also greedy accuracy (one more greedy completion per prompt)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints of the train state; `export_every` > 0 also writes an HF directory every N steps
  (the final policy is always exported to <workdir>/export)."""
  every_steps: int = 50
  every_seconds: float = 600.0
  keep: int = 3
  grace_seconds: float = 30.0
  export_every: int = 0


# Phases of a slice-fault recovery (rlax.runtime.failover.recover), in order; "restore" only when the
# trainer moved.
RECOVERY_PHASES = ("reassign", "build", "restore", "push", "commit")


@dataclasses.dataclass(frozen=True)
class FaultsConfig:
  """Simulated slice preemption: (slice, step) pairs lost / restored at step boundaries, and signals sent
  to the process during recoveries: (phase, "SIGKILL" | "SIGTERM"), one per recovery, in order."""
  lose_slice_at: tuple[tuple[int, int], ...] = ()
  restore_slice_at: tuple[tuple[int, int], ...] = ()
  kill_in_recovery: tuple[tuple[str, str], ...] = ()

  @property
  def any(self) -> bool:
    return bool(self.lose_slice_at or self.restore_slice_at)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """Ahead-of-time planning only: the target topology and the chip's figures (see launch.plan)."""
  topology: str = "local"
  num_slices: int = 1
  chip: str = "v5p"
  hbm_gib: float = 95.0
  peak_tflops: float = 459.0
  hbm_tb_s: float = 2.76
  ici_gb_s: float = 300.0
  dcn_gb_s: float = 6.25
  sampler_batch: int = 8
  programs: str = ""              # comma-separated program names to compile (rlax.planning.PROGRAMS); "" = all


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one run reads. `model` and `algorithm` are resolved (preset + overrides applied)."""
  seed: int
  workdir: str
  deterministic: bool
  model_preset: str
  model: models.ModelConfig
  hf_checkpoint: str              # absolute path of the HF directory the policy starts from; "" = random init
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
  lora: LoraConfig = LoraConfig()  # model.lora: low-rank adapters (rank 0: every weight trains)

  def replace(self, **kw) -> "RunConfig":
    """A copy with top-level fields replaced (sections are frozen: replace them whole)."""
    return dataclasses.replace(self, **kw)


_SECTIONS = {"init": InitConfig, "optimizer": OptimizerSection, "rollout": RolloutConfig,
             "controller": ControllerConfig, "data": DataConfig,
             "reward": RewardConfig, "eval": EvalConfig, "env": EnvConfig, "checkpoint": CheckpointConfig, "plan": PlanConfig}
_TOP = ("seed", "workdir", "deterministic", "model", "topology", "algorithm", "faults", *_SECTIONS)


def _plain(node: Any) -> Any:
  return node.to_dict() if hasattr(node, "to_dict") else node


def _coerce(value: Any, typ: Any, field: str) -> Any:
  """`value` as `typ` (int, float, bool, str); ints are accepted for floats. ValueError names `field`."""
  if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if typ in (int, bool, str) and isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
    return value
  raise ValueError(f"{field}={value!r}: expected {typ.__name__}, got {type(value).__name__}")


def _fields(node: Any, names: list[str], path: str) -> dict[str, Any]:
  """The ConfigDict node `path` as a dict; a key outside `names` is an error naming it."""
  values = dict(_plain(node) or {})
  unknown = sorted(set(values) - set(names))
  if unknown:
    raise ValueError(f"{path}.{unknown[0]} is not a config field; {path} has {', '.join(names)}")
  return values


def _section(cls, node: Any, path: str):
  hints = typing.get_type_hints(cls)
  values = _fields(node, [f.name for f in dataclasses.fields(cls)], path)
  return cls(**{k: _coerce(v, hints[k], f"{path}.{k}") for k, v in values.items()})


def parse_schedule(spec: str, field: str) -> tuple[tuple[int, int], ...]:
  """'2:5,0:9' → ((slice 2, step 5), (slice 0, step 9)); empty string → ()."""
  out = []
  for part in (p.strip() for p in (spec or "").split(",")):
    if not part:
      continue
    try:
      sl, st = (int(x) for x in part.split(":"))
    except ValueError:
      raise ValueError(f"{field}={spec!r}: entries must look like 'slice:step', got {part!r}") from None
    if sl < 0 or st < 0:
      raise ValueError(f"{field}={spec!r}: slice and step must be >= 0, got {part!r}")
    out.append((sl, st))
  return tuple(out)


def parse_recovery_kills(spec: str) -> tuple[tuple[str, str], ...]:
  """'restore,build:term' → (("restore", "SIGKILL"), ("build", "SIGTERM")); empty string → ()."""
  out = []
  for part in (p.strip() for p in (spec or "").split(",")):
    if not part:
      continue
    phase, _, how = part.partition(":")
    sig = {"": "SIGKILL", "kill": "SIGKILL", "term": "SIGTERM"}.get(how)
    if phase not in RECOVERY_PHASES or sig is None:
      raise ValueError(f"faults.kill_in_recovery={spec!r}: entries must look like 'phase' or 'phase:kill|term' "
                       f"with phase one of {', '.join(RECOVERY_PHASES)}; got {part!r}")
    out.append((phase, sig))
  return tuple(out)


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
    return path, model_config.from_dict(fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"model.hf_checkpoint={path!r}: {e}") from None


def load(cd: Any) -> RunConfig:
  """ConfigDict (or nested dict) → validated RunConfig; raises ValueError naming the offending field."""
  top = dict(_plain(cd))
  unknown = sorted(set(top) - set(_TOP))
  if unknown:
    raise ValueError(f"{unknown[0]} is not a config field; top-level fields are {', '.join(_TOP)}")
  workdir = top.get("workdir", "")
  if not isinstance(workdir, str) or not workdir.strip():
    raise ValueError(f"workdir={workdir!r}: give a directory for checkpoints and logs")
  model = _fields(top.get("model"), ["preset", "overrides", "hf_checkpoint", "lora"], "model")
  lora_cfg = _fields(model.pop("lora", None), ["rank", "alpha", "dropout", "targets"], "model.lora")
  try:
    lora = LoraConfig(rank=_coerce(lora_cfg.get("rank", 0), int, "model.lora.rank"),
                      alpha=_coerce(lora_cfg.get("alpha", 16.0), float, "model.lora.alpha"),
                      dropout=_coerce(lora_cfg.get("dropout", 0.0), float, "model.lora.dropout"),
                      targets=parse_targets(lora_cfg.get("targets", "all"))).validate()
  except TypeError as e:
    raise ValueError(f"model.lora: {e}") from None
  preset = model.get("preset", "w1")
  hf_dir = _coerce(model.get("hf_checkpoint", ""), str, "model.hf_checkpoint")
  overrides = dict(_plain(model.get("overrides", {})) or {})
  if hf_dir:
    hf_dir, model_cfg = _hf_model(hf_dir, overrides)
    preset = "hf"
  else:
    try:
      model_cfg = models.preset(preset, **overrides)
    except (TypeError, ValueError) as e:  # an unknown preset, override or value
      raise ValueError(f"model: {e}") from None
  algo = _fields(top.get("algorithm"), ["name", "kl_coef", "kl_estimator", "entropy_coef", "overrides"],
                 "algorithm")
  name = algo.pop("name", "grpo")
  overrides = dict(_plain(algo.pop("overrides", {})) or {})
  try:
    algorithm = algorithms.get_algorithm(name, **{**algo, **overrides})
  except (TypeError, ValueError) as e:
    raise ValueError(f"algorithm: {e}") from None
  faults = _fields(top.get("faults"), ["lose_slice_at", "restore_slice_at", "kill_in_recovery"], "faults")
  sections = {k: _section(cls, top.get(k, {}), k) for k, cls in _SECTIONS.items() if k != "plan"}
  d = sections["data"]
  absolute = lambda spec: ",".join(os.path.abspath(os.path.expanduser(p)) for p in spec.split(",") if p.strip())
  sections["data"] = dataclasses.replace(d, train_files=absolute(d.train_files), eval_files=absolute(d.eval_files))
  run = RunConfig(
      seed=_coerce(top.get("seed", 0), int, "seed"),
      workdir=os.path.abspath(os.path.expanduser(workdir)),  # orbax refuses relative paths
      deterministic=_coerce(top.get("deterministic", False), bool, "deterministic"),
      model_preset=preset, model=model_cfg, hf_checkpoint=hf_dir,
      topology=TopologyConfig.from_dict(_plain(top.get("topology", {}))), algorithm=algorithm,
      faults=FaultsConfig(parse_schedule(faults.get("lose_slice_at", ""), "faults.lose_slice_at"),
                          parse_schedule(faults.get("restore_slice_at", ""), "faults.restore_slice_at"),
                          parse_recovery_kills(faults.get("kill_in_recovery", ""))),
      plan=_section(PlanConfig, top["plan"], "plan") if top.get("plan") is not None else None,
      lora=lora, **sections)
  validate(run)
  return run


def validate(run: RunConfig) -> None:
  """Single- and cross-field rules; raises ValueError naming the fields."""
  ctl, r, o, e, ck = run.controller, run.rollout, run.optimizer, run.eval, run.checkpoint
  checks = [
      (ctl.steps >= 0, f"controller.steps={ctl.steps} must be >= 0"),
      (ctl.max_staleness >= 0, f"controller.max_staleness={ctl.max_staleness} must be >= 0"),
      (ctl.push_every >= 1, f"controller.push_every={ctl.push_every} must be >= 1"),
      (ctl.queue_size >= 1, f"controller.queue_size={ctl.queue_size} must be >= 1"),
      (ctl.on_nonfinite in ("skip", "stop"), f"controller.on_nonfinite={ctl.on_nonfinite!r}: use 'skip' or 'stop'"),
      (ctl.stale_policy in ("drop", "importance_weight"),
       f"controller.stale_policy={ctl.stale_policy!r}: use 'drop' or 'importance_weight'"),
      (ctl.push_every <= ctl.max_staleness + 1,
       f"controller.push_every={ctl.push_every} > max_staleness+1={ctl.max_staleness + 1}: the sampler would "
       "wait forever for fresh enough weights"),
      (not run.deterministic or ctl.push_every == 1,
       "deterministic=True needs controller.push_every=1 (a fixed staleness schedule)"),
      (not run.deterministic or ctl.queue_size >= ctl.max_staleness,
       f"deterministic=True needs controller.queue_size >= max_staleness={ctl.max_staleness} (checkpoints carry "
       "the rollouts generated ahead of the trainer)"),
      (not (run.deterministic and r.inflight_updates),
       "deterministic=True is incompatible with rollout.inflight_updates=True"),
      (r.samples_per_prompt >= 1, f"rollout.samples_per_prompt={r.samples_per_prompt} must be >= 1"),
      (r.prompts_per_step >= 1, f"rollout.prompts_per_step={r.prompts_per_step} must be >= 1"),
      (r.max_prompt_len >= 1, f"rollout.max_prompt_len={r.max_prompt_len} must be >= 1"),
      (r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1"),
      (r.decode_chunk >= 1, f"rollout.decode_chunk={r.decode_chunk} must be >= 1"),
      (r.slots >= -1, f"rollout.slots={r.slots} must be >= -1"),
      (r.slots <= 0 or r.slots % math.lcm(r.samples_per_prompt, max(1, e.n_samples)) == 0,
       f"rollout.slots={r.slots} must be a multiple of rollout.samples_per_prompt={r.samples_per_prompt} and "
       f"eval.n_samples={e.n_samples} (whole groups share a prefill)"),
      (r.stream_ahead >= -1, f"rollout.stream_ahead={r.stream_ahead} must be >= -1"),
      (r.on_swap in ("recompute", "keep"), f"rollout.on_swap={r.on_swap!r} must be 'recompute' or 'keep'"),
      (r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0 for RL sampling"),
      (r.top_k >= 0, f"rollout.top_k={r.top_k} must be >= 0"),
      (0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]"),
      (not (r.top_k and r.top_p < 1), "rollout.top_k and rollout.top_p are exclusive; set one of them"),
      (run.algorithm.name in RUNTIME_ALGORITHMS,
       f"algorithm.name={run.algorithm.name!r}: the runtime trains {', '.join(RUNTIME_ALGORITHMS)}"),
      (run.algorithm.value_warmup_steps < ctl.steps or ctl.steps == 0 or not run.algorithm.has_value_model,
       f"algorithm.overrides.value_warmup_steps={run.algorithm.value_warmup_steps} must be < controller.steps="
       f"{ctl.steps} (the policy would never be trained)"),
      (run.algorithm.name not in GROUP_ALGORITHMS or r.samples_per_prompt >= 2,
       f"algorithm {run.algorithm.name!r} normalizes within groups: rollout.samples_per_prompt must be >= 2, "
       f"got {r.samples_per_prompt}"),
      (o.micro_batches >= 1 and r.rows % o.micro_batches == 0,
       f"optimizer.micro_batches={o.micro_batches} does not divide the batch of {r.rows} rows "
       "(rollout.prompts_per_step x samples_per_prompt)"),
      (o.micro_batch_tokens >= 0, f"optimizer.micro_batch_tokens={o.micro_batch_tokens} must be >= 0"),
      (o.pack_tokens in (-1, 0) or o.pack_tokens >= r.max_prompt_len + r.max_new_tokens,
       f"optimizer.pack_tokens={o.pack_tokens} is shorter than the longest sequence, rollout.max_prompt_len + "
       f"max_new_tokens = {r.max_prompt_len + r.max_new_tokens}: raise it (or -1: that length, 0: no packing)"),
      (o.schedule in ("constant", "cosine"), f"optimizer.schedule={o.schedule!r}: use 'constant' or 'cosine'"),
      (o.lr > 0, f"optimizer.lr={o.lr} must be > 0"),
      (e.n_samples >= 1, f"eval.n_samples={e.n_samples} must be >= 1"),
      (e.temperature > 0, f"eval.temperature={e.temperature} must be > 0"),
      (run.init.sft_steps >= 0 and run.init.sft_batch >= 1,
       f"init.sft_steps={run.init.sft_steps} must be >= 0 and init.sft_batch={run.init.sft_batch} >= 1"),
      (ck.keep >= 1, f"checkpoint.keep={ck.keep} must be >= 1"),
      (ck.every_steps >= 0 and ck.every_seconds >= 0,
       "checkpoint.every_steps and checkpoint.every_seconds must be >= 0 (0: off)"),
      (ck.grace_seconds > 0, f"checkpoint.grace_seconds={ck.grace_seconds} must be > 0"),
      (run.reward.workers >= 1 and run.reward.timeout_s > 0,
       "reward.workers must be >= 1 and reward.timeout_s > 0"),
      (run.reward.memory_mb >= 1 and run.reward.max_chars >= 1,
       f"reward.memory_mb={run.reward.memory_mb} and reward.max_chars={run.reward.max_chars} must be >= 1"),
      (not sandbox.mode_error(run.reward.sandbox), sandbox.mode_error(run.reward.sandbox)),
      (run.data.n_train >= 1 and run.data.n_eval >= 1 and run.data.difficulty >= 1,
       "data.n_train, data.n_eval and data.difficulty must be >= 1"),
      (run.data.prompt_style in ("instruct", "compact"),
       f"data.prompt_style={run.data.prompt_style!r}: use 'instruct' or 'compact'"),
      (run.data.template in ("auto", "chat", "plain"),
       f"data.template={run.data.template!r}: use 'auto', 'chat' or 'plain'"),
      ("{prompt}" in run.data.instruction, f"data.instruction={run.data.instruction!r} must contain '{{prompt}}'"),
      (run.data.train_files or not run.data.eval_files, "data.eval_files needs data.train_files"),
      (run.reward.answer in ("auto", "boxed", "last_number", "answer_tag"),
       f"reward.answer={run.reward.answer!r}: use 'auto', 'boxed', 'last_number' or 'answer_tag'"),
      (run.reward.format_weight >= 0, f"reward.format_weight={run.reward.format_weight} must be >= 0"),
      (ck.export_every >= 0, f"checkpoint.export_every={ck.export_every} must be >= 0 (0: final export only)"),
      (run.model.param_dtype != "float16",
       "model.overrides.param_dtype='float16': Adam's moments underflow in float16 and the first update turns the "
       "weights to inf/NaN; keep master weights in float32 or bfloat16 (dtype='float16' compute is fine)"),
  ]
  for ok, msg in checks:
    if not ok:
      raise ValueError(msg)
  run.env.validate()
  if run.lora.enabled and run.init.sft_steps:
    raise ValueError("model.lora: a warm start (init.sft_steps) with adapters is not supported yet")
  run.data.columns()  # a bad answer_format is one error
  _check_workdir(run.workdir)
  for which in ("train", "eval"):
    for path in run.data.files(which):
      if os.path.isdir(path.partition("#")[0]):
        continue  # a datasets directory
      if not path.endswith((".jsonl", ".json", ".parquet")):
        raise ValueError(f"data.{which}_files: {path!r} is not a .jsonl, .json or .parquet file or a datasets "
                         "directory")
      if not os.path.isfile(path):
        raise ValueError(f"data.{which}_files: {path!r} does not exist")


def _check_workdir(path: str) -> None:
  """The workdir, or the nearest existing directory above it, must be a writable directory: else the run
  would fail only when it first writes a log or checkpoint."""
  probe = path
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise ValueError(f"workdir={path!r}: {probe!r} exists and is not a directory")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise ValueError(f"workdir={path!r}: {probe!r} is not writable")


def to_dict(run: RunConfig) -> dict[str, Any]:
  """JSON-able dict of the run config (what checkpoints record)."""
  return dataclasses.asdict(run)

