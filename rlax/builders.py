"""Config → objects: the one place that reads an ml_collections config and builds rlax parts.

Each builder validates what it reads and raises ValueError naming the config
field, so a bad override fails before any device work starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlax import algorithms as A
from rlax import models as M
from rlax.data import synthetic
from rlax.data.records import Record
from rlax.trainer.optimizer import OptimizerConfig


def model_config(c) -> M.ModelConfig:
  overrides = dict(c.model.overrides.to_dict() if hasattr(c.model.overrides, "to_dict") else c.model.overrides)
  return M.preset(c.model.preset, **overrides)


def algorithm(c) -> A.AlgorithmConfig:
  overrides = dict(c.algorithm.overrides.to_dict() if hasattr(c.algorithm.overrides, "to_dict")
                   else c.algorithm.overrides)
  kw = dict(kl_coef=c.algorithm.kl_coef, kl_estimator=c.algorithm.kl_estimator,
            entropy_coef=c.algorithm.entropy_coef)
  kw.update(overrides)
  return A.get_algorithm(c.algorithm.name, **kw)


def optimizer(c, total_steps: int) -> OptimizerConfig:
  o = c.optimizer
  return OptimizerConfig(lr=o.lr, schedule=o.schedule, warmup_steps=o.warmup_steps,
                         total_steps=total_steps if o.schedule == "cosine" else None,
                         b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
                         max_grad_norm=o.clip_norm if o.clip_norm else None)


def _shape_records(records: list[Record], d) -> list[Record]:
  if d.ops:
    if d.task != "arithmetic":
      raise ValueError(f"data.ops={d.ops!r} applies to task 'arithmetic' only, not {d.task!r}")
    records = [r for r in records if all(ch in d.ops for ch in r.metadata["expression"] if ch in "+-*/")]
  if d.prompt_style == "compact":
    if any("compact" not in r.metadata for r in records[:1]):
      raise ValueError(f"data.prompt_style='compact': task {d.task!r} has no compact prompt form")
    records = [dataclasses.replace(r, prompt=r.metadata["compact"]) for r in records]
  elif d.prompt_style != "instruct":
    raise ValueError(f"data.prompt_style={d.prompt_style!r}; expected 'instruct' or 'compact'")
  return records


def datasets(c) -> tuple[list[Record], list[Record]]:
  """Train and held-out eval records of the configured synthetic task.

  The eval set (n_eval distinct prompts, drawn with data.eval_seed) comes first;
  every training record with an eval prompt is removed, so pass@k is measured on
  problems the policy never trained on.
  """
  d = c.data
  held, seen = [], set()
  for r in _shape_records(synthetic.generate(d.task, d.n_eval * 8, difficulty=d.difficulty, seed=d.eval_seed), d):
    if r.prompt not in seen and len(held) < d.n_eval:
      held.append(r)
      seen.add(r.prompt)
  train = [r for r in _shape_records(synthetic.generate(d.task, d.n_train, difficulty=d.difficulty, seed=c.seed), d)
           if r.prompt not in seen]
  if not train or not held:
    raise ValueError(f"data: {len(train)} train / {len(held)} held-out records after filtering; "
                     "widen data.ops, raise data.n_train or data.difficulty")
  return train, held


def validate(c) -> None:
  """Cross-field checks no single builder can make; raises ValueError with the offending fields."""
  ctl, r = c.controller, c.rollout
  if ctl.max_staleness < 0:
    raise ValueError(f"controller.max_staleness={ctl.max_staleness} must be >= 0")
  if ctl.push_every < 1:
    raise ValueError(f"controller.push_every={ctl.push_every} must be >= 1")
  if ctl.push_every > ctl.max_staleness + 1:
    raise ValueError(f"controller.push_every={ctl.push_every} > max_staleness+1={ctl.max_staleness + 1}: "
                     "the sampler would wait forever for fresh enough weights")
  if c.deterministic and ctl.push_every != 1:
    raise ValueError("deterministic=True needs controller.push_every=1 (a fixed staleness schedule)")
  if c.deterministic and ctl.queue_size < ctl.max_staleness:
    raise ValueError(f"deterministic=True needs controller.queue_size >= max_staleness={ctl.max_staleness} "
                     "(checkpoints carry the rollouts generated ahead of the trainer)")
  if c.deterministic and r.inflight_updates:
    raise ValueError("deterministic=True is incompatible with rollout.inflight_updates=True")
  if r.inflight_updates and not r.decode_chunk:
    raise ValueError("rollout.inflight_updates=True needs rollout.decode_chunk > 0")
  if r.samples_per_prompt < 1 or r.prompts_per_step < 1:
    raise ValueError("rollout.samples_per_prompt and rollout.prompts_per_step must be >= 1")
  group_algos = ("grpo", "dr_grpo", "dapo", "rloo", "gspo", "cispo")
  if c.algorithm.name in group_algos and r.samples_per_prompt < 2:
    raise ValueError(f"algorithm {c.algorithm.name!r} normalizes within groups: "
                     f"rollout.samples_per_prompt must be >= 2, got {r.samples_per_prompt}")
  if c.algorithm.name == "ppo":
    raise ValueError("algorithm 'ppo' needs a value model, which this runtime does not train yet; "
                     "use grpo, dr_grpo, dapo, rloo, reinforce_pp, gspo or cispo")
  if r.temperature <= 0:
    raise ValueError(f"rollout.temperature={r.temperature} must be > 0 for RL sampling")
  model_config(c)
  algorithm(c)
