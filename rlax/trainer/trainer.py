"""`Trainer`: builds the jitted RL step, SFT step and reference log-probs for one trainer mesh.

    trainer = Trainer(model_cfg, get_algorithm("grpo"), OptimizerConfig(lr=1e-6), mesh, group_size=8)
    state = trainer.init_state(M.create_params(model_cfg, mesh))
    batch = batch.replace(ref_logprobs=trainer.ref_logprobs(ref_params, batch))
    state, metrics = trainer.step(state, batch)        # state is donated: do not reuse the old one

Parameters keep the shardings of `M.param_shardings(cfg, mesh)` (FSDP x tensor
through M.RULES); batch rows are sharded over ('data', 'fsdp').
"""

from __future__ import annotations

import contextlib
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlax import algorithms as A
from rlax import models as M
from rlax.trainer import objective as rl
from rlax.trainer.batch import RolloutBatch, SFTBatch
from rlax.trainer.optimizer import OptimizerConfig, make_optimizer, make_schedule
from rlax.trainer.state import (MAX_UNROLLED_MICRO_BATCHES, TrainState, accumulate_gradients, apply_gradients,
                                split_micro_batches)


def sft_loss(params, model_cfg: M.ModelConfig, batch: SFTBatch, *, num_tokens, chunk: int = 256
             ) -> tuple[jax.Array, dict]:
  """Token-mean cross-entropy of the loss_mask tokens, -sum(m * log p) / num_tokens (global count)."""
  lp = M.token_logprobs(params, model_cfg, batch.tokens, input_mask=batch.input_mask.astype(bool), chunk=chunk)
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
  sequence chunk of M.token_logprobs; temperature: the sampler's temperature.
  """

  def __init__(self, model_cfg: M.ModelConfig, algo: A.AlgorithmConfig, optim: OptimizerConfig = OptimizerConfig(),
               mesh: Optional[Mesh] = None, *, group_size: int, micro_batches: int = 1, micro_batch_tokens: int = 0,
               logprob_chunk: int = 256, temperature: float = 1.0):
    if micro_batches < 1 or group_size < 1 or micro_batch_tokens < 0:
      raise ValueError(f"need micro_batches >= 1, group_size >= 1 and micro_batch_tokens >= 0, got "
                       f"{micro_batches}, {group_size}, {micro_batch_tokens}")
    self.model_cfg, self.algo, self.optim, self.mesh = model_cfg, algo, optim, mesh
    self.group_size, self.micro_batches, self.micro_batch_tokens = group_size, micro_batches, micro_batch_tokens
    self.chunk, self.temperature = logprob_chunk, temperature
    self.tx = make_optimizer(optim)
    self._lr = make_schedule(optim)
    self._state_shardings = None
    self._rl = jax.jit(self._rl_step, donate_argnums=0)
    self._sft = jax.jit(self._sft_step, donate_argnums=0)
    self._ref = jax.jit(self._ref_logprobs, static_argnums=3)

  # -- placement -----------------------------------------------------------------------------------------------
  def _ctx(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _rows(self, tree):
    """Puts every [B, ...] leaf on the mesh with rows sharded over ('data', 'fsdp')."""
    if self.mesh is None:
      return tree
    n = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    def put(x):
      axes = ("data", "fsdp") if x.shape[0] % n == 0 else None
      return jax.device_put(x, NamedSharding(self.mesh, P(axes, *([None] * (x.ndim - 1)))))
    return jax.tree.map(put, tree)

  def init_state(self, params) -> TrainState:
    """TrainState(step=0, params, adamw state); params and optimizer moments placed on the parameter shardings."""
    if self.mesh is None:
      return jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), p, self.tx.init(p)))(params)
    shard = M.param_shardings(self.model_cfg, self.mesh)
    params = jax.device_put(params, shard)
    rep = NamedSharding(self.mesh, P())
    abstract_opt = jax.eval_shape(self.tx.init, params)
    opt_shard = optax.tree_map_params(self.tx, lambda _, s: s, abstract_opt, shard,
                                      transform_non_params=lambda _: rep)
    out = TrainState(step=rep, params=shard, opt_state=opt_shard)
    with self._ctx():
      return jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), p, self.tx.init(p)), out_shardings=out)(params)

  def num_micro_batches(self, rows: int, seq_len: int) -> int:
    """Micro-batches of a [rows, seq_len] batch: `micro_batches`, raised to meet `micro_batch_tokens`."""
    n0 = self.micro_batches
    if rows % n0:
      raise ValueError(f"batch of {rows} rows does not split into {n0} micro-batches")
    if not self.micro_batch_tokens:
      return n0
    shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"] if self.mesh is not None else 1
    per_shard = rows // shards if rows % shards == 0 else rows
    # Multiples of n0 that divide each shard's rows, so micro-batch rows stay on their device.
    fits = [n for n in range(n0, per_shard + 1, n0) if per_shard % n == 0]
    for n in fits:
      if per_shard // n * seq_len <= self.micro_batch_tokens:
        return n
    return fits[-1] if fits else n0

  # -- public steps --------------------------------------------------------------------------------------------
  def step(self, state: TrainState, batch: RolloutBatch) -> tuple[TrainState, dict]:
    """One RL update on `batch` (donates `state`); metrics are scalars (see objective.reduce_metrics)."""
    batch.check(self.group_size)
    self.num_micro_batches(*batch.tokens.shape)
    with self._ctx():
      return self._rl(state, self._rows(batch))

  def sft_step(self, state: TrainState, batch: SFTBatch) -> tuple[TrainState, dict]:
    """One supervised update (cross-entropy on loss_mask tokens); metrics: loss, grad_norm, lr, tokens."""
    batch.check()
    self.num_micro_batches(*batch.tokens.shape)
    with self._ctx():
      return self._sft(state, self._rows(batch))

  def ref_logprobs(self, ref_params, batch: RolloutBatch | SFTBatch) -> jax.Array:
    """Reference-model log-probs [B, T-1] of the batch's tokens (no gradient), aligned with loss_mask."""
    start = max(getattr(batch, "prompt_len", 0) - 1, 0)
    with self._ctx():
      rows = self._rows((batch.tokens, batch.input_mask))
      return self._ref(ref_params, *rows, start)

  # -- jitted bodies -------------------------------------------------------------------------------------------
  def _ref_logprobs(self, params, tokens, input_mask, start=0):
    def one(xs):
      return M.token_logprobs(params, self.model_cfg, xs[0], input_mask=xs[1].astype(bool), chunk=self.chunk,
                              temperature=self.temperature, start=start)
    n = self.num_micro_batches(*tokens.shape)
    if n == 1:
      return one((tokens, input_mask))
    _, out = jax.lax.scan(lambda c, mb: (c, one(mb)), None, split_micro_batches((tokens, input_mask), n),
                          unroll=n <= MAX_UNROLLED_MICRO_BATCHES)  # [n, B/n, T-1]
    return jnp.moveaxis(out, 0, 1).reshape(tokens.shape[0], -1)

  def _rl_step(self, state: TrainState, batch: RolloutBatch):
    inputs = rl.loss_inputs(self.algo, batch, self.group_size)
    num_tokens, num_seqs = A.denominators(inputs.loss_mask)

    def loss_fn(params, mb):
      return rl.rl_loss(params, self.model_cfg, self.algo, mb, num_tokens=num_tokens, num_seqs=num_seqs,
                        num_rows=batch.batch_size, chunk=self.chunk, temperature=self.temperature,
                        start=max(batch.prompt_len - 1, 0))

    n = self.num_micro_batches(*batch.tokens.shape)
    grads, loss, stacked = accumulate_gradients(loss_fn, state.params, inputs, n)
    new_state, grad_norm = apply_gradients(self.tx, state, grads)
    return new_state, rl.reduce_metrics(stacked, loss, grad_norm, self._lr(state.step))

  def _sft_step(self, state: TrainState, batch: SFTBatch):
    num_tokens = jnp.sum(batch.loss_mask.astype(jnp.float32))

    def loss_fn(params, mb):
      return sft_loss(params, self.model_cfg, mb, num_tokens=num_tokens, chunk=self.chunk)

    grads, loss, stacked = accumulate_gradients(loss_fn, state.params, batch,
                                                self.num_micro_batches(*batch.tokens.shape))
    new_state, grad_norm = apply_gradients(self.tx, state, grads)
    return new_state, {"loss": loss, "grad_norm": grad_norm, "lr": self._lr(state.step),
                       "tokens": jnp.sum(stacked["tokens"])}
