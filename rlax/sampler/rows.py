"""What a generated row is: its random keys, the uniform that draws each token, how it ends, and the
host-side output the engine returns.

Token t of a row is drawn with the uniform of fold_in(row_key, t), and the row key derives from (seed,
step, prompt id, sample index) only, so a row's tokens do not depend on the batch it was decoded in and a
preempted run can regenerate exactly what it lost.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

LENGTH, EOS, STOP, BUDGET = 0, 1, 2, 3  # finish reasons; BUDGET: an extension that did not fit the slot
FINISH_REASONS = {LENGTH: "length", EOS: "eos", STOP: "stop", BUDGET: "budget"}


@flax.struct.dataclass
class SampleOutput:
  """Rows are prompt-major: row r is sample r % G of prompt r // G. N = the engine's new-token budget, P its
  prompt length.

  tokens [B, N] every token after the prompt (pad_id after the end), sampled [B, N] which of them the policy
  drew (False: appended by `Stream.extend`, or past the end), logprobs [B, N] behaviour log-probs (0 where not
  sampled), lengths [B] tokens after the prompt (EOS / stop tokens included), finish_reason [B] (LENGTH / EOS /
  STOP / BUDGET), prompt_tokens / prompt_mask [B, P] (left-padded), versions [B, N] the weight version in force
  at each token (-1 after the end), prompt_ids / sample_ids [B]; version: the newest version used. routes
  [B, P + N, L, k] (a MoE model replaying routes, else None): the experts of each prompt (left-padded) and
  new token in each layer, NO_ROUTE where no forward fed the token (padding, each row's last token).
  """
  tokens: Int[Array, "B N"]
  logprobs: Float[Array, "B N"]
  lengths: Int[Array, "B"]
  finish_reason: Int[Array, "B"]
  prompt_tokens: Int[Array, "B P"]
  prompt_mask: Bool[Array, "B P"]
  versions: Int[Array, "B N"]
  prompt_ids: Int[Array, "B"]
  sample_ids: Int[Array, "B"]
  sampled: Bool[Array, "B N"]
  routes: Optional[Int[Array, "B T L k"]] = None
  version: int = flax.struct.field(pytree_node=False, default=0)


def concat_outputs(outs: Sequence[SampleOutput]) -> SampleOutput:
  """Host (numpy) SampleOutputs → one, rows in order; `version` the newest."""
  cat = jax.tree.map(lambda *xs: np.concatenate(xs), *[o.replace(version=0) for o in outs])
  return cat.replace(version=max(o.version for o in outs))


@functools.lru_cache(maxsize=8)
def _seed_key(seed: int) -> jax.Array:
  # Outside jit: a Python seed may use all 64 bits.
  return jax.random.key(seed)


@jax.jit
def _fold_rows(base, step, prompt_ids, sample_ids):
  base = jax.random.fold_in(base, step)
  return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))(prompt_ids, sample_ids)


def row_key_data(seed, step, prompt_ids, sample_ids) -> np.ndarray:
  """key(seed) → fold_in step → fold_in prompt id → fold_in sample index: one key per row, as its key data on the
  host (`jax.random.wrap_key_data` makes keys of it).

  One compiled call (op by op this cost ~5 ms a prompt) per power of two of rows at least 8 (the rows are padded:
  a judge's or an evaluation's row count varies); integers cast and the padding cut on the host (on the device
  each would compile a program per row count).
  """
  p, s = np.asarray(prompt_ids, np.uint32).ravel(), np.asarray(sample_ids, np.uint32).ravel()
  n = max(8, 1 << max(0, len(p) - 1).bit_length())
  keys = _fold_rows(_seed_key(int(seed)), np.uint32(step), np.resize(p, n), np.resize(s, n))
  return np.asarray(jax.random.key_data(keys))[:len(p)]


def uniforms(keys, t):
  """One uniform in (0, 1] per row for its token t (a scalar, or one index per row)."""
  u = jax.vmap(lambda k, tt: jax.random.uniform(jax.random.fold_in(k, tt), ()))(keys, jnp.broadcast_to(t, keys.shape))
  return 1.0 - u


def ends(tok, tokens, t, eos_ids: Sequence[int], stops: Sequence[Sequence[int]], stop_ids=None):
  """(is_eos, is_stop) per row for `tok`, just written at index t[r] of tokens [B, N].

  eos_ids: the engine's end tokens; stops: its stop sequences (the row's last tokens equal one of them);
  stop_ids [B, M]: per-row stop tokens (-1: none).
  """
  is_eos = jnp.zeros(tok.shape, bool)
  for e in eos_ids:
    is_eos |= tok == e
  is_stop = jnp.zeros(tok.shape, bool) if stop_ids is None else jnp.any(tok[:, None] == stop_ids, axis=1)
  for seq in stops:
    m = len(seq)
    idx = jnp.clip(jnp.reshape(t, (-1, 1)) - m + 1 + jnp.arange(m)[None], 0, tokens.shape[1] - 1)
    window = jnp.take_along_axis(tokens, jnp.broadcast_to(idx, (tokens.shape[0], m)), axis=1)
    is_stop |= (t + 1 >= m) & jnp.all(window == jnp.asarray(seq, jnp.int32)[None], axis=1)
  return is_eos, is_stop
