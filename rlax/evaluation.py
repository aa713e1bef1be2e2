"""Evaluation, the one module for it: n samples per prompt, graded, summarized as unbiased pass@k.

pass@k (Chen et al. 2021) from n ≥ k samples of which c are correct is 1 - C(n-c, k)/C(n, k),
computed as the product 1 - ∏_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
`evaluate` takes the controller's own `generate_fn(records, n) -> [[completion] * n]` and a
reward function, and reports pass@k overall and per record source, plus the mean reward, the mean
completion length and the truncation rate, and greedy accuracy when given a greedy generate_fn.
`held_out` is the held-out evaluation of a policy on the sampler, the one the runtime runs before and after
training (`Controller.evaluate`). `evaluate_model` runs it on a model without training it (an HF directory or
a run's checkpoint; `python -m launch.evaluate` is its command line): the same numbers for the same model,
data, samples and seed.

    evaluate_model(config, model="~/models/smollm2", data="gsm8k_test.jsonl")
    evaluate_model(config, checkpoint="runs/smollm2", task="multiplication")
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
import tempfile
from typing import Any, Callable, Optional, Sequence

from absl import logging
import ml_collections
import numpy as np

from rlax import builders
from rlax import checkpoint as checkpoint_lib
from rlax import config as config_lib
from rlax import envs
from rlax.envs import episodes as episodes_lib
from rlax.models import hf
from rlax.models.config import NUMERICS
from rlax.sampler import Greedy
from rlax.topology import build_topology

GenerateFn = Callable[[list, int], list[list[str]]]  # (records, n) → n completions each
RewardFn = Callable[[str, object], tuple[float, dict]]


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one prompt with c of n samples correct (needs 0 ≤ c ≤ n, 1 ≤ k ≤ n)."""
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(num_correct: Sequence[int], n: int, k: int) -> float:
  """Mean pass@k over prompts, each with `num_correct[i]` of n samples correct."""
  if not len(num_correct):
    raise ValueError("mean_pass_at_k needs at least one prompt")
  return float(np.mean([pass_at_k(n, int(c), k) for c in num_correct]))


def _graded(generate_fn: GenerateFn, chunk: list, reward_fn: RewardFn, n: int, grade_fn) -> np.ndarray:
  """[len(chunk), n] rewards of n sampled completions per record."""
  outs = generate_fn(chunk, n)
  if len(outs) != len(chunk) or any(len(o) != n for o in outs):
    raise ValueError(f"generate_fn returned {[len(o) for o in outs]} for {len(chunk)} prompts x n={n}")
  flat_c = [c for o in outs for c in o]
  flat_r = [r for r in chunk for _ in range(n)]
  if grade_fn is None:
    graded = [reward_fn(c, r) for c, r in zip(flat_c, flat_r)]
  else:
    graded = grade_fn(reward_fn, flat_c, flat_r)
  return np.array([g[0] for g in graded], dtype=np.float64).reshape(len(chunk), n)


def evaluate(generate_fn: GenerateFn, records: Sequence, reward_fn: RewardFn, n: int,
             ks: Sequence[int] = (1,), success: float = 0.5, batch_size: int = 64,
             grade_fn: Optional[Callable] = None, rewards_fn: Optional[Callable] = None,
             greedy_fn: Optional[GenerateFn] = None) -> dict[str, float]:
  """Samples n completions per record, grades them, returns metrics.

  rewards_fn(records, n) -> [len(records), n] rewards replaces generate_fn and grading (episodes, rewarded as
  they end: `rlax.envs.episodes.rewards_fn`; greedy_fn then returns rewards too).

  A sample counts as correct when its reward > `success`. `grade_fn(fn, completions, records)`
  may be a `VerifierPool.grade` to grade in parallel (default: sequential calls of `reward_fn`).
  Returns {'pass@k': ..., 'pass@k/<source>': ..., 'mean_reward': ..., 'num_prompts': ..., and, where the
  generator records them (`.lengths`), 'mean_length' and 'truncation_rate'; with greedy_fn (one greedy
  completion per record) 'greedy_accuracy' (and per source)}.
  """
  if any(k > n or k < 1 for k in ks):
    raise ValueError(f"every k in {list(ks)} must satisfy 1 <= k <= n={n}")
  correct, rewards_all = [], []
  for start in range(0, len(records), batch_size):
    chunk = list(records[start:start + batch_size])
    if rewards_fn is not None:
      rw = np.asarray(rewards_fn(chunk, n), np.float64).reshape(len(chunk), n)
    else:
      rw = _graded(generate_fn, chunk, reward_fn, n, grade_fn)
    rewards_all.append(rw)
    correct.extend(int(x) for x in (rw > success).sum(axis=1))
  by_source = collections.defaultdict(list)
  for r, c in zip(records, correct):
    by_source[r.source].append(c)
  metrics = {"num_prompts": float(len(records)),
             "mean_reward": float(np.concatenate(rewards_all).mean()) if rewards_all else 0.0}
  for k in ks:
    metrics[f"pass@{k}"] = mean_pass_at_k(correct, n, k)
    if len(by_source) > 1:
      for src, cs in sorted(by_source.items()):
        metrics[f"pass@{k}/{src}"] = mean_pass_at_k(cs, n, k)
  lengths = getattr(rewards_fn if rewards_fn is not None else generate_fn, "lengths", None)
  if lengths:
    metrics["mean_length"] = float(np.mean([t for t, _ in lengths]))
    metrics["truncation_rate"] = float(np.mean([c for _, c in lengths]))
  if greedy_fn is not None:
    right = []
    for start in range(0, len(records), batch_size):
      chunk = list(records[start:start + batch_size])
      rw = (np.asarray(greedy_fn(chunk, 1), np.float64).reshape(len(chunk), 1) if rewards_fn is not None
            else _graded(greedy_fn, chunk, reward_fn, 1, grade_fn))
      right.extend(bool(x) for x in rw[:, 0] > success)
    metrics["greedy_accuracy"] = float(np.mean(right))
    if len(by_source) > 1:
      for src in sorted(by_source):
        metrics[f"greedy_accuracy/{src}"] = float(np.mean([ok for r, ok in zip(records, right) if r.source == src]))
  logging.vlog(1, "evaluation: %s", {m: round(v, 4) for m, v in metrics.items()})
  return metrics


def held_out(records: Sequence, *, sampler, render, reward_fn: RewardFn, pool, method, n: int, seed: int,
             weights=None, episodes=None, greedy: bool = False) -> dict[str, float]:
  """Held-out pass@1 and pass@n of the policy `weights` (a source as the sampler reads it; None: its own)
  on `records`: n episodes each with `method`, keys from `seed`, as training samples them: `episodes` (the
  `rlax.builders.episodes` factory, rewarded by the environment; its episode stats added), None: one-turn
  episodes of `render`'s prompts graded with `reward_fn` in `pool`; with greedy, greedy accuracy too."""
  episodes = episodes or envs.single_turn_episodes(render, reward_fn, pool.grade)
  sampled = episodes_lib.rewards_fn(episodes, sampler, method, seed=seed, weights=weights)
  greedy_fn = episodes_lib.rewards_fn(episodes, sampler, Greedy(), seed=seed, weights=weights) if greedy else None
  res = evaluate(None, records, reward_fn, n=n, ks=sorted({1, n}), grade_fn=pool.grade, rewards_fn=sampled,
                 greedy_fn=greedy_fn)
  res.update(sampled.stats())  # multi-turn: how the episodes went (turns, tool calls, valid-call rate, stops)
  return res


def _run_config(cfg: Any, *, model: Optional[str], task: Optional[str],
                n_samples: Optional[int]) -> config_lib.RunConfig:
  """`cfg` (a ConfigDict or a typed RunConfig) with the overrides applied, in a scratch workdir: evaluation
  writes nothing a run keeps."""
  workdir = tempfile.mkdtemp(prefix="rlax-eval-")
  model = os.path.abspath(os.path.expanduser(model)) if model else None
  if not isinstance(cfg, config_lib.RunConfig):
    cd = ml_collections.ConfigDict(copy.deepcopy(cfg))  # the caller's config stays as given
    with cd.unlocked():
      if model:
        cd.model.hf_checkpoint = model
      if task:
        cd.data.task, cd.data.train_files, cd.data.eval_files = task, "", ""
      if n_samples:
        cd.eval.n_samples = int(n_samples)
      cd.workdir = workdir
    return config_lib.load(cd)
  run = cfg.replace(workdir=workdir)
  if model:
    if not os.path.isfile(os.path.join(model, "config.json")):
      raise ValueError(f"--model={model}: no config.json there (an HF model directory is needed)")
    shape = hf.read_config(model).replace(**{k: getattr(run.model, k) for k in NUMERICS})
    run = run.replace(model=shape, hf_checkpoint=model, model_preset="hf")
  if task:
    run = run.replace(data=dataclasses.replace(run.data, task=task, train_files="", eval_files=""))
  if n_samples:
    run = run.replace(eval=dataclasses.replace(run.eval, n_samples=int(n_samples)))
  config_lib.validate(run)
  return run


def evaluate_model(cfg: Any, *, model: Optional[str] = None, checkpoint: Optional[str] = None,
                   step: Optional[int] = None, data: Optional[str] = None, task: Optional[str] = None,
                   n_samples: Optional[int] = None, greedy: bool = True, n_prompts: int = 0) -> dict:
  """Held-out metrics of a model as one dict: pass@1, pass@n (unbiased), greedy accuracy, mean reward, mean
  length, truncation rate, per source where there are several.

  cfg: a run config, a ConfigDict or a typed `rlax.config.RunConfig` (its sampling, reward, template and eval
  sections apply); model: an HF directory; checkpoint: a run's workdir (its newest checkpoint, or `step`, read
  by `rlax.checkpoint.load_policy`; `cfg` should be the config it trained with: its model must match); data:
  comma-separated files (every record, columns as `cfg`'s data section maps them); task: a task name (its
  held-out set as a run draws it); neither: `cfg`'s held-out set. n_prompts > 0: the first n_prompts records.
  """
  if model and checkpoint:
    raise ValueError("give --model (an HF directory) or --checkpoint (a run's workdir), not both")
  if data and task:
    raise ValueError("give --data (files) or --task (a task name), not both")
  run = _run_config(cfg, model=model, task=task, n_samples=n_samples)
  tok = builders.tokenizer(run)
  render = builders.renderer(run, tok)
  if data:
    records = builders.read_files(run, [path.strip() for path in data.split(",") if path.strip()])
  else:
    records = builders.datasets(run)[1]
  records, dropped = render.fitting(records[:n_prompts] if n_prompts > 0 else records, run.rollout.max_prompt_len)
  if not records:
    raise ValueError(f"no record fits rollout.max_prompt_len={run.rollout.max_prompt_len} tokens")
  mesh = build_topology(run.topology).sampler_mesh
  if checkpoint:
    policy = checkpoint_lib.load_policy(checkpoint, step, mesh=mesh)
    if policy.model != run.model:
      raise ValueError(f"--checkpoint={checkpoint} holds a different model than --config builds (pass the config "
                       "the run trained with)")
    params, source = policy.params, f"{os.path.abspath(checkpoint)}@{policy.step}"
  else:
    params, source = builders.initial_params(run, mesh), run.hf_checkpoint or "init"
  sampler = builders.sampler(run, mesh, tok)
  sampler.update_weights(params, 0)
  pool = builders.verifier_pool(run)
  try:
    reward_fn = builders.reward_fn(run)
    if run.reward.name == "judge":
      reward_fn.judge = builders.judge(run, mesh)
    episodes = builders.episodes(run, tok, render, reward_fn, pool)
    try:
      episodes.check_prompts(records)
      res = held_out(records, sampler=sampler, render=render, reward_fn=reward_fn, pool=pool,
                     method=builders.eval_method(run), n=run.eval.n_samples, seed=run.seed + 1,
                     episodes=episodes, greedy=greedy)
    finally:
      episodes.close()  # a search run's retrieval service
  finally:
    pool.close()
  return {"model": source, "data": data or run.data.task, "n_samples": run.eval.n_samples,
          "prompts_dropped": dropped, **res}
