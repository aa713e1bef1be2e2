"""Train state and the shared update machinery: gradient accumulation over micro-batches + one optax step."""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
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


def accumulate_gradients(loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]], params: Any, batch: Any,
                         micro_batches: int) -> tuple[Any, jax.Array, dict]:
  """Sums loss and gradients of `loss_fn(params, micro_batch) -> (loss, metrics)` over micro-batches.

  `loss_fn` must already be normalized by global (full-batch) denominators so
  that the sum equals the full-batch loss. Returns (grads, loss, metrics) with
  every metric stacked over micro-batches ([n, ...]) for the caller to reduce.
  One micro-batch skips the scan, so its program is the plain full-batch step. More are a scan, never
  unrolled: XLA:CPU runs unrolled micro-batches side by side, so they would all be live at once and memory
  would not fall as micro-batches shrink.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if micro_batches == 1:
    (loss, metrics), grads = grad_fn(params, batch)
    return grads, loss, jax.tree.map(lambda x: x[None], metrics)
  mbs = split_micro_batches(batch, micro_batches)

  def body(acc, mb):
    (loss, metrics), grads = grad_fn(params, _shard_rows(mb))
    acc_g, acc_l = acc
    return (jax.tree.map(jnp.add, acc_g, grads), acc_l + loss), metrics

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grads, loss), metrics = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), mbs)
  return grads, loss, metrics


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
