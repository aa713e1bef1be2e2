"""Where a run starts: this process's parts on the topology it starts on (`process_parts`), and the trainer's
start point: from scratch (after the optional SFT warm start) or from the newest checkpoint (`start_point`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from absl import logging
import jax

from rlax import builders
from rlax import memory_check
from rlax.config import RunConfig
from rlax.data.prompts import PromptRenderer
from rlax.data.records import Record
from rlax.metrics import MetricsWriter
from rlax.models.hf_tokenizer import Tokenizer
from rlax.multihost import Channel
from rlax.rollout.sft import sft_warm_start
from rlax.runtime import failover
from rlax.runtime.roles import Start
from rlax.runtime.run_state import RunState
from rlax.topology import build_topology


def process_parts(run: RunConfig, tok: Tokenizer) -> tuple[Optional[Channel], failover.Faults, builders.Components]:
  """(the channel to the other processes or None, the slice faults, this process's parts)."""
  topology = build_topology(run.topology)
  channel = Channel() if jax.process_count() > 1 else None
  if channel is not None and run.faults.any:
    raise ValueError("faults.lose_slice_at / restore_slice_at simulate slice loss inside one controller "
                     "process; a multi-process job recovers by restarting (launch.multihost)")
  if channel is not None and run.eval.every:
    raise ValueError(f"eval.every={run.eval.every}: evaluations during training run in one controller process; "
                     "a multi-process job evaluates before and after (set eval.every=0)")
  # Slices an earlier process lost stay lost: start on the reduced topology.
  faults = failover.Faults(run, topology)
  topology = faults.restart_topology(topology)
  # Before anything compiles: a config that cannot fit fails here, naming the knob to change.
  logging.info("memory estimate per device:\n%s", memory_check.check_topology(run, topology).summary())
  return channel, faults, builders.components(run, topology, tok=tok, channel=channel)


@dataclasses.dataclass
class StartPoint:
  """Where the trainer's loop begins."""
  step: int  # trained steps
  state: Any  # None: a preemption notice stopped the SFT warm start (its progress is saved)
  pending: list  # rollouts a checkpoint kept, trained first
  before: Optional[dict]  # pass@k of the starting policy, when a checkpoint has it
  ref_params: Any  # the KL reference (None without KL)
  data_state: dict  # the data position after the newest trained batch
  resumed: bool
  sft_done: int = 0

  def message(self) -> Start:
    """The handshake's Start: what the sampler process needs to start producing."""
    return Start(step=self.step, first=self.step + len(self.pending),
                 data=self.data_state if self.resumed else None, evaluate=self.before is None)


def warm_start(run: RunConfig, mesh, trainer, run_state: RunState, state, render: PromptRenderer,
               records: Sequence[Record], should_stop: Callable[[], bool]) -> tuple[Any, int]:
  """The SFT warm start → (RL train state on its weights, SFT steps done).

  A preemption notice (`should_stop`) stops it between updates: its state is checkpointed
  (RunState.save_sft) and the state returned is None; the next run continues from there.
  """
  steps = run.init.sft_steps
  if not steps:
    return state, 0
  sft = builders.sft_trainer(run, mesh)
  sft_state, done = sft.init_state(state.params), 0
  saved = run_state.restore_sft(sft_state)
  if saved is not None:
    done, sft_state = saved
    logging.info("continuing the SFT warm start after %d/%d steps", done, steps)
  sft_state, done = sft_warm_start(sft, sft_state, render, records, steps=steps, batch=run.init.sft_batch,
                                   style=run.data.prompt_style, prompt_len=run.rollout.max_prompt_len,
                                   response_len=run.rollout.max_new_tokens, start=done, should_stop=should_stop)
  if done < steps:
    run_state.save_sft(done, sft_state)
    logging.warning("checkpointed the SFT warm start after %d/%d steps; run again to continue", done, steps)
    return None, done
  return trainer.init_state(sft_state.params), done  # RL starts from fresh optimizer moments


def start_point(run: RunConfig, mesh, trainer, run_state: RunState, metrics: MetricsWriter, data, *,
                render: PromptRenderer, records: Sequence[Record], should_stop: Callable[[], bool]) -> StartPoint:
  """Initial params → the newest checkpoint, else the warm start (checkpointed at step 0); the metrics rows
  are reset to what the checkpoint saw. `data`: the record iterator (None in a trainer-only process)."""
  kl = run.algorithm.kl_coef > 0
  initial = builders.initial_params(run, mesh)
  state = trainer.init_state(initial)
  resume = run_state.restore(state)
  if resume is not None:
    # The reference is the policy RL started from, never the resumed one.
    ref_params = (resume.ref_params if run_state.with_ref else initial) if kl else None
    metrics.reset(resume.history)  # rows of steps after the checkpoint are trained again
    if data is not None:
      data.set_state(resume.data_state)
    logging.info("resumed from checkpoint step %d (%d pending rollouts)", resume.step, len(resume.pending))
    return StartPoint(resume.step, resume.state, resume.pending, resume.eval_before, ref_params,
                      resume.data_state, resumed=True)
  metrics.reset([])  # rows of an earlier attempt that never reached a checkpoint
  state, sft_done = warm_start(run, mesh, trainer, run_state, state, render, records, should_stop)
  if state is None:
    return StartPoint(0, None, [], None, None, {}, resumed=False, sft_done=sft_done)
  data_state = data.get_state() if data is not None else {}
  ref_params = trainer.variation.reference(state.params, trainer.base) if kl else None
  if run.controller.steps > 0:  # step 0 is saved at once: the warm start's work is kept, and a trainer slice
    # lost before the first periodic checkpoint restarts from these weights
    run_state.save(0, state, pending=[], data_state=data_state, version=0, history=[], eval_before=None,
                   ref_params=ref_params)
  return StartPoint(0, state, [], None, ref_params, data_state, resumed=False)
