"""Base rlax config: every field the runtime reads (typed and validated by rlax.config.load).

  python -m launch.main --config=configs/base.py --config.algorithm.name=dapo

Other configs start from `get_config()` here and override what differs. The defaults are the section
dataclasses' (rlax.config.defaults()); the fields each section holds, and what they mean:

  seed, workdir, deterministic: deterministic=True fixes the staleness schedule, so a resumed run is bitwise
    reproducible.
  model (rlax.models): a preset name plus field overrides, or hf_checkpoint: a local HF directory
    (config.json, safetensors, tokenizer) whose config and weights the policy starts from (overrides still
    apply). lora: low-rank adapters on the trainer (rank 0: every weight trains); targets "all", "attention",
    "mlp" or names (q,k,v,o,gate,up,down); adapters commonly want ~10x the full fine-tuning learning rate.
  init (rlax.trainer.config.InitConfig): a supervised warm start before RL.
  topology (rlax.topology.TopologyConfig): devices → slices → roles; slice_size simulates slices on CPU/GPU
    (TPU: None, slices from device.slice_index); colocated: trainer and sampler time-share the same slices.
  algorithm (rlax.algorithms): the registered name, KL and entropy terms, and AlgorithmConfig overrides.
  optimizer (rlax.trainer.config.OptimizerSection): AdamW, schedule, clipping, micro-batches, token packing.
  rollout (rlax.rollout.config.RolloutConfig): prompts x samples per step, lengths, sampling, decode slots,
    in-flight weight swaps.
  controller (rlax.runtime.config.ControllerConfig): steps, staleness bound k, weight pushes, non-finite
    batches.
  data (rlax.data.config.DataConfig): task: a built-in task, "reasoning_gym:<dataset>" or a mixture
    "a=2,b=1" (task_options: JSON options); prompt_style "instruct" (answer in <answer> tags) or "compact"
    (arithmetic only: "12+34=" → "46"); ops: keep arithmetic problems using only these operators.
    train_files / eval_files: the user's .jsonl / .json / .parquet prompts or datasets directories
    (comma-separated) instead of the task; prompt_key / messages_key / answer_key: the files' field names
    (dotted paths); answer_format "gsm8k": the answer after "####". template: "chat" / "plain" / "auto"
    (chat when the tokenizer has a template); instruction: the user turn around {prompt}.
  reward (rlax.rewards.config.RewardConfig): answer: where the final answer is found ("auto", "boxed",
    "last_number", "answer_tag"); format_weight: reward for stating it in that format. Each grading runs in
    a process under a deadline (timeout_s), an address-space cap (memory_mb) and a size limit (max_chars:
    longer completions score 0). sandbox: "auto" runs policy-written code in the jail (bubblewrap + seccomp)
    and refuses without one; "unsafe" is the explicit opt-in to run it with resource limits only (README:
    Security). name "judge": a generative judge grades (the `judge` section).
  teacher (rlax.teachers.config.TeacherConfig): the model a distilling run learns from (algorithm distill_coef,
    forward_kl_coef); routes {name: HF dir} with route_field: a teacher per record, by its metadata.
  judge (rlax.judges.config.JudgeConfig): reward.name="judge": an HF model beside the sampler reads the rubric,
    question, reference and reply (template) and writes a verdict (a number, a label or a JSON field).
  env (rlax.envs.config.EnvConfig): multi-turn episodes; name "" = one-shot rollouts; "calculator", "retry",
    "single_turn" or "module:Class".
  eval (rlax.runtime.config.EvalConfig): on data.n_eval held-out prompts; greedy: also greedy accuracy.
  checkpoint (rlax.runtime.config.CheckpointConfig): export_every > 0 also writes an HF directory every N
    steps (the final policy always goes to workdir/export).
  faults (rlax.runtime.config.FaultsConfig): simulated slice preemption (rlax.runtime.failover):
    "slice:step,..." loses / restores a slice at a step boundary; kill_in_recovery "phase[:kill|term],..."
    signals the process inside recovery phases (tests).
"""

import ml_collections

from rlax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg  # base takes no argument
  fields = config_lib.defaults()
  fields["workdir"] = "runs/base"
  # Unlike the library (one slice of every device), the base run simulates 2 trainer + 2 sampler slices of 2.
  fields["topology"].update(slice_size=2, trainer_slices=2, sampler_slices=2)
  return ml_collections.ConfigDict(fields)
