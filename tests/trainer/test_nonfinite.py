"""A non-finite loss or gradient never reaches the parameters or the optimizer moments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlax.trainer.state import TrainState, apply_gradients, update_is_finite


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_gradient_leaves_the_state_unchanged(bad):
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  params = {"w": jnp.arange(4.0), "b": jnp.ones(())}
  state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
  step = jax.jit(lambda st, g, loss: apply_gradients(tx, st, g, loss))
  good, norm = step(state, {"w": jnp.ones(4), "b": jnp.ones(())}, jnp.float32(1.0))
  assert int(good.step) == 1 and not np.array_equal(good.params["w"], params["w"]) and np.isfinite(norm)
  grads = {"w": jnp.array([1.0, bad, 0.0, 0.0]), "b": jnp.ones(())}
  new, norm = step(good, grads, jnp.float32(1.0))
  assert not update_is_finite(jnp.float32(1.0), norm)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(good)):
    np.testing.assert_array_equal(a, b)  # step, params and both Adam moments
  same, norm = step(good, {"w": jnp.ones(4), "b": jnp.ones(())}, jnp.float32(bad))  # finite grads, bad loss
  assert np.isfinite(norm) and not update_is_finite(jnp.float32(bad), norm)
  np.testing.assert_array_equal(same.params["w"], good.params["w"])
