"""The controller: a thin loop over parts with one job each.

    summary = Controller(config).run()      # config: a ConfigDict or a typed rlax.config.RunConfig

Data flow (one direction): the rollout producer (rlax.rollout.producer, its own thread, sampler submesh)
generates, grades and packs batch s with weights of version >= s - k → the rollout queue (staleness <= k)
→ the trainer (trainer submesh; one device_put per batch) → the weights service pushes version s + 1 →
the producer. The run state (rlax.runtime.run_state) defines what a checkpoint holds; preemption
(SIGTERM/SIGINT) stops at a step boundary with a checkpoint; slice loss is handled by
`rlax.runtime.failover.recover`, which returns new parts and a resume point.

One process drives both submeshes; or, without Pathways, the same program runs as one process per role
(`python -m launch.multihost --num_processes=2 -- python -m launch.main ...`): the process that owns the
trainer's devices trains and checkpoints, the one that owns the sampler's samples, grades and evaluates;
weights cross by `CrossMeshPush` and rollouts by the coordination service (rlax.rollout.remote).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
from typing import Any, Optional

from absl import logging
import jax
import numpy as np

from rlax import builders
from rlax import config as config_lib
from rlax import evaluation
from rlax import export
from rlax import memory
from rlax.metrics import MetricsWriter
from rlax.multihost import Channel
from rlax.rollout import Closed, RolloutQueue, packing
from rlax.rollout.producer import RolloutProducer
from rlax.rollout.remote import RemoteSink, RemoteSource
from rlax.rollout.sft import sft_warm_start
from rlax.runtime import failover
from rlax.runtime.preemption import Preemption
from rlax.runtime.run_state import NonFiniteError, RunState
from rlax.run.compiles import Background, CompileCounter
from rlax import run as run_lib
from rlax.trainer.batch import PackedBatch
from rlax.topology import SliceLostError, build_topology


class Controller:
  """Builds this process's parts from `config` and runs RL; see the module docstring.

  tokenizer (an rlax Tokenizer) / records=(train, eval) / reward_fn replace what the config names
  (benchmarks, embedding).
  callbacks: cb(controller, step, metrics_row) after every trainer step.
  """

  def __init__(self, config, *, progress: bool = True, callbacks=(), tokenizer=None, records=None,
               reward_fn=None):
    run = config if isinstance(config, config_lib.RunConfig) else config_lib.load(config)
    self.run_cfg = run
    try:
      os.makedirs(run.workdir, exist_ok=True)
    except OSError as e:  # a read-only filesystem, or a race with the check in config.validate
      raise ValueError(f"workdir={run.workdir!r}: {e.strerror}") from None
    self.workdir = run.workdir
    self.tokenizer = tokenizer or builders.tokenizer(run)
    if self.tokenizer.vocab_size > run.model.vocab_size:
      raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is "
                       f"{run.model.vocab_size}")
    self.render = builders.renderer(run, self.tokenizer)
    train, held = records or builders.datasets(run)
    # A prompt longer than the sampler's prompt budget cannot be generated from: drop it, and say so.
    self.train_records, dropped = self.render.fitting(train, run.rollout.max_prompt_len)
    self.eval_records, dropped_eval = self.render.fitting(held, run.rollout.max_prompt_len)
    self.prompts_dropped = {"train": dropped, "eval": dropped_eval}
    if (dropped or dropped_eval) and records is None and not run.data.train_files:
      # A built-in task's prompts come from one generator: dropping the longer ones would skew the task.
      longest = max(len(self.render.encode(r)) for r in [*train, *held])
      raise ValueError(f"rollout.max_prompt_len={run.rollout.max_prompt_len} is shorter than {dropped + dropped_eval} "
                       f"of task {run.data.task!r}'s prompts (the longest has {longest} tokens); raise it to {longest}")
    if dropped or dropped_eval:
      logging.warning("dropped %d train and %d eval prompts longer than rollout.max_prompt_len=%d tokens",
                      dropped, dropped_eval, run.rollout.max_prompt_len)
    if not self.train_records or not self.eval_records:
      raise ValueError(f"every {'training' if not self.train_records else 'eval'} prompt is longer than "
                       f"rollout.max_prompt_len={run.rollout.max_prompt_len} tokens; raise it")
    self.reward_fn = reward_fn or builders.reward_fn(run)
    topology = build_topology(run.topology)
    self.channel = Channel() if jax.process_count() > 1 else None
    if self.channel is not None and run.faults.any:
      raise ValueError("faults.lose_slice_at / restore_slice_at simulate slice loss inside one controller "
                       "process; a multi-process job recovers by restarting (launch.multihost)")
    # Slices an earlier process lost stay lost: start on the reduced topology.
    self.faults = failover.Faults(run, topology)
    topology = self.faults.restart_topology(topology)
    # Before anything compiles: a config that cannot fit fails here, naming the knob to change.
    est = memory.check_topology(run, topology)
    logging.info("memory estimate per device:\n%s", est.summary())
    self.parts = builders.components(run, topology, tok=self.tokenizer, channel=self.channel)
    self.preemption = Preemption(run.checkpoint.grace_seconds)
    self.callbacks = list(callbacks)
    self.pool = builders.verifier_pool(run) if self.sampler is not None else None
    self.episodes = builders.episodes(run, self.tokenizer, self.render, self.reward_fn, self.pool) if self.pool else None
    self.data = builders.record_iterator(run, self.train_records) if self.sampler is not None else None
    self.run_state = self.metrics = None
    if self.trainer is not None:
      self.run_state = RunState(run, run.rollout.max_prompt_len)
      self.metrics = MetricsWriter(os.path.join(run.workdir, "logs"), total_steps=run.controller.steps,
                                   progress=progress)
    self.staleness_hist: collections.Counter = collections.Counter()
    self.dropped = 0
    self.final_state = None
    self.ref_params = None
    self._data_after: dict = {}  # data position after the newest trained batch
    self.compiles = CompileCounter()
    self._compiling, self._compiled_for = Background(), None

  # -- the parts this process holds (read-only views) ----------------------------------------------------------
  @property
  def topo(self):
    return self.parts.topology

  @property
  def trainer(self):
    return self.parts.trainer

  @property
  def sampler(self):
    return self.parts.sampler

  @property
  def weights(self):
    return self.parts.weights

  def request_stop(self, *_) -> None:
    """Preemption notice: checkpoint at the next step boundary and return."""
    self.preemption.request()

  # -- pieces of the loop --------------------------------------------------------------------------------------
  def _warm_start(self, state) -> tuple[Any, int]:
    """The SFT warm start → (RL train state on its weights, SFT steps done).

    A preemption notice stops it between updates: its state is checkpointed (RunState.save_sft) and the
    state returned is None; the next run continues from there.
    """
    run = self.run_cfg
    steps = run.init.sft_steps
    if not steps:
      return state, 0
    sft = builders.sft_trainer(run, self.topo.trainer_mesh)
    sft_state, done = sft.init_state(state.params), 0
    saved = self.run_state.restore_sft(sft_state)
    if saved is not None:
      done, sft_state = saved
      logging.info("continuing the SFT warm start after %d/%d steps", done, steps)
    sft_state, done = sft_warm_start(sft, sft_state, self.render, self.train_records, steps=steps,
                                     batch=run.init.sft_batch, style=run.data.prompt_style,
                                     prompt_len=run.rollout.max_prompt_len, response_len=run.rollout.max_new_tokens,
                                     start=done, should_stop=lambda: self.preemption.requested)
    if done < steps:
      self.run_state.save_sft(done, sft_state)
      logging.warning("checkpointed the SFT warm start after %d/%d steps; run again to continue", done, steps)
      return None, done
    return self.trainer.init_state(sft_state.params), done  # RL starts from fresh optimizer moments

  def _nonfinite(self, s: int, what: str) -> None:
    """controller.on_nonfinite: 'stop' raises NonFiniteError; 'skip' keeps the state and logs the skip."""
    if self.run_cfg.controller.on_nonfinite == "stop":
      raise NonFiniteError(f"step {s}: {what} (controller.on_nonfinite='stop'; 'skip' skips such batches)")
    logging.warning("step %d: %s; batch skipped, parameters unchanged (controller.on_nonfinite='skip')", s, what)

  def _compile_ahead(self) -> None:
    """Compiles the trainer's programs on a thread (once per trainer); the first step waits for them."""
    if self._compiled_for is not self.trainer:
      self._compiled_for = self.trainer
      self._compiling = Background(lambda: self.trainer.compile_ahead(ref=self.run_cfg.algorithm.kl_coef > 0),
                                   name="compile-ahead")

  def _warm_sampler(self) -> None:
    if self.sampler is not None:
      self.sampler.warm_up(self.weights.latest()[0], builders.sampler_uses(self.run_cfg))

  def _push(self, params, version: int) -> dict:
    if self.sampler is not None:
      self.faults.ensure_alive(self.topo.sampler_mesh)
    return self.weights.push(params, version)

  def evaluate(self, tag: str) -> dict:
    """Held-out pass@k with the newest published weights (run by the process that holds the sampler)."""
    if self.sampler is None:
      return self.channel.get_json(f"eval/{tag}")
    run = self.run_cfg
    res = evaluation.held_out(self.eval_records, sampler=self.sampler, render=self.render, reward_fn=self.reward_fn,
                              pool=self.pool, method=builders.eval_method(run), n=run.eval.n_samples,
                              seed=run.seed + 1, weights=self.weights.latest(), episodes=self.episodes,
                              greedy=run.eval.greedy)
    logging.info("eval (%s): %s", tag, res)
    if self.channel is not None:
      self.channel.set_json(f"eval/{tag}", res)
    return res

  def _producer(self, sink) -> RolloutProducer:
    run = self.run_cfg
    return RolloutProducer(sampler=self.sampler, weights=self.weights, data=self.data, render=self.render,
                           reward_fn=self.reward_fn, grade=self.pool.grade, method=builders.sampling_method(run),
                           rollout=run.rollout, max_staleness=run.controller.max_staleness,
                           deterministic=run.deterministic, dynamic_sampling=run.controller.dynamic_sampling,
                           seed=run.seed, sink=sink, ensure_alive=self.faults.ensure_alive,
                           stale_policy=run.controller.stale_policy, episodes=self.episodes)

  def _save(self, s: int, state, queue: RolloutQueue, before: Optional[dict], force: bool) -> None:
    if not (force or self.run_state.should_save(s)):
      return
    n = self.run_state.pending_needed(s)
    pending = queue.peek(n) if n else []
    self.run_state.save(s, state, pending=pending, data_state=pending[-1].data_state if pending else self._data_after,
                        version=self.weights.pushed, history=self.metrics.history, eval_before=before,
                        ref_params=self.ref_params)

  def _export(self, params, out_dir: str) -> str:
    """The policy as an HF directory (config, safetensors, tokenizer, chat template, generation config)."""
    run = self.run_cfg
    params = self.trainer.merged_params(params)  # LoRA: the base with the adapters merged
    export.export_hf(params, run.model, out_dir, tokenizer=self.tokenizer, tokenizer_dir=run.hf_checkpoint or None)
    logging.info("exported the policy to %s", out_dir)
    return out_dir

  # -- the loop ------------------------------------------------------------------------------------------------
  def _stretch(self, s: int, state, ref_params, before: Optional[dict], pending: list):
    """Trains from step `s` until done, preempted or a slice fault → (step, state, fault or None, kept rollouts)."""
    run = self.run_cfg
    ctl, steps = run.controller, run.controller.steps
    queue = RolloutQueue(ctl.queue_size, ctl.max_staleness, ctl.stale_policy)
    plan = run_lib.train_plan(run, self.trainer)
    self._compile_ahead()  # a trainer rebuilt on a new mesh compiles its programs again
    for r in pending:
      queue.put(r)
    if self.sampler is not None:
      source = self._producer(queue.put)
      source.start(s + len(pending), steps, on_error=queue.close)
    else:
      source = RemoteSource(self.channel)
      source.start(s + len(pending), steps, queue, on_error=queue.close)
    fault, kept = None, []
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
        # Rewards are checked on the host, before the batch crosses; a non-finite loss or gradient norm
        # leaves the state unchanged inside the jitted step (trainer.state.apply_gradients).
        rewards = np.asarray(item.data.rewards)
        bad = None if np.isfinite(rewards).all() else (
            f"{int((~np.isfinite(rewards)).sum())} of {rewards.size} rewards are not finite "
            f"({', '.join(sorted({str(x) for x in rewards[~np.isfinite(rewards)]}))}; check the reward function)")
        m = {}
        if bad is None:
          self._compiling.wait()  # the run's programs, compiled ahead
          host = packing.for_trainer(item.data, self.trainer, plan.packed, run.optimizer.share_prompts,
                                     padded=plan.padded)
          R, L = host.tokens.shape
          n = self.trainer.num_micro_batches(R, L)
          rows = packing.rows_run(host, n) if isinstance(host, PackedBatch) else R
          batch = self.trainer.place(host)
          if ref_params is not None:
            batch = batch.replace(ref_logprobs=self.trainer.ref_logprobs(ref_params, batch))
          state, m = self.trainer.step(state, batch)
          m = dict(jax.device_get(m), train_rows=rows, train_row_len=L, micro_batches=m.pop("micro_batches_run"))
          if float(m.pop("finite", 1.0)) < 1:
            bad = f"the loss ({float(m['loss']):.4g}) or gradient norm ({float(m['grad_norm']):.4g}) is not finite"
        if bad is not None:
          self._nonfinite(s, bad)
        t2 = time.perf_counter()
        sync, lost = {}, None
        if (s + 1) % ctl.push_every == 0:
          try:
            sync = self._push(state.params, s + 1)
          except SliceLostError as e:  # the step is done; the rebuilt sampler gets these weights
            lost = e
        t3 = time.perf_counter()
        row = {k: float(v) for k, v in m.items()}
        row.update(item.stats)
        row.update(sync)
        row.update(nonfinite_skipped=float(bad is not None))
        n_compiles, compile_s = self.compiles.delta()
        row.update(compiles=float(n_compiles), compile_s=compile_s)
        row.update(train_s=t2 - t1, trainer_idle_s=wait, sync_total_s=t3 - t2, step_s=t3 - t0,
                   staleness=float(s - item.version), dropped=float(self.dropped + queue.dropped))
        row["tokens_per_s"] = row.get("response_tokens", 0.0) / max(t3 - t0, 1e-9)
        self.metrics.write(s, row)
        for cb in self.callbacks:
          cb(self, s, row)
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
    run = self.run_cfg
    steps = run.controller.steps
    kl = run.algorithm.kl_coef > 0
    initial = builders.initial_params(run, self.topo.trainer_mesh)
    state = self.trainer.init_state(initial)
    resume = self.run_state.restore(state)
    if resume is None:
      self.metrics.reset([])  # rows of an earlier attempt that never reached a checkpoint
      start, pending, before = 0, [], None
      state, sft_done = self._warm_start(state)
      if state is None:
        return self._stopped_in_warm_start(sft_done, t_start)
      self._data_after = self.data.get_state() if self.data is not None else {}
      # LoRA: the reference is the frozen base (no copy); else a copy of the donated params.
      ref_params = (self.trainer.base if run.lora.enabled else jax.tree.map(lambda x: x.copy(), state.params)
                    ) if kl else None
      if steps > 0:  # step 0 is saved at once: the warm start's work is kept, and a trainer slice lost
        # before the first periodic checkpoint restarts from these weights
        self.run_state.save(0, state, pending=[], data_state=self._data_after, version=0, history=[],
                            eval_before=None, ref_params=ref_params)
    else:
      start, state, pending, before = resume.step, resume.state, resume.pending, resume.eval_before
      # The reference is the policy RL started from, never the resumed one.
      ref_params = (resume.ref_params if self.run_state.with_ref else initial) if kl else None
      self.metrics.reset(resume.history)  # rows of steps after the checkpoint are trained again
      self._data_after = resume.data_state
      if self.data is not None:
        self.data.set_state(resume.data_state)
      logging.info("resumed from checkpoint step %d (%d pending rollouts)", start, len(pending))
    del initial
    self.ref_params = ref_params
    if self.channel is not None:
      self.channel.set_json("start", {"step": start, "first": start + len(pending),
                                      "data": resume.data_state if resume else None, "evaluate": resume is None})
    self._push(state.params, start)
    self._compile_ahead()  # on a thread, while the sampler compiles its own and evaluates the starting policy
    self._warm_sampler()
    if before is None:
      before = self.evaluate("before")
    s = start
    while True:  # one stretch per topology: a slice fault ends it and recovery starts the next
      s, state, fault, kept = self._stretch(s, state, ref_params, before, pending)
      if fault is None:
        break
      rec = failover.recover(run, self.parts, self.faults, fault, step=s, state=state, ref_params=ref_params,
                             kept=kept, data_state=self._data_after, restore=self.run_state.restore)
      self.parts, s, state, ref_params, pending = rec.parts, rec.step, rec.state, rec.ref_params, rec.pending
      self.ref_params = ref_params
      if rec.history is not None:  # the trainer restored the newest checkpoint
        self.metrics.reset(rec.history)
        self._data_after = rec.data_state
      self.data.set_state(rec.data_state)
    self.run_state.wait()
    finished = s == steps
    if finished and self.weights.pushed < s:
      self.weights.push(state.params, s)  # evaluate the final weights even when push_every skipped them
    self.weights.end()
    if self.channel is not None:
      self.channel.set_json("end", {"evaluate": finished and steps > 0})
    self.final_state = state
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(state.params)):
      digest.update(np.ascontiguousarray(leaf).tobytes())
    summary = {"steps": s, "preempted": not finished,
               "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
               "params_sha256": digest.hexdigest(), "failovers": len(self.faults.events),
               "processes": jax.process_count(),
               "model": run.hf_checkpoint or run.model_preset,
               "task": ",".join(run.data.files("train")) or run.data.task,
               "prompts_dropped": self.prompts_dropped,
               "nonfinite_skipped": int(sum(r.get("nonfinite_skipped") or 0 for r in self.metrics.history))}
    if finished:
      if steps > 0:
        summary["export_dir"] = self._export(state.params, os.path.join(self.workdir, "export"))
      after = self.evaluate("after") if steps > 0 else before  # steps=0: evaluate the starting policy only
      n = run.eval.n_samples
      summary.update({"pass1_before": before["pass@1"], "pass1_after": after["pass@1"],
                      f"pass{n}_before": before[f"pass@{n}"], f"pass{n}_after": after[f"pass@{n}"]})
      for k in ("env/tool_calls", "env/valid_call_rate"):  # multi-turn: tool use on the held-out episodes
        if k in after:
          summary.update({f"{k[4:]}_before": before.get(k), f"{k[4:]}_after": after[k]})
    summary["wall_s"] = time.perf_counter() - t_start
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump(summary, f)
    return summary

  def _stopped_in_warm_start(self, sft_done: int, t_start: float) -> dict:
    """A preemption notice during the warm start (its progress is saved): end as a preempted run."""
    if self.channel is not None:  # the sampler process has nothing to produce or evaluate
      self.channel.set_json("start", {"step": 0, "first": self.run_cfg.controller.steps, "data": None,
                                      "evaluate": False})
    self.weights.end()
    if self.channel is not None:
      self.channel.set_json("end", {"evaluate": False})
    summary = {"steps": 0, "preempted": True, "sft_steps_done": sft_done, "processes": jax.process_count(),
               "wall_s": time.perf_counter() - t_start}
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump(summary, f)
    return summary

  def _sample(self) -> None:
    """The sampler process of a multi-process job: produce every batch the trainer process asks for."""
    start = self.channel.get_json("start")
    if start["data"]:  # the trainer process saves {} at step 0: it holds no data iterator; start from the top
      self.data.set_state(start["data"])
    server = threading.Thread(target=self.weights.serve, daemon=True, name="weights-receiver")
    server.start()
    self.weights.wait_for(start["step"])
    self._warm_sampler()
    if start["evaluate"]:
      self.evaluate("before")
    try:
      self._producer(RemoteSink(self.channel)).run(start["first"], self.run_cfg.controller.steps)
    except Closed:  # the trainer process stopped early (preemption)
      pass
    end = self.channel.get_json("end")
    server.join()
    if end["evaluate"]:
      self.evaluate("after")

  def run(self) -> Optional[dict]:
    """Trains from the newest checkpoint (or from scratch) to `controller.steps`.

    Returns the summary dict (pass@k before/after, params digest, wall time) in the process that holds the
    trainer, None in a sampler-only process.
    """
    self.preemption.install()
    try:
      if self.trainer is None:
        self._sample()
        return None
      return self._train()
    finally:
      self.preemption.cancel()
      if self.pool is not None:
        self.pool.close()
      if self.metrics is not None:
        self.metrics.close()
      if self.run_state is not None:
        self.run_state.close()
