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

import collections
import json
import os
import threading
import time
from typing import Any, Optional

from absl import logging
import jax
import numpy as np

from rlax import builders
from rlax import evaluation
from rlax import models as M
from rlax import rollout as rollout_lib
from rlax.data import tokenizer as tok_lib
from rlax.data.pipeline import RecordIterator
from rlax.metrics import MetricsWriter
from rlax.param_server import ParameterServer
from rlax import rewards
from rlax.rollout_queue import Closed, Rollout, RolloutQueue
from rlax.topology import build_topology
from rlax.trainer import OptimizerConfig, Trainer


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

  def __init__(self, config, *, progress: bool = True):
    builders.validate(config)
    self.c = config
    self.workdir = config.workdir
    os.makedirs(self.workdir, exist_ok=True)
    self.model_cfg = builders.model_config(config)
    self.algo = builders.algorithm(config)
    self.topo = build_topology(config.topology)
    self.tokenizer = tok_lib.load_demo_tokenizer()
    if self.tokenizer.get_vocab_size() > self.model_cfg.vocab_size:
      raise ValueError(f"tokenizer has {self.tokenizer.get_vocab_size()} tokens but model.vocab_size is "
                       f"{self.model_cfg.vocab_size}")
    self.train_records, self.eval_records = builders.datasets(config)
    r = config.rollout
    self.G, self.P = r.samples_per_prompt, r.prompts_per_step
    self.trainer = Trainer(self.model_cfg, self.algo, builders.optimizer(config, config.controller.steps),
                           self.topo.trainer_mesh, group_size=self.G,
                           micro_batches=config.optimizer.micro_batches, temperature=r.temperature)
    self.sampler = rollout_lib.make_sampler(config, self.model_cfg, self.topo.sampler_mesh)
    self.method = rollout_lib.strategy(r.temperature, r.top_k, r.top_p)
    self.ps = ParameterServer(M.param_shardings(self.model_cfg, self.topo.sampler_mesh),
                              sampler_dtype=self.model_cfg.dtype,
                              mode=config.param_server.bucket if not config.param_server.bucket_bytes else "bytes",
                              bucket_bytes=config.param_server.bucket_bytes or None)
    self.reward_fn = rewards.get(config.reward.name)
    self.pool = rewards.VerifierPool(num_workers=config.reward.workers, timeout_s=config.reward.timeout_s)
    self.data = RecordIterator(self.train_records, seed=config.seed)
    self.versions = _Versions()
    self.queue = RolloutQueue(config.controller.queue_size, config.controller.max_staleness,
                              config.controller.stale_policy)
    self.metrics = MetricsWriter(os.path.join(self.workdir, "logs"), total_steps=config.controller.steps,
                                 progress=progress)
    self.timers = collections.defaultdict(float)
    self._sampler_error: Optional[BaseException] = None
    self._started = -1
    self._started_cv = threading.Condition()

  # -- parameters ------------------------------------------------------------------------------------------
  def init_state(self):
    c = self.c
    params = M.create_params(self.model_cfg, self.topo.trainer_mesh, seed=c.seed)
    if c.init.sft_steps:
      sft = Trainer(self.model_cfg, self.algo, OptimizerConfig(lr=c.init.sft_lr, warmup_steps=10),
                    self.topo.trainer_mesh, group_size=1)
      state = rollout_lib.sft_warm_start(
          sft, sft.init_state(params), self.tokenizer, self.train_records, steps=c.init.sft_steps,
          batch=c.init.sft_batch, style=c.data.prompt_style, prompt_len=c.rollout.max_prompt_len,
          response_len=c.rollout.max_new_tokens)
      params = state.params
    # RL starts from fresh optimizer moments and step 0 on the (warm-started) weights.
    return self.trainer.init_state(params)

  def push(self, params, version: int) -> dict:
    """Trainer → parameter server (device-to-device); the sampler pulls at its next batch or chunk."""
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
        records = self.data.next_batch(self.P)
        t0 = time.perf_counter()
        out = self.sampler.generate(rollout_lib.encode_prompts(self.tokenizer, records), samples_per_prompt=self.G,
                                    strategy=self.method, seed=c.seed, step=s,
                                    prompt_ids=[s * self.P + i for i in range(len(records))], on_chunk=on_chunk)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        texts = rollout_lib.completions(self.tokenizer, out)
        graded = self.pool.grade(self.reward_fn, texts, [r for r in records for _ in range(self.G)])
        rewards_np = np.array([g[0] for g in graded], np.float32)
        batch = rollout_lib.pack(out, rewards_np)
        t_rew = time.perf_counter() - t0
        lens = np.asarray(out.lengths)
        stats = dict(reward=float(rewards_np.mean()), pass_rate=float((rewards_np > 0.5).mean()),
                     response_len=float(lens.mean()), response_tokens=float(lens.sum()),
                     gen_s=t_gen, reward_s=t_rew, sampler_idle_s=idle,
                     gen_tokens_per_s=float(lens.sum()) / max(t_gen, 1e-9))
        wait = self.queue.put(Rollout(s, int(np.asarray(batch.versions).min()), batch, stats))
        self.timers["sampler_queue_wait_s"] += wait
    except Closed:
      pass
    except BaseException as e:  # surfaced in the trainer thread, which owns the run
      logging.exception("sampler thread failed")
      self._sampler_error = e
      self.queue.close()

  def _wait_sampler_started(self, batch_index: int, end: int) -> None:
    """Deterministic mode: version v may be published only once batch v-1+k has its weights."""
    with self._started_cv:
      self._started_cv.wait_for(lambda: self._started >= min(batch_index, end - 1)
                                or self._sampler_error is not None)

  # -- the loop --------------------------------------------------------------------------------------------
  def evaluate(self, params_version_note: str) -> dict:
    n = self.c.eval.n_samples
    self._pull()
    gen = rollout_lib.text_generate_fn(self.sampler, self.tokenizer, rollout_lib.strategy(self.c.eval.temperature),
                                       seed=self.c.seed + 1, step=0)
    res = evaluation.evaluate(gen, self.eval_records,
                              self.reward_fn, n=n, ks=sorted({1, n}), grade_fn=self.pool.grade)
    logging.info("eval (%s): %s", params_version_note, res)
    return res

  def run(self) -> dict:
    t_start = time.perf_counter()
    c = self.c
    state = self.init_state()
    self.push(state.params, 0)
    ref_params = jax.tree.map(lambda x: x.copy(), state.params) if self.algo.kl_coef > 0 else None
    before = self.evaluate("before")
    steps = c.controller.steps
    thread = threading.Thread(target=self._sampler_loop, args=(0, steps), daemon=True, name="sampler")
    thread.start()
    try:
      for s in range(steps):
        t0 = time.perf_counter()
        item, wait = self.queue.get(policy_version=s)
        batch = item.data
        t1 = time.perf_counter()
        if ref_params is not None:
          batch = batch.replace(ref_logprobs=self.trainer.ref_logprobs(ref_params, batch))
        state, m = self.trainer.step(state, batch)
        m = jax.device_get(m)
        t2 = time.perf_counter()
        sync = {}
        if (s + 1) % c.controller.push_every == 0:
          if c.deterministic:
            self._wait_sampler_started(s + c.controller.max_staleness, steps)
          sync = self.push(state.params, s + 1)
        t3 = time.perf_counter()
        row = {k: float(v) for k, v in m.items()}
        row.update(item.stats)
        row.update(sync)
        row.update(train_s=t2 - t1, trainer_idle_s=wait, sync_total_s=t3 - t2, step_s=t3 - t0,
                   staleness=float(s - item.version), dropped=float(self.queue.dropped))
        row["tokens_per_s"] = row.get("response_tokens", 0.0) / max(t3 - t0, 1e-9)
        self.metrics.write(s, row)
    finally:
      self.queue.close()
      self.versions.close()
      thread.join(timeout=60)
    if self._sampler_error is not None:
      raise self._sampler_error
    after = self.evaluate("after")
    self.pool.close()
    self.metrics.close()
    hist = {str(k): v for k, v in sorted(self.queue.staleness_hist.items())}
    summary = {"pass1_before": before["pass@1"], "pass1_after": after["pass@1"],
               f"pass{c.eval.n_samples}_before": before[f"pass@{c.eval.n_samples}"],
               f"pass{c.eval.n_samples}_after": after[f"pass@{c.eval.n_samples}"],
               "steps": steps, "staleness_hist": hist, "wall_s": time.perf_counter() - t_start}
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump(summary, f)
    return summary
