"""Per-token log-probabilities without materializing [B, T, V] logits.

The sequence is cut into chunks of `chunk` positions; each chunk's logits are
computed, reduced to (log-prob of the target, entropy) and dropped. Under
`jax.grad` each chunk is rematerialized, so the backward pass holds one chunk of
logits at a time too (vocab 152k × 32k tokens would otherwise be 20 GB per row).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rlax.models import transformer
from rlax.models.config import ModelConfig


def logprobs_from_hidden(h: Float[Array, "B T D"], w: Float[Array, "D V"], targets: Int[Array, "B T"], *,
                         temperature: float = 1.0, chunk: int = 256, with_entropy: bool = False, top_k: int = 0,
                         top_vocab: int = 0, at: Optional[Int[Array, "B T k"]] = None):
  """log p(targets[b, t] | h[b, t]) for logits h @ w / temperature, chunked over T.

  Returns [B, T] log-probs (f32); then [B, T] entropies when `with_entropy`; then, with `top_k`, the k most
  likely ids [B, T, k] (int32, among the first `top_vocab` when given) and their log-probs [B, T, k]; then, with
  `at` [B, T, k'] ids, their log-probs [B, T, k']. A lone array when only the log-probs are asked for.
  Callers: rlax.trainer.layouts.Layout.logprobs (the trainer's and a teacher's top-k for forward KL).
  """
  B, T, D = h.shape
  chunk = max(1, min(chunk, T))
  n = -(-T // chunk)
  pad = n * chunk - T
  extra = () if at is None else (at,)
  if pad:
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    extra = tuple(jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in extra)
  to_chunks = lambda a: a.reshape(B, n, chunk, *a.shape[2:]).swapaxes(0, 1)
  from_chunks = lambda a: a.swapaxes(0, 1).reshape(B, n * chunk, *a.shape[3:])[:, :T]

  @jax.checkpoint
  def one(hx, tx, *ax):
    logits = jnp.einsum("btd,dv->btv", hx, w, preferred_element_type=jnp.float32) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    out = [jnp.take_along_axis(logits, tx[..., None], axis=-1)[..., 0] - lse]
    if with_entropy:
      p = jnp.exp(logits - lse[..., None])
      out.append(lse - jnp.sum(p * logits, axis=-1))
    if top_k:
      vals, ids = jax.lax.top_k(logits[..., :top_vocab or logits.shape[-1]], top_k)
      out += [ids.astype(jnp.int32), vals - lse[..., None]]
    if ax:  # ids past the vocabulary are clipped (a masked slot's are never read)
      out.append(jnp.take_along_axis(logits, ax[0], axis=-1, mode="clip") - lse[..., None])
    return tuple(out)

  def body(_, xs):
    return None, one(*xs)

  _, outs = jax.lax.scan(body, None, (to_chunks(h), to_chunks(targets), *map(to_chunks, extra)))
  outs = tuple(map(from_chunks, outs))
  return outs if len(outs) > 1 else outs[0]


def token_logprobs(params, cfg: ModelConfig, tokens: Int[Array, "B T"], *,
                   input_mask: Optional[Bool[Array, "B T"]] = None,
                   positions: Optional[Int[Array, "B T"]] = None,
                   temperature: float = 1.0, chunk: int = 256, with_entropy: bool = False, start: int = 0):
  """Log-prob of each next token: out[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]).

  Returns [B, T-1] (and entropies [B, T-1] when `with_entropy`). Position t of
  the output scores token t+1; mask it with input_mask[:, 1:]. start > 0: only
  positions t >= start are computed (the rest are 0), which skips the logits
  and the last layer's MLP of a prompt that is never scored (start = prompt
  length - 1 for an RL batch).
  """
  T = tokens.shape[1]
  if not 0 <= start < T - 1:
    raise ValueError(f"token_logprobs: start={start} must be in [0, {T - 1}) for {T} tokens")
  h, _ = transformer.hidden_states(params, cfg, tokens, input_mask=input_mask, positions=positions, start=start)
  out = logprobs_from_hidden(h[:, :-1], transformer.lm_head(params, cfg), tokens[:, start + 1:],
                             temperature=temperature, chunk=chunk, with_entropy=with_entropy)
  if not start:
    return out
  pad = lambda x: jnp.pad(x, ((0, 0), (start, 0)))
  return (pad(out[0]), pad(out[1])) if with_entropy else pad(out)
