"""Train state and the shared update machinery: gradient accumulation over micro-batches + one optax step."""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlax.models import constrain

@flax.struct.dataclass
class TrainState:
  """step [] int32, params (rlax.models parameter dict), opt_state (the optax state of `params`);
  critic: PPO's value model as its own TrainState (rlax.trainer.critic), None without one, so that it
  is donated, checkpointed and restored onto a new mesh with the policy."""
  step: jax.Array
  params: Any
  opt_state: Any
  critic: Any = None


def split_micro_batches(tree: Any, n: int) -> Any:
  """[B, ...] leaves -> [n, B/n, ...]; micro-batch i takes rows i, i+n, i+2n, ...

  Strided (not contiguous) so that each micro-batch keeps the batch dimension's
  sharding: row b lives on the same device before and after the split.
  """
  def one(x):
    if x.shape[0] % n:
      raise ValueError(f"batch dimension {x.shape[0]} is not divisible by micro_batches={n}")
    return jnp.moveaxis(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 1, 0)
  return jax.tree.map(one, tree)


def _shard_rows(tree: Any) -> Any:
  return jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1)), tree)


def fill_order(rows: int, micro_batches: int, shards: int = 1) -> np.ndarray:
  """Where the q-th real row of a [rows, ...] batch goes so that real rows fill whole micro-batches first
  (`split_micro_batches` is strided) and, within one, spread over the `shards` row shards (contiguous blocks):
  the rest are empty micro-batches that `accumulate_gradients` skips. The packer lays rows out by it."""
  per = rows // micro_batches  # rows of one micro-batch, over every shard
  q = np.arange(rows)
  j, k = q // per, q % per
  i = (k % shards) * (per // shards) + k // shards
  return i * micro_batches + j


def _active_first(active: Callable[[Any], jax.Array], mbs: Any, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """([n] f32 1 where micro-batch i has work, how many do, their indices first): the loops below run only those."""
  on = jax.vmap(active)(mbs) if active is not None else jnp.ones((n,), bool)
  return on.astype(jnp.float32), jnp.sum(on.astype(jnp.int32)), jnp.argsort(~on, stable=True).astype(jnp.int32)


def _over_active(fn: Callable[[Any], Any], mbs: Any, n: int, active: Optional[Callable], acc: Any,
                 add: Callable[[Any, Any], Any]) -> tuple[Any, Any, jax.Array]:
  """Runs `fn(micro-batch i) -> (part, stacked)` for the micro-batches `active` keeps, one at a time (a loop whose
  trip count is theirs: an empty micro-batch costs nothing, where a scan of conditionals would still add a
  gradient-sized tree of zeros for each); `acc = add(acc, part)`. Returns (acc, every `stacked` [n, ...], zeros for
  the skipped, and [n] f32 1 where one ran)."""
  on, count, order = _active_first(active, mbs, n)
  first = jax.tree.map(lambda x: x[0], mbs)
  shapes = jax.eval_shape(fn, first)[1]
  stacked = jax.tree.map(lambda s: jnp.zeros((n,) + tuple(s.shape), s.dtype), shapes)

  def body(k, carry):
    acc, stacked = carry
    i = order[k]
    part, out = fn(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), mbs))
    return add(acc, part), jax.tree.map(lambda s, o: jax.lax.dynamic_update_index_in_dim(s, o, i, 0), stacked, out)

  acc, stacked = jax.lax.fori_loop(0, count, body, (acc, stacked))
  return acc, stacked, on


def accumulate_gradients(loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]], params: Any, batch: Any,
                         micro_batches: int, active: Optional[Callable[[Any], jax.Array]] = None
                         ) -> tuple[Any, jax.Array, dict]:
  """Sums loss and gradients of `loss_fn(params, micro_batch) -> (loss, metrics)` over micro-batches.

  `loss_fn` must already be normalized by global (full-batch) denominators so
  that the sum equals the full-batch loss. Returns (grads, loss, metrics) with
  every metric stacked over micro-batches ([n, ...]) for the caller to reduce, and metrics["active"] [n]:
  1 where the micro-batch ran. `active(micro_batch) -> [] bool`: micro-batches where it is false are skipped
  (their loss, gradients and metrics are 0).
  One micro-batch skips the loop, so its program is the plain full-batch step. More are a loop, never
  unrolled: XLA:CPU runs unrolled micro-batches side by side, so they would all be live at once and memory
  would not fall as micro-batches shrink.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if micro_batches == 1:
    (loss, metrics), grads = grad_fn(params, batch)
    return grads, loss, jax.tree.map(lambda x: x[None], dict(metrics, active=jnp.ones((), jnp.float32)))

  def one(mb):
    (loss, metrics), grads = grad_fn(params, _shard_rows(mb))
    return (grads, loss), metrics

  zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
  add = lambda acc, part: jax.tree.map(jnp.add, acc, part)
  (grads, loss), metrics, on = _over_active(one, split_micro_batches(batch, micro_batches), micro_batches, active,
                                            zeros, add)
  return grads, loss, dict(metrics, active=on)


def rows_in_micro_batches(fn: Callable[[Any], jax.Array], x: Any, micro_batches: int,
                          active: Optional[Callable[[Any], jax.Array]] = None) -> jax.Array:
  """fn(inputs of some rows) -> [rows, S], computed micro-batch by micro-batch like the loss (skipped ones: 0),
  back in the rows' order."""
  if micro_batches == 1:
    return fn(x)
  rows = jax.tree.leaves(x)[0].shape[0]
  _, out, _ = _over_active(lambda mb: ((), fn(_shard_rows(mb))), split_micro_batches(x, micro_batches),
                           micro_batches, active, (), lambda acc, part: acc)
  return jnp.moveaxis(out, 0, 1).reshape(rows, -1)


def masked_extreme(x: jax.Array, active: jax.Array, fn: Callable, empty: float) -> jax.Array:
  """max/min (`fn`) of per-micro-batch extremes over the micro-batches that ran; `empty` if none did."""
  fill = -jnp.inf if fn is jnp.max else jnp.inf
  out = fn(jnp.where(active > 0, x, fill))
  return jnp.where(jnp.any(active > 0), out, empty)


def apply_gradients(tx: optax.GradientTransformation, state: TrainState, grads: Any, loss: Any = None
                    ) -> tuple[TrainState, jax.Array]:
  """One optimizer update; returns the new state and the global gradient norm (before clipping).

  A non-finite gradient norm (or `loss`) returns `state` unchanged, step included: one NaN would otherwise
  reach every parameter and moment. `update_is_finite(loss, grad_norm)` tells the caller it happened.
  """
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  ok = update_is_finite(loss, grad_norm)
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state), grad_norm


def update_is_finite(loss: Any, grad_norm: jax.Array) -> jax.Array:
  """[] bool: whether `apply_gradients` applied the update (finite gradient norm and loss)."""
  ok = jnp.isfinite(grad_norm)
  return ok if loss is None else ok & jnp.all(jnp.isfinite(loss))
