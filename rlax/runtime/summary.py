"""The run's summary (the dict `Controller.run` returns, also written to <workdir>/summary.json)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Mapping

import jax
import numpy as np

from rlax.config import RunConfig


def params_sha256(params: Any) -> str:
  """One digest of every parameter's bytes: runs that must end bitwise equal compare it."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(jax.device_get(params)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return digest.hexdigest()


def of_run(run: RunConfig, *, steps: int, finished: bool, params: Any, staleness_hist: Mapping[int, int],
           failovers: int, prompts_dropped: dict, history: list[dict]) -> dict:
  return {"steps": steps, "preempted": not finished,
          "staleness_hist": {str(k): v for k, v in sorted(staleness_hist.items())},
          "params_sha256": params_sha256(params), "failovers": failovers,
          "processes": jax.process_count(),
          "model": run.hf_checkpoint or run.model_preset, "algorithm": run.algorithm.name,
          "task": ",".join(run.data.files("train")) or run.data.task,
          "prompts_dropped": prompts_dropped,
          "nonfinite_skipped": int(sum(r.get("nonfinite_skipped") or 0 for r in history))}


def add_evals(summary: dict, before: dict, after: dict, n: int, history: list[dict]) -> None:
  """pass@1 and pass@n before/after RL, the held-out curve (`curve`); multi-turn: tool use on the held-out
  episodes."""
  summary.update({"pass1_before": before["pass@1"], "pass1_after": after["pass@1"],
                  f"pass{n}_before": before[f"pass@{n}"], f"pass{n}_after": after[f"pass@{n}"],
                  "curve": curve(before, history, after)})
  for k in ("env/tool_calls", "env/valid_call_rate"):
    if k in after:
      summary.update({f"{k[4:]}_before": before.get(k), f"{k[4:]}_after": after[k]})


def evaluated(evaluate, n: int) -> dict:
  """A metrics row's part for a held-out evaluation during training (eval.every): `evaluate()`'s pass@1 and
  pass@n, and its seconds."""
  t = time.perf_counter()
  res = evaluate()
  return {"eval_pass1": res["pass@1"], f"eval_pass{n}": res[f"pass@{n}"], "eval_s": time.perf_counter() - t}


def curve(before: dict, history: list[dict], after: dict) -> dict:
  """The held-out learning curve: pass@1 at step 0, at every evaluation during training, and at the end."""
  mid = [(r["step"] + 1, r["eval_pass1"]) for r in history if r.get("eval_pass1") is not None]
  points = [(0, before["pass@1"]), *mid, (history[-1]["step"] + 1 if history else 0, after["pass@1"])]
  return {"step": [p[0] for p in points], "pass1": [p[1] for p in points]}


def stopped_in_warm_start(sft_done: int) -> dict:
  """A preemption notice during the SFT warm start (its progress is saved): a preempted run at step 0."""
  return {"steps": 0, "preempted": True, "sft_steps_done": sft_done, "processes": jax.process_count()}


def write(workdir: str, summary: dict, t_start: float) -> dict:
  """Adds wall_s (since `t_start`, a time.perf_counter()) and writes <workdir>/summary.json → the summary."""
  summary["wall_s"] = time.perf_counter() - t_start
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f)
  return summary
