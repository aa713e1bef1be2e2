"""The single controller: one process drives the trainer and sampler submeshes.

Data flow (one direction): prompts → sampler (sampler mesh, weights v) → rewards
(host pool) → rollout queue (staleness ≤ k) → trainer (trainer mesh) → parameter
server push (v+1, device-to-device) → sampler. The sampler runs in its own
thread; JAX's asynchronous dispatch lets both submeshes compute at once.

Batch `s` is generated with weights of version ≥ s - k (exactly s - k in
deterministic mode), so staleness is bounded by construction; the queue's
check is the safety net. The controller orchestrates; the computing lives in
rlax.sampler, rlax.trainer, rlax.param_server and rlax.rewards.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from rlax import builders
from rlax import evaluation
from rlax import failover
from rlax import models as M
from rlax import rollout as rollout_lib
from rlax.checkpoint import Checkpointer, IncompatibleCheckpointError, abstract_like, to_json
from rlax.data import tokenizer as tok_lib
from rlax.data.dynamic_sampling import informative_groups
from rlax.data.pipeline import RecordIterator
from rlax.metrics import MetricsWriter
from rlax.param_server import ParameterServer
from rlax import rewards
from rlax.rollout_queue import Closed, Rollout, RolloutQueue
from rlax.topology import SliceLostError, build_topology
from rlax.trainer import OptimizerConfig, Trainer


_MAX_ROUNDS = 4  # dynamic sampling: most sampling rounds spent refilling one batch


class _Versions:
  """The newest published weight version, waitable."""

  def __init__(self):
    self._v = -1
    self._cv = threading.Condition()
    self.closed = False

  def publish(self, v: int) -> None:
    with self._cv:
      self._v = v
      self._cv.notify_all()

  def wait_for(self, pred) -> float:
    t0 = time.perf_counter()
    with self._cv:
      self._cv.wait_for(lambda: self.closed or pred(self._v))
      if self.closed:
        raise Closed()
    return time.perf_counter() - t0

  def close(self) -> None:
    with self._cv:
      self.closed = True
      self._cv.notify_all()


class Controller:
  """Builds every part from `config` and runs RL: `Controller(config).run()` → summary dict."""

  def __init__(self, config, *, progress: bool = True, callbacks=(), tokenizer=None, records=None,
               reward_fn=None):
    builders.validate(config)
    self.c = config
    self.workdir = config.workdir
    os.makedirs(self.workdir, exist_ok=True)
    self.model_cfg = builders.model_config(config)
    self.algo = builders.algorithm(config)
    self.topo = build_topology(config.topology)
    # tokenizer / records=(train, eval) / reward_fn replace what the config names (benchmarks, embedding).
    self.tokenizer = tokenizer or tok_lib.load_demo_tokenizer()
    if self.tokenizer.get_vocab_size() > self.model_cfg.vocab_size:
      raise ValueError(f"tokenizer has {self.tokenizer.get_vocab_size()} tokens but model.vocab_size is "
                       f"{self.model_cfg.vocab_size}")
    self.train_records, self.eval_records = records or builders.datasets(config)
    r = config.rollout
    self.G, self.P = r.samples_per_prompt, r.prompts_per_step
    self.trainer = self._build_trainer(self.topo.trainer_mesh)
    self.sampler = rollout_lib.make_sampler(config, self.model_cfg, self.topo.sampler_mesh)
    self.method = rollout_lib.strategy(r.temperature, r.top_k, r.top_p)
    self.ps = self._build_ps(self.topo.sampler_mesh)
    self.reward_fn = reward_fn or rewards.get(config.reward.name)
    self.pool = rewards.VerifierPool(num_workers=config.reward.workers, timeout_s=config.reward.timeout_s)
    self.data = RecordIterator(self.train_records, seed=config.seed)
    self.versions = _Versions()
    self.queue = RolloutQueue(config.controller.queue_size, config.controller.max_staleness,
                              config.controller.stale_policy)
    self.metrics = MetricsWriter(os.path.join(self.workdir, "logs"), total_steps=config.controller.steps,
                                 progress=progress)
    self._sampler_error: Optional[BaseException] = None
    self._started = -1
    self._started_cv = threading.Condition()
    self._stop = threading.Event()
    self.callbacks = list(callbacks)  # cb(controller, step, metrics_row) after every step
    self._grace_timer: Optional[threading.Timer] = None
    self._data_after: dict[int, dict] = {}
    ck = config.checkpoint
    self.ckpt = Checkpointer(os.path.join(self.workdir, "checkpoints"), keep=ck.keep,
                             every_steps=ck.every_steps or None, every_seconds=ck.every_seconds or None)
    self.failover = failover.Failover(self)  # slice health, scheduled faults, recovery

  def _build_trainer(self, mesh) -> Trainer:
    c = self.c
    return Trainer(self.model_cfg, self.algo, builders.optimizer(c, c.controller.steps), mesh, group_size=self.G,
                   micro_batches=c.optimizer.micro_batches, micro_batch_tokens=c.optimizer.micro_batch_tokens,
                   temperature=c.rollout.temperature)

  def _build_ps(self, mesh) -> ParameterServer:
    ps = self.c.param_server
    return ParameterServer(M.param_shardings(self.model_cfg, mesh), sampler_dtype=self.model_cfg.dtype,
                           mode=ps.bucket if not ps.bucket_bytes else "bytes", bucket_bytes=ps.bucket_bytes or None)

  # -- parameters and checkpoints ---------------------------------------------------------------------------
  def _fresh_state(self):
    params = M.create_params(self.model_cfg, self.topo.trainer_mesh, seed=self.c.seed)
    return self.trainer.init_state(params)

  def _warm_start(self, state):
    c = self.c
    if not c.init.sft_steps:
      return state
    sft = Trainer(self.model_cfg, self.algo, OptimizerConfig(lr=c.init.sft_lr, warmup_steps=10),
                  self.topo.trainer_mesh, group_size=1)
    state = rollout_lib.sft_warm_start(
        sft, sft.init_state(state.params), self.tokenizer, self.train_records, steps=c.init.sft_steps,
        batch=c.init.sft_batch, style=c.data.prompt_style, prompt_len=self.sampler.max_prompt_len,
        response_len=c.rollout.max_new_tokens)
    # RL starts from fresh optimizer moments and step 0 on the warm-started weights.
    return self.trainer.init_state(state.params)

  def _n_pending(self) -> int:
    """Rollouts generated ahead of the trainer that a checkpoint must carry (deterministic mode only)."""
    return self.c.controller.max_staleness if self.c.deterministic else 0

  def _template(self):
    return rollout_lib.empty_batch(self.P * self.G, self.sampler.max_prompt_len, self.c.rollout.max_new_tokens)

  def _ckpt_tree(self, state, pending):
    """What a checkpoint holds; `pending` is padded to a fixed count so every checkpoint has one shape."""
    pending = list(pending) + [self._template()] * (self._n_pending() - len(pending))
    return {"train": state, "pending": pending}

  def _restore(self, fresh_state):
    """(step, state, meta, pending rollouts) from the newest readable checkpoint, or None."""
    target = abstract_like(self._ckpt_tree(fresh_state, [self._template()] * self._n_pending()))
    got = self.ckpt.restore_latest(target)
    if got is None:
      return None
    step, tree, meta = got
    if meta.get("model") != to_json(self.model_cfg):
      raise IncompatibleCheckpointError(f"checkpoint step {step} was written for model {meta.get('model')}, "
                                        f"this run's model is {to_json(self.model_cfg)}")
    pending = [Rollout(r["index"], r["version"], b, r["stats"]) for r, b in zip(meta["pending"], tree["pending"])]
    return step, tree["train"], meta, pending

  def _save(self, step: int, state, before: dict, *, force: bool) -> bool:
    if not (force or self.ckpt.should_save(step)):
      return False
    n = min(self._n_pending(), self.c.controller.steps - step)  # no batches exist past the last step
    pending = self.queue.peek(n) if n else []
    last_batch = step - 1 + len(pending)  # the newest batch whose records are accounted for
    meta = {"step": step, "version": self.ps.version, "seed": self.c.seed, "data": self._data_after[last_batch],
            "pending": [{"index": r.index, "version": r.version, "stats": r.stats} for r in pending],
            "history": self.metrics.history, "eval_before": before, "config": self.c,
            "model": to_json(self.model_cfg)}
    self.ckpt.save(step, self._ckpt_tree(state, [r.data for r in pending]), meta, force=True)
    for k in [k for k in self._data_after if k < last_batch]:
      del self._data_after[k]
    return True

  def push(self, params, version: int) -> dict:
    """Trainer → parameter server (device-to-device); the sampler pulls at its next batch or chunk."""
    self.failover.ensure_alive(self.topo.sampler_mesh)
    self.failover.remember(params, version)
    stats = self.ps.push(params, version)
    self.versions.publish(version)
    return {"sync_s": stats.seconds, "sync_bytes": float(stats.bytes), "sync_gb_per_s": stats.gb_per_s}

  def _pull(self, exact: Optional[int] = None) -> None:
    """Installs the parameter server's newest weights in the sampler if they are newer than its own."""
    params, v = self.ps.pull()
    if exact is not None and v != exact:
      raise RuntimeError(f"deterministic schedule broken: sampler needs version {exact}, server has {v}")
    if v != self.sampler.version:
      self.sampler.update_weights(params, v)

  # -- sampler role ----------------------------------------------------------------------------------------
  def _sampler_loop(self, start: int, end: int) -> None:
    c = self.c
    k = c.controller.max_staleness
    on_chunk = (lambda i, t: self._pull()) if c.rollout.inflight_updates else None
    try:
      for s in range(start, end):
        need = max(0, s - k)
        idle = self.versions.wait_for(lambda v: v >= need)
        self._pull(exact=need if c.deterministic else None)
        with self._started_cv:
          self._started = s
          self._started_cv.notify_all()
        t0 = time.perf_counter()
        batch, lens, stats = self._graded_batch(s, on_chunk)
        self._data_after[s] = self.data.get_state()
        rw = np.asarray(batch.rewards)
        stats.update(reward=float(rw.mean()), pass_rate=float((rw > 0.5).mean()),
                     response_len=float(lens.mean()), response_tokens=float(lens.sum()),
                     sampler_idle_s=idle, gen_tokens_per_s=float(lens.sum()) / max(stats["gen_s"], 1e-9),
                     rollout_s=time.perf_counter() - t0)
        self.queue.put(Rollout(s, int(np.asarray(batch.versions).min()), batch, stats))
    except Closed:
      pass
    except SliceLostError as e:  # the trainer thread recovers (rlax.failover)
      self._sampler_error = e
      self.queue.close()
    except BaseException as e:  # surfaced in the trainer thread, which owns the run
      logging.exception("sampler thread failed")
      self._sampler_error = e
      self.queue.close()

  def _graded_batch(self, s: int, on_chunk):
    """P prompts × G samples for batch `s`, graded; with dynamic sampling, groups whose rewards all tie
    are dropped and refilled from fresh prompts (up to `_MAX_ROUNDS` rounds; tied groups fill any rest,
    harmlessly: their advantage is 0). Returns (batch, response lengths, stats)."""
    c, P, G = self.c, self.P, self.G
    kept, spare, t_gen, t_rew, dropped = [], [], 0.0, 0.0, 0
    for rnd in range(_MAX_ROUNDS if c.controller.dynamic_sampling else 1):
      records = self.data.next_batch(P)
      t0 = time.perf_counter()
      ids = [(s * _MAX_ROUNDS + rnd) * P + i for i in range(len(records))]  # unique, addressable keys
      self.failover.ensure_alive(self.topo.sampler_mesh)
      out = self.sampler.generate(rollout_lib.encode_prompts(self.tokenizer, records), samples_per_prompt=G,
                                  strategy=self.method, seed=c.seed, step=s, prompt_ids=ids, on_chunk=on_chunk)
      t1 = time.perf_counter()
      graded = self.pool.grade(self.reward_fn, rollout_lib.completions(self.tokenizer, out),
                               [r for r in records for _ in range(G)])
      rewards_np = np.array([g[0] for g in graded], np.float32)
      batch = rollout_lib.pack(out, rewards_np, self.sampler.max_prompt_len)
      t_gen, t_rew = t_gen + t1 - t0, t_rew + time.perf_counter() - t1
      lens = np.asarray(out.lengths)
      if not c.controller.dynamic_sampling:
        return batch, lens, {"gen_s": t_gen, "reward_s": t_rew}
      keep, n_drop = informative_groups(rewards_np.reshape(-1, G))
      dropped += n_drop
      for g, k in enumerate(keep):
        (kept if k else spare).append((batch, lens, np.arange(g * G, (g + 1) * G)))
      if len(kept) >= P:
        break
    chosen = (kept + spare)[:P]
    rows = lambda b, idx: jax.tree.map(lambda x: x[idx], b)
    batch = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[rows(b, i) for b, _, i in chosen])
    lens = np.concatenate([l[i] for _, l, i in chosen])
    logging.log_every_n(logging.INFO, "dynamic sampling: batch %d dropped %d tied groups in %d rounds", 20,
                        s, dropped, rnd + 1)
    return batch, lens, {"gen_s": t_gen, "reward_s": t_rew, "dyn_dropped_groups": float(dropped),
                         "dyn_rounds": float(rnd + 1), "dyn_tied_in_batch": float(max(0, P - len(kept)))}

  def _wait_sampler_started(self, batch_index: int, end: int) -> None:
    """Deterministic mode: version v may be published only once batch v-1+k has its weights."""
    with self._started_cv:
      self._started_cv.wait_for(lambda: self._started >= min(batch_index, end - 1)
                                or self._sampler_error is not None)

  # -- preemption ------------------------------------------------------------------------------------------
  def request_stop(self, *_) -> None:
    """Preemption notice (SIGTERM): checkpoint at the next safe point and return; force exit after the grace."""
    if self._stop.is_set():
      return
    logging.warning("preemption notice: checkpointing at the next step boundary (grace %.0fs)",
                    self.c.checkpoint.grace_seconds)
    self._stop.set()

    def overdue():
      logging.error("grace period of %.0fs exceeded before the checkpoint finished; exiting",
                    self.c.checkpoint.grace_seconds)
      os._exit(0)
    self._grace_timer = threading.Timer(self.c.checkpoint.grace_seconds, overdue)
    self._grace_timer.daemon = True
    self._grace_timer.start()

  # -- the loop --------------------------------------------------------------------------------------------
  def evaluate(self, params_version_note: str) -> dict:
    n = self.c.eval.n_samples
    self._pull()
    gen = rollout_lib.text_generate_fn(self.sampler, self.tokenizer, rollout_lib.strategy(self.c.eval.temperature),
                                       seed=self.c.seed + 1, step=0)
    res = evaluation.evaluate(gen, self.eval_records, self.reward_fn, n=n, ks=sorted({1, n}),
                              grade_fn=self.pool.grade)
    logging.info("eval (%s): %s", params_version_note, res)
    return res

  def _epoch(self, s: int, state, ref_params, before: dict):
    """Trains from step `s` until done or stopped → (step, state); raises failover.TopologyChange."""
    c = self.c
    steps = c.controller.steps
    first = s + len(self.queue)  # the queued rollouts (restored or kept over a failover) come first
    self._data_after[first - 1] = self.data.get_state()
    self._started, self._sampler_error = first - 1, None
    thread = threading.Thread(target=self._sampler_loop, args=(first, steps), daemon=True, name="sampler")
    thread.start()
    try:
      self.failover.settle(state, s)
      while s < steps and not self._stop.is_set():
        self.failover.at_step(s)
        t0 = time.perf_counter()
        try:
          item, wait = self.queue.get(policy_version=s)
        except Closed:
          if self._sampler_error is not None:
            raise self._sampler_error from None
          raise
        batch = item.data
        t1 = time.perf_counter()
        if ref_params is not None:
          batch = batch.replace(ref_logprobs=self.trainer.ref_logprobs(ref_params, batch))
        state, m = self.trainer.step(state, batch)
        m = jax.device_get(m)
        t2 = time.perf_counter()
        sync, lost = {}, None
        if (s + 1) % c.controller.push_every == 0:
          if c.deterministic:
            self._wait_sampler_started(s + c.controller.max_staleness, steps)
          try:
            sync = self.push(state.params, s + 1)
          except SliceLostError as e:  # the step is done; the rebuilt sampler gets these weights
            lost = e
        t3 = time.perf_counter()
        row = {k: float(v) for k, v in m.items()}
        row.update(item.stats)
        row.update(sync)
        row.update(train_s=t2 - t1, trainer_idle_s=wait, sync_total_s=t3 - t2, step_s=t3 - t0,
                   staleness=float(s - item.version), dropped=float(self.queue.dropped))
        row["tokens_per_s"] = row.get("response_tokens", 0.0) / max(t3 - t0, 1e-9)
        self.metrics.write(s, row)
        for cb in self.callbacks:
          cb(self, s, row)
        s += 1
        if lost is not None:
          raise lost
        self._save(s, state, before, force=self._stop.is_set() or s == steps)
    except failover.TopologyChange as e:
      e.position = (s, state)  # where recovery starts from
      raise
    finally:
      self.queue.close()
      self.versions.close()
      thread.join(timeout=60)
    return s, state

  def run(self) -> dict:
    """Trains from the newest checkpoint (or from scratch) to `controller.steps`; returns the summary."""
    t_start = time.perf_counter()
    c = self.c
    steps = c.controller.steps
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGTERM, self.request_stop)
    state = self._fresh_state()
    restored = self._restore(state)
    if restored is None:
      start, pending = 0, []
      state = self._warm_start(state)
      self.push(state.params, 0)
      before = self.evaluate("before")
    else:
      start, state, meta, pending = restored
      self.data.set_state(meta["data"])
      self.metrics.history[:] = meta["history"]
      before = meta["eval_before"]
      self.push(state.params, start)
      logging.info("resumed from checkpoint step %d (%d pending rollouts)", start, len(pending))
    for r in pending:
      self.queue.put(r)
    ref_params = jax.tree.map(lambda x: x.copy(), state.params) if self.algo.kl_coef > 0 else None
    s = start
    try:
      while True:  # one pass per stretch between slice failures
        try:
          s, state = self._epoch(s, state, ref_params, before)
          break
        except failover.TopologyChange as e:
          s, state, ref_params = self.failover.recover(e, *e.position, ref_params)
    finally:
      self.ckpt.wait()
      if self._grace_timer is not None:
        self._grace_timer.cancel()
    if self._sampler_error is not None:
      raise self._sampler_error
    self.final_state = state
    hist = {str(k): v for k, v in sorted(self.queue.staleness_hist.items())}
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(state.params)):
      digest.update(np.ascontiguousarray(leaf).tobytes())
    summary = {"steps": s, "preempted": s < steps, "staleness_hist": hist, "params_sha256": digest.hexdigest(),
               "failovers": len(self.failover.events)}
    if s == steps:
      after = self.evaluate("after")
      n = c.eval.n_samples
      summary.update({"pass1_before": before["pass@1"], "pass1_after": after["pass@1"],
                      f"pass{n}_before": before[f"pass@{n}"], f"pass{n}_after": after[f"pass@{n}"]})
    self.pool.close()
    self.metrics.close()
    self.ckpt.close()
    summary["wall_s"] = time.perf_counter() - t_start
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump(summary, f)
    return summary
