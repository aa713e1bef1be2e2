"""The sampler's side of a run: what the process that holds the sampler does besides holding it.

It grades (the verifier pool), steps environments (episodes), reads the training records (the record
iterator), produces rollouts (rlax.rollout.producer), warms the sampler's programs up and evaluates held-out
pass@k. In a multi-process job it is the whole of the sampler process (`serve`); in one process the
controller's loop drives it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from absl import logging

from rlax import allocator
from rlax import builders
from rlax import evaluation
from rlax import judges
from rlax import services
from rlax.config import RunConfig
from rlax.data.prompts import PromptRenderer
from rlax.data.records import Record
from rlax.rollout import Closed
from rlax.rollout.producer import RolloutProducer
from rlax.rollout.remote import RemoteSink
from rlax.runtime.roles import Handshake


class SamplerRole:
  """The sampler's jobs; `parts` (builders.Components: the sampler and weights service to use) is passed per
  call, since failover rebuilds them. `roles`: the handshake with the trainer process (a no-op without one)."""

  def __init__(self, run: RunConfig, *, tokenizer, render: PromptRenderer, reward_fn,
               records: tuple[Sequence[Record], Sequence[Record]], roles: Handshake,
               ensure_alive: Callable[[Any], None]):
    train_records, self.eval_records = records
    self.run, self.render, self.reward_fn, self.roles, self.ensure_alive = run, render, reward_fn, roles, ensure_alive
    self.pool = builders.verifier_pool(run)
    self.episodes = builders.episodes(run, tokenizer, render, reward_fn, self.pool)
    self.episodes.check_prompts([*self.eval_records, *train_records[:64]])
    self.data = builders.record_iterator(run, train_records)
    self.tokenizer, self._teacher = tokenizer, None

  def warm_up(self, parts) -> None:
    """Compiles the sampler's programs (every slot bucket and admission) before the first batch."""
    extend = self.run.env.episodic
    if extend:  # a multi-turn run compiles its extensions too: many programs
      allocator.check_memory_maps("building the sampler", need=allocator.MULTI_TURN_MAPS)
    parts.sampler.warm_up(parts.weights.latest()[0], builders.sampler_uses(self.run), extend=extend)
    self.judge(parts)  # loaded and compiled before the first batch too
    if (teacher := self.teacher(parts)) is not None:
      teacher.warm_up(self.run.rollout.rows, parts.sampler.max_prompt_len, self.run.rollout.max_new_tokens,
                      forks=self.run.env.episodic)
    allocator.release_free_memory()  # what compiling left free
    allocator.check_memory_maps("the sampler's warm-up")

  def evaluate(self, parts, tag: str) -> dict:
    """Held-out pass@k with the newest published weights; sent to the trainer process when there is one."""
    run = self.run
    self.judge(parts)
    res = evaluation.held_out(self.eval_records, sampler=parts.sampler, render=self.render, reward_fn=self.reward_fn,
                              pool=self.pool, method=builders.eval_method(run), n=run.eval.n_samples,
                              seed=run.seed + 1, weights=parts.weights.latest(), episodes=self.episodes,
                              greedy=run.eval.greedy)
    logging.info("eval (%s): %s", tag, res)
    self.roles.send_eval(tag, res)
    return res

  def _mesh(self, parts, name: str):
    """Where the teacher / judge runs now (rlax.services), said once per move when its own slices are lost."""
    placement = getattr(self.run, name).placement
    if placement == "own" and not parts.topology.assignment.service:
      logging.warning("the service slices are lost: the %s runs on the sampler's devices until they return", name)
    return services.local_mesh(parts.topology, placement)

  def teacher(self, parts):
    """A distilling run's teacher on its mesh (teacher.placement): loaded once per mesh."""
    if not self.run.algorithm.distills:
      return None
    if self._teacher is None or self._teacher.mesh != services.mesh(parts.topology, self.run.teacher.placement):
      self._teacher = None  # the old mesh's teacher goes before the new one loads
      self._teacher = builders.teacher(self.run, self._mesh(parts, "teacher"), self.tokenizer)
    return self._teacher

  def judge(self, parts):
    """A judging run's judge on its mesh (judge.placement): loaded and warmed up once per mesh, and handed to
    the run's reward entry (judges.JudgeReward), which grades through it."""
    entry = self.reward_fn
    if not isinstance(entry, judges.JudgeReward):
      return None
    if entry.judge is None or entry.judge.engine.mesh != services.mesh(parts.topology, self.run.judge.placement):
      entry.judge = None
      judge = builders.judge(self.run, self._mesh(parts, "judge"))
      judge.warm_up()
      entry.judge = judge
    return entry.judge

  def producer(self, parts, sink: Callable) -> RolloutProducer:
    run = self.run
    judge = self.judge(parts)
    alive = self.ensure_alive
    if judge is not None:  # the judge grades inside the sampler's rounds: its slices are checked with them
      alive = lambda mesh: (self.ensure_alive(mesh), self.ensure_alive(judge.engine.mesh))
    return RolloutProducer(sampler=parts.sampler, weights=parts.weights, data=self.data, render=self.render,
                           reward_fn=self.reward_fn, grade=self.pool.grade, method=builders.sampling_method(run),
                           rollout=run.rollout, max_staleness=run.controller.max_staleness,
                           deterministic=run.deterministic, dynamic_sampling=run.controller.dynamic_sampling,
                           seed=run.seed, sink=sink, ensure_alive=alive,
                           stale_policy=run.controller.stale_policy, episodes=self.episodes,
                           teacher=self.teacher(parts))

  def serve(self, parts) -> None:
    """The sampler process of a multi-process job: produce every batch the trainer process asks for, and
    evaluate where the handshake says so."""
    start = self.roles.recv_start()
    if start.data:  # the trainer process saves {} at step 0: it holds no data iterator; start from the top
      self.data.set_state(start.data)
    server = threading.Thread(target=parts.weights.serve, daemon=True, name="weights-receiver")
    server.start()
    if start.evaluate or start.first < self.run.controller.steps:  # else no weights come (a stopped warm start)
      parts.weights.wait_for(start.step)
      self.warm_up(parts)
    if start.evaluate:
      self.evaluate(parts, "before")
    try:
      self.producer(parts, RemoteSink(self.roles.channel)).run(start.first, self.run.controller.steps)
    except Closed:  # the trainer process stopped early (preemption)
      pass
    end = self.roles.recv_end()
    server.join()
    if end.evaluate:
      self.evaluate(parts, "after")

  def close(self) -> None:
    self.episodes.close()  # a multi-turn run's retrieval service
    self.pool.close()
