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
                         temperature: float = 1.0, chunk: int = 256, with_entropy: bool = False):
  """log p(targets[b, t] | h[b, t]) for logits h @ w / temperature, chunked over T.

  Returns [B, T] log-probs (f32), and [B, T] entropies when `with_entropy`.
  """
  B, T, D = h.shape
  chunk = max(1, min(chunk, T))
  n = -(-T // chunk)
  pad = n * chunk - T
  if pad:
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  hc = h.reshape(B, n, chunk, D).swapaxes(0, 1)
  tc = targets.reshape(B, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one(hx, tx):
    logits = jnp.einsum("btd,dv->btv", hx, w, preferred_element_type=jnp.float32) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, tx[..., None], axis=-1)[..., 0]
    lp = tgt - lse
    if with_entropy:
      p = jnp.exp(logits - lse[..., None])
      ent = lse - jnp.sum(p * logits, axis=-1)
      return lp, ent
    return lp, jnp.zeros_like(lp)

  def body(_, xs):
    return None, one(*xs)

  _, (lp, ent) = jax.lax.scan(body, None, (hc, tc))
  lp = lp.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
  ent = ent.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
  return (lp, ent) if with_entropy else lp


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
