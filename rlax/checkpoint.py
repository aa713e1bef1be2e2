"""RL-state checkpoints with orbax: async, keep-last-N, periodic, atomic, and restorable on a new mesh.

A checkpoint holds two items: `state`, any pytree of arrays (trainer params, optimizer state, RNG key
data), and `meta`, a JSON dict (step, weight version, data-iterator position, seeds, rollout-queue
regeneration info, metric history, config). Orbax writes each step into a temporary directory and
renames it when complete, so a crash mid-save leaves no step that `restore_latest` would pick. A
latest step that fails to read (truncated or missing files) is skipped with a warning naming the
step and the error, falling back to the previous one; a checkpoint whose tree or shapes differ from
the restore target is an error naming the leaf, never a partial restore. Restoring onto a different
mesh or device count only needs a target tree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`.

`load_policy` reads a run's checkpoint as its policy (full weights, LoRA adapters merged) and model config,
for export and evaluation: the one reader of a run's saved config outside the runtime.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any, Mapping, Optional

from absl import logging
import jax
from jax.sharding import Mesh, SingleDeviceSharding
import numpy as np
import orbax.checkpoint as ocp

from rlax import models
from rlax.models import hf
from rlax.models import lora as lora_lib
from rlax.models import variation


class IncompatibleCheckpointError(ValueError):
  """The checkpoint's tree or shapes do not match the restore target (e.g. a different model config)."""


class CheckpointError(RuntimeError):
  """A save could not be written (directory removed, disk full, no permission): one line naming the step."""


def short_error(e: BaseException) -> str:
  """`Type: first line` of an orbax/tensorstore error, without the TensorStore spec dump it appends."""
  text = (str(e).splitlines() or [""])[0]
  for cut in (" See full TensorStore details", " <bound method"):
    text = text.split(cut)[0]
  return f"{type(e).__name__}: {text[:300]}".rstrip(": ")


def to_json(obj: Any) -> Any:
  """JSON-able copy of `obj`: ConfigDicts, dataclasses, tuples, numpy scalars/arrays become plain JSON."""
  if hasattr(obj, "to_dict") and callable(obj.to_dict):
    return to_json(obj.to_dict())
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return to_json(dataclasses.asdict(obj))
  if isinstance(obj, Mapping):
    return {str(k): to_json(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [to_json(v) for v in obj]
  if isinstance(obj, (np.generic, np.ndarray)) or (isinstance(obj, jax.Array) and obj.is_fully_addressable):
    return np.asarray(obj).tolist()
  if obj is None or isinstance(obj, (bool, int, float, str)):
    return obj
  raise ValueError(f"checkpoint meta value of type {type(obj).__name__} is not JSON-serializable: {obj!r:.80}")


def _leaf_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path) or "<root>"


def abstract_like(tree: Any) -> Any:
  """Restore target with the same shapes, dtypes and shardings as the arrays of `tree`.

  numpy leaves stay numpy templates: orbax restores them as host arrays.
  """
  return jax.tree.map(lambda x: x if isinstance(x, np.ndarray) else
                      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _signaling_threads() -> set:
  """Orbax's live threads that wait for a save's signals (orbax internals: none when the names moved)."""
  try:
    from orbax.checkpoint._src.futures import future as orbax_future  # pylint: disable=g-import-not-at-top
  except ImportError:
    return set()
  kind = getattr(orbax_future, "_SignalingThread", None)
  return {t for t in threading.enumerate() if kind is not None and isinstance(t, kind) and t.is_alive()}


def _release_orphaned_waiters(threads: set) -> None:
  """A save that failed before its directory existed leaves orbax threads waiting for that signal, 300 s each,
  and they are not daemon threads: the process hung 5 minutes at exit. Setting the signals that `threads` (the
  failed save's own) wait for lets them run, and fail, at once."""
  try:
    from orbax.checkpoint._src.futures import future as orbax_future  # pylint: disable=g-import-not-at-top
    for t in threads:
      if t.is_alive():
        orbax_future.set_signals(t._receive_signals, operation_id=t._operation_id)  # pylint: disable=protected-access
  except (ImportError, AttributeError) as e:
    logging.vlog(1, "checkpoint: cannot release orbax's waiting threads: %s", e)


class Checkpointer:
  """Periodic, async, keep-last-`keep` checkpoints of (state tree, JSON meta) under `directory`.

  `every_steps` / `every_seconds` drive `should_save(step, now)`; either may be None (off). `save`
  returns immediately while orbax writes in the background (`wait()` blocks until it is on disk).
  """

  def __init__(self, directory: str, keep: int = 3, every_steps: int | None = None,
               every_seconds: float | None = None, async_save: bool = True, processes: set[int] | None = None,
               concurrent_gb: float | None = None):
    if keep < 1:
      raise ValueError(f"Checkpointer keep={keep}: must keep at least one checkpoint")
    for name, v in (("every_steps", every_steps), ("every_seconds", every_seconds)):
      if v is not None and v <= 0:
        raise ValueError(f"Checkpointer {name}={v} must be positive or None")
    self.directory = str(directory)
    self.every_steps, self.every_seconds = every_steps, every_seconds
    # cleanup_tmp_directories: a crash mid-save leaves `<step>.orbax-checkpoint-tmp`; drop it on start.
    # processes: the job's processes that hold the checkpointed arrays (default: all of them); in a
    # multi-process run only the trainer's process saves, without barriers on the others.
    mp = (ocp.options.MultiprocessingOptions(primary_host=min(processes), active_processes=set(processes))
          if processes else ocp.options.MultiprocessingOptions())
    if processes:
      os.makedirs(self.directory, exist_ok=True)  # orbax will not create it for a subset of processes
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True, multiprocessing_options=mp,
                                           create=not processes)
    # concurrent_gb: the host copy a save holds at once (rlax.run.save_concurrent_gb); None: orbax's default.
    state_handler = (ocp.StandardCheckpointHandler() if concurrent_gb is None else
                     ocp.StandardCheckpointHandler(save_concurrent_gb=concurrent_gb))
    self._mgr = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": state_handler, "meta": ocp.JsonCheckpointHandler()})
    self._last_time = time.time()
    self._last_step = self._mgr.latest_step()
    self._threads_before = _signaling_threads()  # orbax's waiting threads before a save that may be pending
    self._single_writer = jax.process_count() == 1 or (processes is not None and len(processes) == 1)

  @property
  def last_step(self) -> int | None:
    """The newest step saved (possibly still being written) or found on disk; None before any."""
    return self._last_step

  def all_steps(self) -> list[int]:
    """Finalized steps on disk, ascending (temporary directories of unfinished saves excluded)."""
    return sorted(self._mgr.all_steps())

  def should_save(self, step: int, now: float | None = None) -> bool:
    """True if `step` is a multiple of `every_steps` or `every_seconds` passed since the last save."""
    if self._last_step is not None and step <= self._last_step:
      return False
    now = time.time() if now is None else now
    by_steps = self.every_steps is not None and step % self.every_steps == 0
    by_time = self.every_seconds is not None and now - self._last_time >= self.every_seconds
    return by_steps or by_time

  def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None, force: bool = False,
           now: float | None = None) -> bool:
    """Start an async save of `state` (pytree of arrays) and `meta` (JSON dict) at `step`.

    Without `force`, saves only when `should_save(step, now)`; `force` is for preemption notices and
    the last step. Returns whether a save was started.
    """
    if not force and not self.should_save(step, now):
      return False
    if self._last_step is not None and step <= self._last_step:
      raise ValueError(f"checkpoint step {step} is not after the latest saved step {self._last_step}")
    meta_json = to_json(dict(meta or {}))
    json.dumps(meta_json)  # fail here, not in the background thread
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta_json))
    before = _signaling_threads()
    try:  # orbax first waits for the previous save, so its failure surfaces here too
      self._mgr.save(step, args=args, force=True)
    except Exception as e:
      _release_orphaned_waiters(_signaling_threads() - self._threads_before)
      raise CheckpointError(f"checkpoint save of step {step} to {self.directory} failed: {short_error(e)}"
                            ) from None
    self._threads_before = before  # the previous save is done: only this one may leave threads behind
    self._last_step, self._last_time = step, time.time() if now is None else now
    logging.vlog(1, "checkpoint: started async save of step %d to %s", step, self.directory)
    return True

  def _check_compatible(self, step: int, target: Any) -> None:
    """Raise IncompatibleCheckpointError naming the first leaf whose path or shape differs."""
    stored = self._mgr.item_metadata(step)["state"]
    stored = getattr(stored, "tree", stored)
    if stored is None:
      raise RuntimeError(f"step {step}: state metadata is missing")
    got = {_leaf_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
    want = {_leaf_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    for name in sorted(set(got) | set(want)):
      if name not in got:
        raise IncompatibleCheckpointError(
            f"checkpoint step {step} in {self.directory} has no leaf {name!r} that the target expects")
      if name not in want:
        raise IncompatibleCheckpointError(
            f"checkpoint step {step} in {self.directory} has leaf {name!r} that the target does not have")
      if got[name] != want[name]:
        raise IncompatibleCheckpointError(
            f"checkpoint step {step} leaf {name!r} has shape {got[name]}, target expects {want[name]}")

  def restore(self, step: int, target: Any) -> tuple[int, Any, dict]:
    """Restore `step` onto `target` (tree of ShapeDtypeStruct with shardings; dtypes are cast)."""
    self._check_compatible(step, target)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
    out = self._mgr.restore(step, args=args)
    jax.block_until_ready(out["state"])
    return step, out["state"], dict(out["meta"])

  def restore_latest(self, target: Any) -> tuple[int, Any, dict] | None:
    """Newest readable checkpoint as (step, state, meta), or None when there is none.

    An unreadable step (corrupt or partial files) is skipped with a warning and the previous one is
    tried; an incompatible tree/shape raises IncompatibleCheckpointError at once. A single-process run
    moves the unreadable step aside to `<step>.unreadable` (kept for inspection), so the run saves that
    step again when it gets there instead of falling back past it at every later restart.
    """
    self.wait()
    for step in reversed(self.all_steps()):
      try:
        got = self.restore(step, target)
      except IncompatibleCheckpointError:
        raise
      except Exception as e:  # orbax/tensorstore raise many types for unreadable files
        aside = self._move_aside(step)
        logging.warning("checkpoint step %d in %s is unreadable, falling back to an earlier one%s: %s", step,
                        self.directory, f" (moved to {os.path.basename(aside)})" if aside else "", short_error(e))
        continue
      return got
    return None

  def _move_aside(self, step: int) -> str | None:
    """Renames an unreadable step to `<step>.unreadable.<ns>` → the new path (None: not this process's to move).

    Only a single writer (one process, or the one active process of a multi-process job) renames: otherwise
    the step would be restored past again at every restart, and the rerun's save of it refused.
    """
    if not self._single_writer:
      return None
    path = os.path.join(self.directory, str(step))
    aside = f"{path}.unreadable.{time.time_ns()}"
    os.replace(path, aside)
    self._mgr.reload()
    self._last_step = self._mgr.latest_step()
    return aside

  def wait(self) -> None:
    """Block until every started save is finalized on disk."""
    try:
      self._mgr.wait_until_finished()
    except Exception as e:
      _release_orphaned_waiters(_signaling_threads() - self._threads_before)
      raise CheckpointError(f"checkpoint save of step {self._last_step} to {self.directory} failed: "
                            f"{short_error(e)}") from None

  def close(self) -> None:
    try:
      self._mgr.close()
    except Exception as e:  # a failed save was raised (CheckpointError) already; do not chain it again
      logging.error("checkpoint: closing %s: %s", self.directory, short_error(e))

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _read_only(workdir: str) -> tuple[str, ocp.CheckpointManager]:
  ckpt_dir = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(ckpt_dir):
    raise ValueError(f"workdir {workdir} has no checkpoints (no directory {ckpt_dir})")
  # read_only: the run may still be writing checkpoints here.
  mgr = ocp.CheckpointManager(
      ckpt_dir, options=ocp.CheckpointManagerOptions(read_only=True),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
  return ckpt_dir, mgr


def restore_params(workdir: str, step: Optional[int] = None) -> tuple[int, Any, dict]:
  """(step, params on one CPU device, meta) of the newest (or the given) finished checkpoint of a run.

  Only the params are read (orbax partial restore): the optimizer state and queued rollouts stay on disk.
  A LoRA run's params are its adapters; `load_policy` gives the merged weights.
  """
  ckpt_dir, mgr = _read_only(workdir)
  try:
    steps = sorted(mgr.all_steps())
    if not steps:
      raise ValueError(f"workdir {workdir} has no finished checkpoint in {ckpt_dir}")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ValueError(f"workdir {workdir} has no checkpoint of step {step}; its checkpoints are steps "
                       f"{', '.join(map(str, steps))}")
    tree = mgr.item_metadata(step)["state"]
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict) or "params" not in (tree.get("train") or {}):
      raise ValueError(f"checkpoint step {step} in {ckpt_dir} holds no train/params (not an rlax run checkpoint)")
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    target = {"train": {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
                                               tree["train"]["params"])}}
    args = ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                     partial_restore=True),
        meta=ocp.args.JsonRestore())
    out = mgr.restore(step, args=args)
  finally:
    mgr.close()
  return step, out["state"]["train"]["params"], dict(out["meta"])


@dataclasses.dataclass(frozen=True)
class Policy:
  """A run's policy as one of its checkpoints holds it (`load_policy`)."""
  step: int
  params: Any                   # full weights; with merge_lora=False a LoRA run's adapters
  model: models.ModelConfig     # the run's model config
  lora: lora_lib.LoraConfig     # rank 0: the run trained every weight
  hf_checkpoint: str            # the HF directory the run started from ("": a random init)
  config: dict                  # the run config the checkpoint recorded (rlax.config.to_dict)


def load_policy(workdir: str, step: Optional[int] = None, *, mesh: Optional[Mesh] = None,
                merge_lora: bool = True) -> Policy:
  """The policy of a run's newest (or the given) checkpoint and the model config the run recorded with it.

  A LoRA run's checkpoint holds adapters: they are merged into the base the run trained (its hf_checkpoint,
  else the seed's random init), unless merge_lora=False. With `mesh` the weights are placed in their
  shardings on it (the base read straight into them); without, on one CPU device, so that a live training
  job keeps its accelerators.
  """
  step, params, meta = restore_params(workdir, step)
  run = meta.get("config") or {}
  if "model" not in run:
    raise ValueError(f"checkpoint step {step} in {workdir}: its meta has no config.model")
  cfg = models.from_dict(run["model"])
  saved_lora = dict(run.get("lora") or {})
  lora = lora_lib.LoraConfig(**{**saved_lora, "targets": tuple(saved_lora.get("targets", lora_lib.TARGETS))})
  hf_dir = run.get("hf_checkpoint") or ""
  kind = variation.of(cfg, lora)
  if kind.frozen_base and merge_lora:
    if hf_dir and not os.path.isdir(hf_dir):
      raise ValueError(f"checkpoint step {step} in {workdir} holds LoRA adapters of {hf_dir}, which does not "
                       "exist any more; its weights are needed to merge them")
    mesh = mesh or models.make_mesh(jax.devices("cpu")[:1], data=1, fsdp=1, tensor=1)
    base = (hf.load_checkpoint(hf_dir, mesh, cfg=cfg)[1] if hf_dir
            else models.create_params(cfg, mesh, seed=run.get("seed", 0)))
    params = jax.jit(kind.merge)(jax.device_put(params, kind.shardings(mesh)), base)
  elif mesh is not None:
    params = jax.device_put(params, kind.shardings(mesh))
  return Policy(step=step, params=params, model=cfg, lora=lora, hf_checkpoint=hf_dir, config=run)
