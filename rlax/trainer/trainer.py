"""`Trainer`: builds the jitted RL step, SFT step and reference log-probs for one trainer mesh.

    trainer = Trainer(model_cfg, get_algorithm("grpo"), OptimizerConfig(lr=1e-6), mesh, group_size=8)
    state = trainer.init_state(models.create_params(model_cfg, mesh))
    batch = trainer.place(host_batch)                  # the rollout's one host -> device crossing
    batch = batch.replace(ref_logprobs=trainer.ref_logprobs(ref_params, batch))
    state, metrics = trainer.step(state, batch)        # state is donated: do not reuse the old one

Parameters keep the shardings of `models.param_shardings(cfg, mesh)` (FSDP x tensor
through models.RULES); batch rows carry the logical 'batch' axis (('data', 'fsdp')).
The planner lowers the same programs through `abstract_state`, `abstract_batch`
and `lower_step`, which share their layouts with `init_state` and `place`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlax import algorithms
from rlax import models
from rlax.models import lora as lora_lib
from rlax.models import moe
from rlax.models import variation
from rlax.models import sharding as shd
from rlax.models.init import abstract_params
from rlax.trainer import critic as critic_lib
from rlax.trainer import layouts
from rlax.trainer import objective as rl
from rlax.trainer import programs as programs_lib
from rlax.trainer.batch import PackedBatch, RolloutBatch, SFTBatch
from rlax.trainer.optimizer import OptimizerConfig, make_optimizer, make_schedule
from rlax.trainer.state import (TrainState, accumulate_gradients, apply_gradients, fill_order,
                                rows_in_micro_batches, update_is_finite)


def sft_loss(params, model_cfg: models.ModelConfig, batch: SFTBatch, *, num_tokens, chunk: int = 256
             ) -> tuple[jax.Array, dict]:
  """Token-mean cross-entropy of the loss_mask tokens, -sum(m * log p) / num_tokens (global count)."""
  lp = models.token_logprobs(params, model_cfg, batch.tokens, input_mask=batch.input_mask.astype(bool), chunk=chunk)
  m = batch.loss_mask.astype(jnp.float32)
  nll = -jnp.sum(lp * m)
  return nll / jnp.maximum(num_tokens, 1.0), {"nll_sum": jax.lax.stop_gradient(nll), "tokens": jnp.sum(m)}


class Trainer:
  """Jitted RL/SFT updates and reference log-probs on `mesh` (None: the default device).

  group_size: G of the batch's P x G row layout; micro_batches: gradient
  accumulation steps inside one jit (B must divide by it); micro_batch_tokens:
  if > 0, more micro-batches (the fewest that divide the batch evenly) until
  each device holds at most this many tokens per micro-batch -- on CPU this
  keeps activations in cache and is faster at equal math; logprob_chunk: the
  sequence chunk of models.token_logprobs; temperature: the sampler's temperature; lora: low-rank adapters
  (rlax.models.lora): the state's params are then the adapters (seeded by lora_seed), the base weights stay
  frozen in `self.base` (set by `init_state`, or `set_base` on a restore) and are the KL reference too.
  """

  def __init__(self, model_cfg: models.ModelConfig, algo: algorithms.AlgorithmConfig,
               optim: OptimizerConfig = OptimizerConfig(),
               mesh: Optional[Mesh] = None, *, group_size: int, micro_batches: int = 1, micro_batch_tokens: int = 0,
               logprob_chunk: int = 256, temperature: float = 1.0, lora: Optional[lora_lib.LoraConfig] = None,
               lora_seed: int = 0):
    if micro_batches < 1 or group_size < 1 or micro_batch_tokens < 0:
      raise ValueError(f"need micro_batches >= 1, group_size >= 1 and micro_batch_tokens >= 0, got "
                       f"{micro_batches}, {group_size}, {micro_batch_tokens}")
    self.model_cfg, self.algo, self.optim, self.mesh = model_cfg, algo, optim, mesh
    self.group_size, self.micro_batches, self.micro_batch_tokens = group_size, micro_batches, micro_batch_tokens
    self.chunk, self.temperature = logprob_chunk, temperature
    self.variation = variation.of(model_cfg, lora, lora_seed)  # what the state's params are
    self.base = None  # LoRA: the frozen base weights on the parameter shardings
    self.tx = make_optimizer(optim)
    self._lr = make_schedule(optim)
    # PPO's value model has its own AdamW (same betas and clipping, its own learning rate).
    self.critic_tx = (make_optimizer(OptimizerConfig(lr=algo.critic_lr, b1=optim.b1, b2=optim.b2,
                                                     max_grad_norm=optim.max_grad_norm))
                      if algo.has_value_model else None)
    self._state_shardings = self._make_state_shardings()
    # The updated state keeps init_state's exact shardings: an equivalent but unequal spec (P() for P(None))
    # would make the next step a new compile and the plan's lowering a different program.
    out = {} if mesh is None else dict(out_shardings=(self._state_shardings, NamedSharding(mesh, P())))
    self._rl = jax.jit(self._rl_step, donate_argnums=0, **out)
    self._sft = jax.jit(self._sft_step, donate_argnums=0, **out)
    self._refs: dict[tuple, Callable] = {}  # jitted reference log-probs per (layout, output shape)
    # Traces of the jitted bodies (each is a compile): steady state must add none.
    self.traces: collections.Counter = collections.Counter()
    self.compiled = programs_lib.CompiledTable()  # the run's steps, compiled ahead (compile_ahead)
    self._micro: dict[tuple[int, int], int] = {}  # micro-batches of the run's batch shapes (fix_shapes)
    self._fixed: list = []

  # -- layouts (shared by the runtime and the planner) -----------------------------------------------------------
  def _ctx(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _new_state(self, params, critic_trunk=None) -> TrainState:
    critic = None
    if self.algo.has_value_model:
      c = critic_lib.init_params(params if critic_trunk is None else critic_trunk)
      critic = TrainState(jnp.zeros((), jnp.int32), c, self.critic_tx.init(c))
    params = self.variation.init(params)
    return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params), critic)

  def set_base(self, params) -> None:
    """LoRA: the frozen base weights (placed on the parameter shardings); the KL reference is this base."""
    if not self.variation.frozen_base:
      raise ValueError("set_base: this trainer has no adapters (model.lora.rank=0)")
    self.base = params if self.mesh is None else jax.device_put(params, models.param_shardings(self.model_cfg,
                                                                                                 self.mesh))

  def merged_params(self, params):
    """The policy as plain weights: `params`, or the base with the adapters merged (export, evaluation)."""
    return self.variation.merge(params, self.base)

  def state_shardings(self) -> Optional[TrainState]:
    """TrainState of the shardings `init_state` and the steps produce (None without a mesh): params and
    optimizer moments on the parameter shardings, the step and other optimizer scalars replicated."""
    return self._state_shardings

  def _make_state_shardings(self) -> Optional[TrainState]:
    if self.mesh is None:
      return None
    shard = self.variation.shardings(self.mesh)
    rep = NamedSharding(self.mesh, P())
    opt = jax.eval_shape(self.tx.init, self.variation.abstract())
    opt_shard = optax.tree_map_params(self.tx, lambda _, s: s, opt, shard, transform_non_params=lambda _: rep)
    critic = None
    if self.algo.has_value_model:
      cshard = critic_lib.shardings(self.model_cfg, self.mesh)
      copt = jax.eval_shape(self.critic_tx.init, jax.eval_shape(critic_lib.init_params,
                                                                abstract_params(self.model_cfg)))
      critic = TrainState(step=rep, params=cshard, opt_state=optax.tree_map_params(
          self.critic_tx, lambda _, s: s, copt, cshard, transform_non_params=lambda _: rep))
    return TrainState(step=rep, params=shard, opt_state=opt_shard, critic=critic)

  def abstract_state(self) -> TrainState:
    """TrainState of ShapeDtypeStructs with exactly the shapes, dtypes and shardings of `init_state`'s."""
    shapes = jax.eval_shape(self._new_state, abstract_params(self.model_cfg))
    shardings = self.state_shardings()
    if shardings is None:
      return shapes
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)

  def batch_sharding(self, shape: tuple[int, ...]) -> Optional[NamedSharding]:
    """Sharding of one [rows, ...] batch array on the trainer mesh (None without a mesh)."""
    return shd.batch_sharding(self.mesh, shape[0], len(shape)) if self.mesh is not None else None

  def _as_placed(self, batch):
    """ShapeDtypeStructs of `batch`'s leaves (arrays or ShapeDtypeStructs) with the shardings `place` gives."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.batch_sharding(x.shape)),
                        batch)

  def abstract_batch(self, rows: int, seq: int, *, with_ref: bool, prompt_len: int = 0) -> RolloutBatch:
    """RolloutBatch of ShapeDtypeStructs (tokens [rows, seq]) laid out as `place` lays a real batch out."""
    return self._as_placed(RolloutBatch.abstract(rows, seq, with_ref=with_ref, prompt_len=prompt_len,
                                                 routes=moe.replayed_routes(self.model_cfg),
                                                 with_teacher=self.algo.distills,
                                                 teacher_top_k=self.algo.teacher_top_k))

  def abstract_packed(self, rows: int, length: int, slots: int, seqs: int, *, with_ref: bool,
                      max_len: int = 1) -> PackedBatch:
    """PackedBatch of ShapeDtypeStructs (rows x length tokens, slots scored slots a row) as `place` lays it out."""
    return self._as_placed(PackedBatch.abstract(rows, length, slots, seqs, with_ref=with_ref, max_len=max_len,
                                                routes=moe.replayed_routes(self.model_cfg),
                                                with_teacher=self.algo.distills,
                                                teacher_top_k=self.algo.teacher_top_k))

  def place(self, batch):
    """The batch on the trainer mesh in ONE `jax.device_put` (rows sharded as `batch_sharding` says).

    Numpy (host) arrays cross to the devices here; arrays already on their target sharding stay as they
    are (no copy), so placing a placed batch is free. Without a mesh: the default device.
    """
    if self.mesh is None:
      return jax.device_put(batch)
    return jax.device_put(batch, jax.tree.map(lambda x: self.batch_sharding(x.shape), batch))

  def lower_step(self, state: TrainState, batch: RolloutBatch | PackedBatch) -> jax.stages.Lowered:
    """The jitted RL step that `step` runs, lowered for `state` and `batch` (arrays or ShapeDtypeStructs,
    e.g. `abstract_state()` and `abstract_batch(...)`); the batch is laid out as `place` lays it out."""
    batch.check(self.group_size)
    self.num_micro_batches(*batch.tokens.shape)
    with self._ctx():
      return self._rl.lower(state, self._as_placed(batch), *self._base_arg(self._abstract_params()))

  def _abstract_params(self):
    """The model's params as ShapeDtypeStructs on their shardings (the LoRA base; the KL reference)."""
    shards = None if self.mesh is None else models.param_shardings(self.model_cfg, self.mesh)
    want = abstract_params(self.model_cfg)
    return want if shards is None else jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), want, shards)

  def fix_shapes(self, batches) -> None:
    """The run's batch shapes: (abstract batch, micro-batches) pairs (the resolved run's). A batch of one of
    these shapes is split into exactly those micro-batches; `compile_ahead` compiles them."""
    self._fixed = list(batches)
    self._micro.update({tuple(b.tokens.shape): n for b, n in self._fixed})

  def compile_ahead(self, *, ref: bool = False) -> None:
    """Compiles the RL step (and with `ref` the reference log-probs) for every `fix_shapes` shape into
    `self.compiled`: `step` then never compiles mid-run. Thread-safe against `step`."""
    state = self.abstract_state()
    for batch, _ in self._fixed:
      placed = self._as_placed(batch)
      args = (state, placed, *self._base_arg(self._abstract_params()))
      self.compiled.add(args, self.lower_step(state, placed))
      if ref:
        layout = layouts.of(placed)
        x, fn = layout.inputs(placed), self._ref_program(layout, tuple(placed.loss_mask.shape))
        with self._ctx():
          self.compiled.add((self._abstract_params(), x), fn.lower(self._abstract_params(), x, layout=layout),
                            static=layout)

  def init_state(self, params) -> TrainState:
    """TrainState(step=0, params, AdamW state) on `state_shardings()`; params must match the model config.
    LoRA: `params` become the frozen base and the state holds fresh adapters (B = 0) instead."""
    want = abstract_params(self.model_cfg)
    if jax.tree.structure(params) != jax.tree.structure(want):
      raise ValueError("init_state: parameter tree does not match the trainer's model config")
    for (path, x), w in zip(jax.tree.flatten_with_path(params)[0], jax.tree.leaves(want)):
      if tuple(x.shape) != tuple(w.shape) or x.dtype != w.dtype:
        raise ValueError(f"init_state: {jax.tree_util.keystr(path)} is {x.dtype}{list(x.shape)}, expected "
                         f"{w.dtype}{list(w.shape)} (model.param_dtype)")
    shardings = self.state_shardings()
    trunk = (critic_lib.load_trunk(self.algo.critic_init, self.model_cfg, self.mesh) if self.algo.has_value_model
             else None)
    if self.variation.frozen_base:  # the starting weights stay as the base; the state holds what trains
      self.set_base(params)
      params = self.base
    if shardings is None:
      return jax.jit(self._new_state)(params, trunk)
    params = jax.device_put(params, models.param_shardings(self.model_cfg, self.mesh))
    with self._ctx():
      return jax.jit(self._new_state, out_shardings=shardings)(params, trunk)

  def packed_rows_multiple(self) -> int:
    """Packed batches have a multiple of this many rows: whole rows for every row shard and micro-batch
    (rlax.rollout.packing.row_bucket); `micro_batch_tokens` then picks the micro-batch count as for padded rows."""
    shards = 1 if self.mesh is None else shd.row_shards(self.mesh, int(np.prod(list(self.mesh.shape.values()))))
    return shards * self.micro_batches

  def num_micro_batches(self, rows: int, seq_len: int) -> int:
    """Micro-batches of a [rows, seq_len] batch: as `compile_ahead` fixed them for its shapes, else
    `micro_batches`, raised to meet `micro_batch_tokens`."""
    if (rows, seq_len) in self._micro:
      return self._micro[rows, seq_len]
    n0 = self.micro_batches
    if rows % n0:
      raise ValueError(f"batch of {rows} rows does not split into {n0} micro-batches")
    if not self.micro_batch_tokens:
      return n0
    per_shard = rows // shd.row_shards(self.mesh, rows)
    # Multiples of n0 that divide each shard's rows, so micro-batch rows stay on their device.
    fits = [n for n in range(n0, per_shard + 1, n0) if per_shard % n == 0]
    for n in fits:
      if per_shard // n * seq_len <= self.micro_batch_tokens:
        return n
    return fits[-1] if fits else n0

  # -- public steps --------------------------------------------------------------------------------------------
  def step(self, state: TrainState, batch: RolloutBatch | PackedBatch) -> tuple[TrainState, dict]:
    """One RL update on `batch` (donates `state`); metrics are scalars (see objective.reduce_metrics).

    `batch` may be numpy (placed here, one device_put) or already `place`d (not moved again); padded rows
    (RolloutBatch) or packed ones (PackedBatch, rlax.rollout.packing.pack_tokens: the same loss, metrics
    and gradients on real tokens only).
    """
    batch.check(self.group_size)
    self.num_micro_batches(*batch.tokens.shape)
    if self.algo.has_value_model and getattr(state, "critic", None) is None:
      raise ValueError(f"{self.algo.name} trains a value model: the state has none (make it with this "
                       "trainer's init_state)")
    batch = self.place(batch)
    with self._ctx():
      return self.compiled.call(self._rl, state, batch, *self._base_arg(self.base))

  def sft_step(self, state: TrainState, batch: SFTBatch) -> tuple[TrainState, dict]:
    """One supervised update (cross-entropy on loss_mask tokens); metrics: loss, grad_norm, lr, tokens."""
    batch.check()
    self.num_micro_batches(*batch.tokens.shape)
    batch = self.place(batch)
    with self._ctx():
      return self._sft(state, batch, *self._base_arg(self.base))

  def _base_arg(self, base) -> tuple:
    """The steps' arguments after (state, batch) (`variation.step_args`: the frozen base with LoRA)."""
    return self.variation.step_args(base)

  def ref_logprobs(self, ref_params, batch: RolloutBatch | PackedBatch | SFTBatch) -> jax.Array:
    """Reference-model log-probs f32 of the batch's tokens (no gradient), aligned with loss_mask ([B, T-1]
    padded, [R, K] packed).

    The output has `batch_sharding`, so `batch.replace(ref_logprobs=...)` stays placed. Pass a `place`d
    batch when `step` follows, or the host batch crosses twice.
    """
    layout = layouts.of(batch)
    batch = self.place(batch)
    with self._ctx():
      return self.compiled.call(functools.partial(self._ref_program(layout, tuple(batch.loss_mask.shape)),
                                                  layout=layout), ref_params, layout.inputs(batch), static=layout)

  def _ref_program(self, layout: layouts.Layout, shape: tuple[int, ...]) -> Callable:
    if (layout, shape) not in self._refs:
      self.traces["ref_logprobs"] += 1
      # Exactly the batch layout (a constraint inside would drop the trailing None from the spec), so the
      # output joins a placed batch without a reshard or a new step compile.
      out = {} if self.mesh is None else dict(out_shardings=self.batch_sharding(shape))
      self._refs[layout, shape] = jax.jit(self._ref_logprobs, static_argnames="layout", **out)
    return self._refs[layout, shape]

  # -- jitted bodies -------------------------------------------------------------------------------------------
  def _ref_logprobs(self, params, x: dict, layout: layouts.Layout):
    return self._rows_in_micro_batches(
        lambda mb: layout.logprobs(params, self.model_cfg, mb, chunk=self.chunk, temperature=self.temperature), x,
        layout)

  def _rl_step(self, state: TrainState, batch: RolloutBatch | PackedBatch, base=None):
    self.traces["rl_step"] += 1
    old = None
    ppo = self.algo.has_value_model
    layout = layouts.of(batch)
    if (batch.advantages is None or ppo) and rl.kl_reward_old_logprobs(self.algo):
      # KL in the reward is measured from the old policy (the params at step start), not the sampler.
      old = self._ref_logprobs(self.variation.forward(state.params, base), layout.inputs(batch), layout)
    targets = None
    if ppo:
      targets = critic_lib.value_targets(self, state.critic.params, batch, old)
      if batch.advantages is None:
        batch = batch.replace(advantages=targets["advantages"])
    inputs = rl.loss_inputs(self.algo, batch, self.group_size, old)
    num_tokens, num_seqs = algorithms.denominators(inputs.loss_mask, layout.segments(inputs.model))
    num_inputs = layout.input_tokens(inputs.model)

    def loss_fn(params, mb):
      return rl.rl_loss(self.variation.forward(params, base), self.model_cfg, self.algo, mb, num_tokens=num_tokens,
                        num_seqs=num_seqs,
                        num_rows=batch.batch_size, chunk=self.chunk, temperature=self.temperature, layout=layout,
                        num_inputs=num_inputs)

    n = self.num_micro_batches(*batch.tokens.shape)
    grads, loss, stacked = accumulate_gradients(loss_fn, state.params, inputs, n,
                                                active=functools.partial(rl.contributes, self.algo, self.model_cfg))
    new_state, grad_norm = apply_gradients(self.tx, state, grads, loss)
    metrics = rl.reduce_metrics(stacked, loss, grad_norm, self._lr(state.step))
    if self.algo.distills:
      metrics["teacher_kl"] = algorithms.mean_reverse_kl(batch.behaviour_logprobs, batch.teacher_logprobs,
                                                         inputs.loss_mask)
    ok = update_is_finite(loss, grad_norm)
    if ppo:
      new_state, critic_metrics = critic_lib.update(self, state, new_state, batch, targets)
      metrics.update(critic_metrics)
      # One step: a non-finite policy or value update skips both (the policy's advantages came from this critic).
      ok &= update_is_finite(critic_metrics["value_loss"], critic_metrics["critic_grad_norm"])
      new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, state)
    metrics["finite"] = ok.astype(jnp.float32)
    return new_state, metrics

  # -- PPO's value model (rlax.trainer.critic) -------------------------------------------------------------------
  def _rows_in_micro_batches(self, fn, x: dict, layout: layouts.Layout):
    """fn(inputs of some rows) -> [rows, S], micro-batch by micro-batch like the loss (empty ones skipped)."""
    return rows_in_micro_batches(fn, x, self.num_micro_batches(*x["tokens"].shape), layout.has_tokens)

  def _sft_step(self, state: TrainState, batch: SFTBatch, base=None):
    num_tokens = jnp.sum(batch.loss_mask.astype(jnp.float32))

    def loss_fn(params, mb):
      return sft_loss(self.variation.forward(params, base), self.model_cfg, mb, num_tokens=num_tokens, chunk=self.chunk)

    grads, loss, stacked = accumulate_gradients(loss_fn, state.params, batch,
                                                self.num_micro_batches(*batch.tokens.shape), active=_has_loss)
    new_state, grad_norm = apply_gradients(self.tx, state, grads, loss)
    return new_state, {"loss": loss, "grad_norm": grad_norm, "lr": self._lr(state.step),
                       "tokens": jnp.sum(stacked["tokens"]),
                       "finite": update_is_finite(loss, grad_norm).astype(jnp.float32)}


def _has_loss(mb) -> jax.Array:
  """Whether a micro-batch scores any token (one that does not is skipped)."""
  return jnp.any(mb.loss_mask > 0)
