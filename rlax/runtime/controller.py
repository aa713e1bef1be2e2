"""The controller: a thin loop over parts with one job each.

    summary = Controller(config).run()      # config: a ConfigDict or a typed rlax.config.RunConfig

Data flow (one direction): the rollout producer (its own thread, sampler submesh; rlax.runtime.sampling)
generates, grades and packs batch s with weights of version >= s - k → the rollout queue (staleness <= k) →
the trainer (one device_put per batch; rlax.runtime.step) → the weights service pushes version s + 1 → the
producer. A run starts at rlax.runtime.start's start point; preemption (SIGTERM/SIGINT) stops at a step
boundary with a checkpoint (rlax.runtime.run_state); slice loss is handled by rlax.runtime.failover.recover.

Without Pathways the same program runs as one process per role (launch.multihost): the trainer's trains and
checkpoints, the sampler's samples, grades and evaluates; weights cross by `CrossMeshPush`, rollouts by the
coordination service (rlax.rollout.remote), and the two meet by the typed handshake of rlax.runtime.roles.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Optional

from absl import logging

from rlax import allocator
from rlax import builders
from rlax import config as config_lib
from rlax import export
from rlax import run as run_lib
from rlax.metrics import MetricsWriter
from rlax.rollout import Closed, RolloutQueue
from rlax.rollout.remote import RemoteSource
from rlax.run.compiles import Background, CompileCounter
from rlax.runtime import failover
from rlax.runtime import start as start_lib
from rlax.runtime import step as step_lib
from rlax.runtime import summary as summary_lib
from rlax.runtime.preemption import Preemption
from rlax.runtime.roles import End, Handshake, Start
from rlax.runtime.run_state import RunState
from rlax.runtime.sampling import SamplerRole
from rlax.topology import SliceLostError


class Controller:
  """Builds this process's parts from `config` and runs RL; see the module docstring.

  tokenizer (an rlax Tokenizer) / records=(train, eval) / reward_fn replace what the config names
  (benchmarks, embedding). callbacks: cb(controller, step, metrics_row) after every trainer step.
  """

  def __init__(self, config, *, progress: bool = True, callbacks=(), tokenizer=None, records=None, reward_fn=None):
    run = self.run_cfg = config if isinstance(config, config_lib.RunConfig) else config_lib.load(config)
    self.workdir = builders.workdir(run)
    self.tokenizer = builders.checked_tokenizer(run, tokenizer)
    self.render = builders.renderer(run, self.tokenizer)
    self.train_records, self.eval_records, self.prompts_dropped = builders.train_and_eval_records(
        run, self.render, records)
    self.reward_fn = reward_fn or builders.reward_fn(run)
    self.channel, self.faults, self.parts = start_lib.process_parts(run, self.tokenizer)
    self.roles = Handshake(self.channel)
    self.preemption = Preemption(run.checkpoint.grace_seconds)
    self.callbacks = list(callbacks)
    self.sampling = SamplerRole(run, tokenizer=self.tokenizer, render=self.render, reward_fn=self.reward_fn,
                                records=(self.train_records, self.eval_records), roles=self.roles,
                                ensure_alive=self.faults.ensure_alive) if self.sampler is not None else None
    self.data = self.sampling.data if self.sampling is not None else None  # the record iterator
    trains = self.trainer is not None
    self.run_state = RunState(run, run.rollout.max_prompt_len) if trains else None
    self.metrics = MetricsWriter(os.path.join(run.workdir, "logs"), total_steps=run.controller.steps,
                                 progress=progress) if trains else None
    self.staleness_hist: collections.Counter = collections.Counter()
    self.dropped, self.final_state, self.ref_params = 0, None, None
    self._data_after: dict = {}  # data position after the newest trained batch
    self.compiles = CompileCounter()
    self._compiling, self._compiled_for = Background(), None

  # The parts this process holds (read-only views; failover replaces `parts`).
  topo = property(lambda self: self.parts.topology)
  trainer = property(lambda self: self.parts.trainer)
  sampler = property(lambda self: self.parts.sampler)
  weights = property(lambda self: self.parts.weights)

  def request_stop(self, *_) -> None:
    """Preemption notice: checkpoint at the next step boundary and return."""
    self.preemption.request()

  def evaluate(self, tag: str) -> dict:
    """Held-out pass@k with the newest published weights (run by the process that holds the sampler)."""
    return self.roles.recv_eval(tag) if self.sampler is None else self.sampling.evaluate(self.parts, tag)

  def _compile_ahead(self) -> None:
    """Compiles the trainer's programs on a thread (once per trainer); the first step waits for them."""
    if self._compiled_for is not self.trainer:
      self._compiled_for = self.trainer
      self._compiling = Background(lambda: self.trainer.compile_ahead(ref=self.run_cfg.algorithm.kl_coef > 0),
                                   name="compile-ahead")

  def _push(self, params, version: int) -> dict:
    if self.sampler is not None:
      self.faults.ensure_alive(self.topo.sampler_mesh)
    return self.weights.push(params, version)

  def _save(self, s: int, state, queue: RolloutQueue, before: Optional[dict], force: bool) -> None:
    if not (force or self.run_state.should_save(s)):
      return
    pending = queue.peek(n) if (n := self.run_state.pending_needed(s)) else []
    self.run_state.save(s, state, pending=pending, data_state=pending[-1].data_state if pending else self._data_after,
                        version=self.weights.pushed, history=self.metrics.history, eval_before=before,
                        ref_params=self.ref_params)

  def _export(self, params, out_dir: str) -> str:
    """The policy as an HF directory (config, safetensors, tokenizer, chat template, generation config)."""
    export.export_hf(self.trainer.merged_params(params), self.run_cfg.model, out_dir, tokenizer=self.tokenizer,
                     tokenizer_dir=self.run_cfg.hf_checkpoint or None)
    logging.info("exported the policy to %s", out_dir)
    return out_dir

  def _stretch(self, s: int, state, before: Optional[dict], pending: list):
    """Trains from step `s` until done, preempted or a slice fault → (step, state, fault or None, kept rollouts)."""
    run = self.run_cfg
    ctl, steps, ctl_eval = run.controller, run.controller.steps, run.eval
    queue = RolloutQueue(ctl.queue_size, ctl.max_staleness, ctl.stale_policy)
    plan = run_lib.train_plan(run, self.trainer)
    self._compile_ahead()  # a trainer rebuilt on a new mesh compiles its programs again
    for r in pending:
      queue.put(r)
    if self.sampler is not None:
      source = self.sampling.producer(self.parts, queue.put)
      source.start(s + len(pending), steps, on_error=queue.close)
    else:
      source = RemoteSource(self.channel)
      source.start(s + len(pending), steps, queue, on_error=queue.close)
    fault, kept, first = None, [], s
    try:
      while s < steps and not self.preemption.requested:
        self.faults.at_step(s, self.topo)
        t0 = time.perf_counter()
        try:
          item, wait = queue.get(policy_version=s)
        except Closed:
          if source.error is not None:
            raise source.error from None
          raise
        t1 = time.perf_counter()
        state, m, bad = step_lib.train_batch(self.trainer, plan, item.data, state, self.ref_params,
                                             share_prompts=run.optimizer.share_prompts, ready=self._compiling.wait)
        step_lib.on_nonfinite(ctl.on_nonfinite, s, bad)
        t2 = time.perf_counter()
        sync, lost = {}, None
        if (s + 1) % ctl.push_every == 0:
          try:
            sync = self._push(state.params, s + 1)
          except SliceLostError as e:  # the step is done; the rebuilt sampler gets these weights
            lost = e
        t3 = time.perf_counter()
        row = step_lib.metrics_row(m, item, sync=sync, skipped=bad is not None, compiles=self.compiles.delta(),
                                   train_s=t2 - t1, wait_s=wait, sync_s=t3 - t2, step_s=t3 - t0,
                                   staleness=s - item.version, dropped=self.dropped + queue.dropped)
        if row["compiles"] and s > first:  # the warm-up compiles every program a step needs: say which one it missed
          logging.warning("step %d compiled %s", s, ", ".join(self.compiles.names()))
        if ctl_eval.every and (s + 1) % ctl_eval.every == 0 and s + 1 < steps:  # the held-out curve
          row.update(summary_lib.evaluated(lambda: self.evaluate(f"step {s + 1}"), ctl_eval.n_samples))
        self.metrics.write(s, row)
        for cb in self.callbacks:
          cb(self, s, row)
        allocator.release_free_memory()
        s += 1
        self._data_after = item.data_state
        if lost is not None:
          raise lost
        self._save(s, state, queue, before, force=self.preemption.requested or s == steps)
        if run.checkpoint.export_every and s % run.checkpoint.export_every == 0 and s < steps:
          self._export(state.params, os.path.join(self.workdir, "exports", str(s)))
      if self.preemption.requested and s < steps and self.run_state.ckpt.last_step != s:
        # The notice came between a step's save check and the loop test, or during a recovery.
        self._save(s, state, queue, before, force=True)
    except failover.TopologyChange as e:
      fault, kept = e, queue.peek(len(queue))
    finally:
      queue.close()
      self.weights.close()  # wakes a producer waiting for weights
      source.join()
      self.staleness_hist.update(queue.staleness_hist)
      self.dropped += queue.dropped
    return s, state, fault, kept

  def _train(self) -> dict:
    """The trainer's side of the run (the whole run in one process): returns the summary."""
    t_start = time.perf_counter()
    run, steps = self.run_cfg, self.run_cfg.controller.steps
    p = start_lib.start_point(run, self.topo.trainer_mesh, self.trainer, self.run_state, self.metrics, self.data,
                              render=self.render, records=self.train_records,
                              should_stop=lambda: self.preemption.requested)
    if p.state is None:  # a preemption notice in the warm start (its progress is saved): nothing to sample
      self.roles.send_start(Start(step=0, first=steps, data=None, evaluate=False))
      self.weights.end()
      self.roles.send_end(End(evaluate=False))
      return summary_lib.write(self.workdir, summary_lib.stopped_in_warm_start(p.sft_done), t_start)
    s, state, pending, before = p.step, p.state, p.pending, p.before
    self._data_after, self.ref_params = p.data_state, p.ref_params
    self.roles.send_start(p.message())
    self._push(state.params, s)
    self._compile_ahead()  # on a thread, while the sampler compiles its own and evaluates the starting policy
    if self.sampler is not None:
      self.sampling.warm_up(self.parts)
    if before is None:  # before the first step: beside the steps, its first-use compiles would land in their rows
      before = self.evaluate("before")
    while True:  # one stretch per topology: a slice fault ends it and recovery starts the next
      s, state, fault, kept = self._stretch(s, state, before, pending)
      if fault is None:
        break
      rec = failover.recover(run, self.parts, self.faults, fault, step=s, state=state, ref_params=self.ref_params,
                             kept=kept, data_state=self._data_after, restore=self.run_state.restore)
      self.parts, s, state, self.ref_params, pending = rec.parts, rec.step, rec.state, rec.ref_params, rec.pending
      if rec.history is not None:  # the trainer restored the newest checkpoint
        self.metrics.reset(rec.history)
        self._data_after = rec.data_state
      self.data.set_state(rec.data_state)
    self.run_state.wait()
    finished = s == steps
    if finished and self.weights.pushed < s:
      self.weights.push(state.params, s)  # evaluate the final weights even when push_every skipped them
    self.weights.end()
    self.roles.send_end(End(evaluate=finished and steps > 0))
    self.final_state = state
    summary = summary_lib.of_run(run, steps=s, finished=finished, params=state.params,
                                 staleness_hist=self.staleness_hist, failovers=len(self.faults.events),
                                 prompts_dropped=self.prompts_dropped, history=self.metrics.history)
    if finished:
      if steps > 0:
        summary["export_dir"] = self._export(state.params, os.path.join(self.workdir, "export"))
      after = self.evaluate("after") if steps > 0 else before  # steps=0: evaluate the starting policy only
      summary_lib.add_evals(summary, before, after, run.eval.n_samples, self.metrics.history)
    return summary_lib.write(self.workdir, summary, t_start)

  def run(self) -> Optional[dict]:
    """Trains from the newest checkpoint (or from scratch) to `controller.steps` → the summary dict (pass@k
    before/after, params digest, wall time) in the process that holds the trainer, None in a sampler-only one."""
    self.preemption.install()
    try:
      if self.trainer is None:  # the sampler process of a multi-process job
        return self.sampling.serve(self.parts)
      return self._train()
    finally:
      self.preemption.cancel()
      self._compiling.join()  # nothing of this run compiles after it (another run in the process would count it)
      for part in (self.sampling, self.metrics, self.run_state):
        if part is not None:
          part.close()
