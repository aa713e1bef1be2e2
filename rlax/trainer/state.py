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


def _skipping(fn: Callable, active: Optional[Callable], *args) -> tuple[Any, jax.Array]:
  """(fn(*args), 1.0), or zeros of its outputs and 0.0 when `active(args[-1])` is false: an empty micro-batch
  costs a branch, not a forward and backward (fixed-shape batches carry empty ones)."""
  if active is None:
    return fn(*args), jnp.ones((), jnp.float32)
  shapes = jax.eval_shape(fn, *args)
  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  on = active(args[-1])
  return jax.lax.cond(on, lambda: fn(*args), zeros), on.astype(jnp.float32)


def accumulate_gradients(loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]], params: Any, batch: Any,
                         micro_batches: int, active: Optional[Callable[[Any], jax.Array]] = None
                         ) -> tuple[Any, jax.Array, dict]:
  """Sums loss and gradients of `loss_fn(params, micro_batch) -> (loss, metrics)` over micro-batches.

  `loss_fn` must already be normalized by global (full-batch) denominators so
  that the sum equals the full-batch loss. Returns (grads, loss, metrics) with
  every metric stacked over micro-batches ([n, ...]) for the caller to reduce, and metrics["active"] [n]:
  1 where the micro-batch ran. `active(micro_batch) -> [] bool`: micro-batches where it is false are skipped
  (their loss, gradients and metrics are 0).
  One micro-batch skips the scan, so its program is the plain full-batch step. More are a scan, never
  unrolled: XLA:CPU runs unrolled micro-batches side by side, so they would all be live at once and memory
  would not fall as micro-batches shrink.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if micro_batches == 1:
    (loss, metrics), grads = grad_fn(params, batch)
    return grads, loss, jax.tree.map(lambda x: x[None], dict(metrics, active=jnp.ones((), jnp.float32)))
  mbs = split_micro_batches(batch, micro_batches)

  def body(acc, mb):
    ((loss, metrics), grads), on = _skipping(grad_fn, active, params, _shard_rows(mb))
    acc_g, acc_l = acc
    return (jax.tree.map(jnp.add, acc_g, grads), acc_l + loss), dict(metrics, active=on)

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grads, loss), metrics = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), mbs)
  return grads, loss, metrics


def rows_in_micro_batches(fn: Callable[[Any], jax.Array], x: Any, micro_batches: int,
                          active: Optional[Callable[[Any], jax.Array]] = None) -> jax.Array:
  """fn(inputs of some rows) -> [rows, S], computed micro-batch by micro-batch like the loss (skipped ones: 0),
  back in the rows' order."""
  if micro_batches == 1:
    return fn(x)
  rows = jax.tree.leaves(x)[0].shape[0]
  out = jax.lax.scan(lambda c, mb: (c, _skipping(fn, active, _shard_rows(mb))[0]), None,
                     split_micro_batches(x, micro_batches))[1]
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
