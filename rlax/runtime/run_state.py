"""What a checkpoint holds, defined in one place: save it, restore it (onto any trainer mesh).

Arrays: the train state (step, params, optimizer state) and, in deterministic mode, the k rollouts
generated ahead of the trainer (numpy), padded to k so every checkpoint has one shape. JSON meta: step,
weight version, data position after the newest accounted batch, the pending rollouts' indices, versions
and stats, the metric history, the pre-training evaluation, the run config and the model config (a
checkpoint of another model is refused, naming both).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rlax import config as config_lib
from rlax import run as run_lib
from rlax.checkpoint import Checkpointer, IncompatibleCheckpointError, abstract_like, to_json
from rlax.envs import journal
from rlax.models import moe
from rlax.rollout import Rollout, empty_batch


class NonFiniteError(RuntimeError):
  """A non-finite reward, loss, gradient norm or train state that the run refuses to train on or save."""


@jax.jit
def _finite_on_device(tree: Any) -> jax.Array:
  ok = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(ok)) if ok else jnp.array(True)


def all_finite(tree: Any) -> bool:
  """Whether every float leaf of `tree` (device or numpy arrays) is finite."""
  leaves = jax.tree.leaves(tree)
  if all(isinstance(x, np.ndarray) for x in leaves):
    return all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.inexact))
  return bool(jax.device_get(_finite_on_device(tree)))


@dataclasses.dataclass
class Resume:
  """Where a restored run continues: trained `step`, its state, data position, queued rollouts, history."""
  step: int
  state: Any
  data_state: dict
  pending: list[Rollout]
  history: list[dict]
  eval_before: Optional[dict]
  ref_params: Any = None  # the reference policy, when the checkpoint carries it


class RunState:
  """Checkpoints of one run under `<workdir>/checkpoints` (periodic, async, keep-last-N)."""

  def __init__(self, run: config_lib.RunConfig, prompt_len: int):
    ck = run.checkpoint
    self.run = run
    solo = {jax.process_index()} if jax.process_count() > 1 else None  # the trainer's process saves alone
    platform = jax.default_backend()
    self.ckpt = Checkpointer(os.path.join(run.workdir, "checkpoints"), keep=ck.keep,
                             every_steps=ck.every_steps or None, every_seconds=ck.every_seconds or None,
                             processes=solo, async_save=not run_lib.checkpoint_blocks(platform),
                             concurrent_gb=run_lib.save_concurrent_gb(platform,
                                                                      run_lib.largest_array_bytes(run.model)))
    self._solo = solo
    self._sft: Optional[Checkpointer] = None  # the warm start's own checkpoints, opened when first needed
    # Deterministic mode regenerates nothing on resume: the rollouts generated ahead are saved.
    self.n_pending = run.controller.max_staleness if run.deterministic else 0
    # The KL reference is the policy RL started from; after a warm start it exists nowhere else.
    self.with_ref = run.algorithm.kl_coef > 0 and run.init.sft_steps > 0
    self._template = empty_batch(run.rollout.rows, prompt_len, run.rollout.max_new_tokens, forks=run.env.episodic,
                                 routes=moe.replayed_routes(run.model), teacher=run.algorithm.distills,
                                 teacher_top_k=run.algorithm.teacher_top_k)
    self._model = to_json(run.model)
    # Orbax refuses arrays that one process of a multi-process job holds whole: save them from the host.
    self._via_host = jax.process_count() > 1

  def _tree(self, state: Any, pending: list[Any], ref: Any = None) -> dict:
    tree = {"train": state, "pending": list(pending) + [self._template] * (self.n_pending - len(pending))}
    if self.with_ref:
      tree["ref"] = ref
    return tree

  def pending_needed(self, step: int) -> int:
    """How many queued rollouts a checkpoint at `step` carries (none exist past the last step)."""
    return min(self.n_pending, self.run.controller.steps - step)

  def should_save(self, step: int) -> bool:
    return self.ckpt.should_save(step)

  def save(self, step: int, state: Any, *, pending: list[Rollout], data_state: dict, version: int,
           history: list[dict], eval_before: Optional[dict], ref_params: Any = None) -> None:
    """Starts an async save of `step` (returns at once; `wait()` blocks until it is on disk)."""
    meta = {"step": step, "version": version, "seed": self.run.seed, "data": data_state,
            "pending": [{"index": r.index, "version": r.version, "stats": r.stats, "data_state": r.data_state}
                        for r in pending],
            "history": history, "eval_before": eval_before, "config": config_lib.to_dict(self.run),
            "model": self._model}
    if self.with_ref and ref_params is None:
      raise ValueError("this run's checkpoints carry the KL reference policy: pass ref_params")
    if self._via_host:
      state, ref_params = jax.device_get((state, ref_params))
    # A NaN state would rotate the good checkpoints out (keep-last-N); the trainer's guard should make
    # this unreachable, so it is an error, never a silent save.
    if not all_finite(state):
      raise NonFiniteError(f"refusing to checkpoint step {step}: the train state holds NaN or inf")
    self.ckpt.save(step, self._tree(state, [r.data for r in pending], ref_params), meta, force=True)
    # No resume goes back past the oldest checkpoint kept: the tool journal's older steps are dropped.
    journal.prune(os.path.join(self.run.workdir, journal.FILE), min(self.ckpt.all_steps(), default=0))

  def restore(self, state_like: Any) -> Optional[Resume]:
    """The newest readable checkpoint restored onto `state_like`'s shardings, or None when there is none."""
    target = abstract_like(state_like)
    if self._via_host:
      target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), target)
    got = self.ckpt.restore_latest(self._tree(target, [self._template] * self.n_pending, target.params))
    if got is None:
      return None
    step, tree, meta = got
    if self._via_host:
      tree["train"] = jax.device_put(tree["train"], jax.tree.map(lambda x: x.sharding, state_like))
      if self.with_ref:
        tree["ref"] = jax.device_put(tree["ref"], jax.tree.map(lambda x: x.sharding, state_like.params))
    if meta.get("model") != self._model:
      raise IncompatibleCheckpointError(f"checkpoint step {step} was written for model {meta.get('model')}, "
                                        f"this run's model is {self._model}")
    pending = [Rollout(r["index"], r["version"], b, r["stats"], r.get("data_state", {}))
               for r, b in zip(meta["pending"], tree["pending"])]
    return Resume(step, tree["train"], meta["data"], pending, meta["history"], meta.get("eval_before"),
                  tree.get("ref"))

  # -- the SFT warm start (before RL step 0): its own directory, since its optimizer state differs ---------------
  def _sft_ckpt(self) -> Checkpointer:
    if self._sft is None:
      self._sft = Checkpointer(os.path.join(self.run.workdir, "checkpoints_sft"), keep=1, processes=self._solo)
    return self._sft

  def save_sft(self, done: int, sft_state: Any) -> None:
    """Saves a warm start stopped after `done` of init.sft_steps updates (preemption) and waits for it."""
    if self._via_host:
      sft_state = jax.device_get(sft_state)
    if not all_finite(sft_state):
      raise NonFiniteError(f"refusing to checkpoint SFT step {done}: the state holds NaN or inf")
    ck = self._sft_ckpt()
    if ck.last_step is None or done > ck.last_step:
      ck.save(done, {"sft": sft_state}, {"sft_step": done, "model": self._model}, force=True)
    ck.wait()

  def restore_sft(self, sft_like: Any) -> Optional[tuple[int, Any]]:
    """(updates done, SFT state) of a warm start stopped by preemption, or None."""
    if not os.path.isdir(os.path.join(self.run.workdir, "checkpoints_sft")):
      return None
    target = abstract_like(sft_like)
    if self._via_host:
      target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), target)
    got = self._sft_ckpt().restore_latest({"sft": target})
    if got is None:
      return None
    step, tree, meta = got
    if meta.get("model") != self._model:
      raise IncompatibleCheckpointError(f"SFT checkpoint step {step} was written for model {meta.get('model')}, "
                                        f"this run's model is {self._model}")
    state = tree["sft"]
    if self._via_host:
      state = jax.device_put(state, jax.tree.map(lambda x: x.sharding, sft_like))
    return step, state

  def wait(self) -> None:
    self.ckpt.wait()

  def close(self) -> None:
    self.ckpt.close()
    if self._sft is not None:
      self._sft.close()
