"""Evaluating a model without training it: an HF directory or a run's checkpoint, on a data file, a task, or
the run config's own held-out set, through the same held-out evaluation the runtime runs before and after
training (`rlax.evaluation.held_out`): the same model, data, samples and seed give the same numbers.

    evaluate_model(config, model="~/models/smollm2", data="gsm8k_test.jsonl")
    evaluate_model(config, checkpoint="runs/smollm2", task="multiplication")
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import jax
import ml_collections

from rlax import builders
from rlax import config as config_lib
from rlax import evaluation
from rlax import export
from rlax import models
from rlax.data.records import read_records
from rlax.models import lora as lora_lib
from rlax.topology import build_topology


def _config(cd: Any, *, model: Optional[str], checkpoint: Optional[str], step: Optional[int], task: Optional[str],
            n_samples: Optional[int]):
  """(RunConfig, params or None, where the weights come from)."""
  cd = ml_collections.ConfigDict(config_lib.to_dict(cd) if isinstance(cd, config_lib.RunConfig) else cd)
  params, source, saved = None, "init", None
  if checkpoint:
    done, params, meta = export.restore_params(checkpoint, step)
    saved, source = (meta.get("config") or {}).get("model"), f"{os.path.abspath(checkpoint)}@{done}"
  with cd.unlocked():
    if model:
      cd.model.hf_checkpoint = os.path.abspath(os.path.expanduser(model))
      source = cd.model.hf_checkpoint
    elif not checkpoint and cd.get("model", {}).get("hf_checkpoint"):
      source = cd.model.hf_checkpoint
    if task:
      cd.data.task, cd.data.train_files, cd.data.eval_files = task, "", ""
    if n_samples:
      cd.eval.n_samples = int(n_samples)
    cd.workdir = tempfile.mkdtemp(prefix="rlax-eval-")  # evaluation writes nothing a run keeps
  run = config_lib.load(cd)
  if saved is not None and saved != config_lib.to_dict(run)["model"]:
    raise ValueError(f"--checkpoint={checkpoint} holds a different model than --config builds (pass the config "
                     "the run trained with)")
  return run, params, source


def evaluate_model(cd: Any, *, model: Optional[str] = None, checkpoint: Optional[str] = None,
                   step: Optional[int] = None, data: Optional[str] = None, task: Optional[str] = None,
                   n_samples: Optional[int] = None, greedy: bool = True, n_prompts: int = 0) -> dict:
  """Held-out metrics of a model as one dict: pass@1, pass@n (unbiased), greedy accuracy, mean reward, mean
  length, truncation rate, per source where there are several.

  cd: a run config (its sampling, reward, template and eval sections apply); model: an HF directory;
  checkpoint: a run's workdir (its newest checkpoint, or `step`; `cd` should be the config it trained with:
  its model must match); data: comma-separated files (every record, columns as `cd`'s data
  section maps them); task: a task name (its held-out set as a run draws it); neither: `cd`'s held-out set.
  n_prompts > 0: the first n_prompts records only.
  """
  if model and checkpoint:
    raise ValueError("give --model (an HF directory) or --checkpoint (a run's workdir), not both")
  if data and task:
    raise ValueError("give --data (files) or --task (a task name), not both")
  run, params, source = _config(cd, model=model, checkpoint=checkpoint, step=step, task=task, n_samples=n_samples)
  tok = builders.tokenizer(run)
  render = builders.renderer(run, tok)
  if data:
    records = [r for path in data.split(",") if path.strip() for r in read_records(path.strip(), run.data.columns())]
  else:
    records = builders.datasets(run)[1]
  records, dropped = render.fitting(records[:n_prompts] if n_prompts > 0 else records, run.rollout.max_prompt_len)
  if not records:
    raise ValueError(f"no record fits rollout.max_prompt_len={run.rollout.max_prompt_len} tokens")
  topology = build_topology(run.topology)
  sampler = builders.sampler(run, topology.sampler_mesh, tok)
  if params is None:
    params = builders.initial_params(run, topology.sampler_mesh)
  elif run.lora.enabled:  # a LoRA run's checkpoint holds adapters: merge them into the base
    adapters = jax.device_put(params, lora_lib.adapter_shardings(run.model, run.lora, topology.sampler_mesh))
    params = jax.jit(lambda b, a: lora_lib.merge(b, a, run.lora))(
        builders.initial_params(run, topology.sampler_mesh), adapters)
  else:
    params = jax.device_put(params, models.param_shardings(run.model, topology.sampler_mesh))
  sampler.update_weights(params, 0)
  pool = builders.verifier_pool(run)
  try:
    reward_fn = builders.reward_fn(run)
    res = evaluation.held_out(records, sampler=sampler, render=render, reward_fn=reward_fn, pool=pool,
                              method=builders.eval_method(run), n=run.eval.n_samples, seed=run.seed + 1,
                              episodes=builders.episodes(run, tok, render, reward_fn, pool), greedy=greedy)
  finally:
    pool.close()
  return {"model": source, "data": data or run.data.task, "n_samples": run.eval.n_samples,
          "prompts_dropped": dropped, **res}
