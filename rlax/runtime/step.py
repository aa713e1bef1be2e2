"""One trainer update on one rollout batch, and the metrics row the controller writes for it."""

from __future__ import annotations

import resource
from typing import Any, Callable, Optional

from absl import logging
import jax
import numpy as np
import psutil

from rlax.data import dynamic_sampling
from rlax.rollout import packing
from rlax.runtime.run_state import NonFiniteError
from rlax.trainer.batch import PackedBatch


def nonfinite_rewards(rewards) -> Optional[str]:
  """Why a batch's rewards cannot be trained on, or None."""
  rewards = np.asarray(rewards)
  bad = ~np.isfinite(rewards)
  if not bad.any():
    return None
  return (f"{int(bad.sum())} of {rewards.size} rewards are not finite "
          f"({', '.join(sorted({str(x) for x in rewards[bad]}))}; check the reward function)")


def on_nonfinite(policy: str, s: int, what: Optional[str]) -> None:
  """controller.on_nonfinite for step `s`'s batch, skipped for `what` (None: not skipped): 'stop' raises
  NonFiniteError; 'skip' keeps the state and logs the skip."""
  if what is None:
    return
  if policy == "stop":
    raise NonFiniteError(f"step {s}: {what} (controller.on_nonfinite='stop'; 'skip' skips such batches)")
  logging.warning("step %d: %s; batch skipped, parameters unchanged (controller.on_nonfinite='skip')", s, what)


def train_batch(trainer, plan, data, state, ref_params, *, share_prompts: bool,
                ready: Callable[[], None] = lambda: None) -> tuple[Any, dict, Optional[str]]:
  """(state, metrics, why the batch was skipped or None) after one update on rollout batch `data`.

  Rewards are checked on the host, before the batch crosses; a non-finite loss or gradient norm leaves the
  state unchanged inside the jitted step (trainer.state.apply_gradients). `ready()` runs before the first
  device work (waits for the programs compiled ahead). `plan`: the run's rlax.run.TrainPlan.
  """
  bad = nonfinite_rewards(data.rewards)
  if bad is not None:
    return state, {}, bad
  ready()
  # Tied groups (advantage 0) are packed into micro-batches of their own, which the trainer skips.
  inert = dynamic_sampling.tied_rows(data.rewards, trainer.group_size) if trainer.algo.tied_groups_inert else None
  host = packing.for_trainer(data, trainer, plan.packed, share_prompts, padded=plan.padded, inert=inert)
  R, L = host.tokens.shape
  n = trainer.num_micro_batches(R, L)
  rows = packing.rows_run(host, n, inert) if isinstance(host, PackedBatch) else R
  batch = trainer.place(host)
  if ref_params is not None:
    batch = batch.replace(ref_logprobs=trainer.ref_logprobs(ref_params, batch))
  state, m = trainer.step(state, batch)
  m = dict(jax.device_get(m), train_rows=rows, train_row_len=L, micro_batches=m.pop("micro_batches_run"))
  if float(m.pop("finite", 1.0)) < 1:
    bad = f"the loss ({float(m['loss']):.4g}) or gradient norm ({float(m['grad_norm']):.4g}) is not finite"
  return state, m, bad


def metrics_row(m: dict, item, *, sync: dict, skipped: bool, compiles: tuple[int, float], train_s: float,
                wait_s: float, sync_s: float, step_s: float, staleness: int, dropped: int) -> dict:
  """The row of one step: the update's metrics, the batch's stats, the push's, counters and timings."""
  row = {k: float(v) for k, v in m.items()}
  row.update(item.stats)
  row.update(sync)
  row.update(nonfinite_skipped=float(skipped))
  row.update(compiles=float(compiles[0]), compile_s=compiles[1])
  row.update(train_s=train_s, trainer_idle_s=wait_s, sync_total_s=sync_s, step_s=step_s,
             staleness=float(staleness), dropped=float(dropped))
  row["tokens_per_s"] = row.get("response_tokens", 0.0) / max(step_s, 1e-9)
  # This process's memory now and at its peak so far (the whole run on one host: both roles, all devices).
  row.update(host_rss_gb=psutil.Process().memory_info().rss / 1e9, host_peak_rss_gb=peak_rss_gb())
  return row


def peak_rss_gb() -> float:
  """This process's peak resident memory so far, in GB (ru_maxrss counts KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
