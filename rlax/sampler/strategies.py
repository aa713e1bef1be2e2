"""Sampling strategies: frozen dataclasses that turn logits into (token, behaviour log-prob).

Every strategy first *adjusts* the f32 logits (temperature, then top-k / top-p
masking with -inf), then draws from softmax(adjusted) by inverse CDF with one
uniform number per row. The returned log-prob is log_softmax(adjusted)[token],
i.e. the log-probability under exactly the distribution sampled from; this is
the behaviour policy the trainer's importance ratio divides by.

Inverse CDF instead of Gumbel-max: it needs one random number per row rather
than V, and a blocked cumulative sum (two tiny matmuls) rather than an argmax
over noisy logits; on CPU that is ~4x cheaper per decode step.

Greedy returns the argmax (lowest id among ties) and the log-prob of that token
under the temperature-1 softmax of the raw logits.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_BLOCK = 32


def first_argmax(x: Float[Array, "B V"]) -> Int[Array, "B"]:
  """argmax over the last axis (first index among ties), as two plain reductions (fast on CPU)."""
  m = jnp.max(x, axis=-1, keepdims=True)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1).astype(jnp.int32)


def log_softmax_at(adj: Float[Array, "B V"], tok: Int[Array, "B"]) -> Float[Array, "B"]:
  """log_softmax(adj)[b, tok[b]] without materializing the log-softmax."""
  lse = jax.nn.logsumexp(adj, axis=-1)
  return jnp.take_along_axis(adj, tok[:, None], axis=-1)[:, 0] - lse


def inverse_cdf(adj: Float[Array, "B V"], u: Float[Array, "B"]) -> Int[Array, "B"]:
  """Index i with cdf[i-1] < u * total <= cdf[i], for u in (0, 1]; never picks a -inf (zero-mass) entry."""
  B, V = adj.shape
  pad = -V % _BLOCK
  p = jnp.exp(adj - jnp.max(adj, axis=-1, keepdims=True))
  p = jnp.pad(p, ((0, 0), (0, pad)))
  nb = (V + pad) // _BLOCK
  tri = jnp.triu(jnp.ones((_BLOCK, _BLOCK), jnp.float32))
  inner = jnp.einsum("bnc,cd->bnd", p.reshape(B, nb, _BLOCK), tri,
                     precision=jax.lax.Precision.HIGHEST)
  blocks = inner[:, :, -1]
  tri_b = jnp.triu(jnp.ones((nb, nb), jnp.float32), k=1)
  offsets = jnp.einsum("bn,nm->bm", blocks, tri_b, precision=jax.lax.Precision.HIGHEST)
  cdf = (inner + offsets[:, :, None]).reshape(B, nb * _BLOCK)
  thr = u[:, None] * cdf[:, -1:]
  return jnp.minimum(jnp.sum(cdf < thr, axis=-1), V - 1).astype(jnp.int32)


class SamplingMethod(abc.ABC):
  """Base class: `adjust` logits, then `sample(logits [B, V], u [B]) -> (tokens [B], logprobs [B])`."""

  @abc.abstractmethod
  def adjust(self, logits: Float[Array, "B V"]) -> Float[Array, "B V"]:
    """The logits of the distribution actually sampled from (-inf where masked)."""

  def sample(self, logits: Float[Array, "B V"], u: Float[Array, "B"]):
    """Draws one token per row with uniform u in (0, 1]; returns (tokens int32 [B], logprobs f32 [B])."""
    adj = self.adjust(logits.astype(jnp.float32))
    tok = inverse_cdf(adj, u)
    return tok, log_softmax_at(adj, tok)


def _check_temperature(t: float):
  if not t > 0:
    raise ValueError(f"temperature must be > 0, got {t} (use Greedy() for argmax decoding)")


@dataclasses.dataclass(frozen=True)
class Greedy(SamplingMethod):
  """Argmax; log-prob is that of the temperature-1 softmax of the raw logits."""

  def adjust(self, logits):
    return logits.astype(jnp.float32)

  def sample(self, logits, u):
    adj = self.adjust(logits)
    tok = first_argmax(adj)
    return tok, log_softmax_at(adj, tok)


@dataclasses.dataclass(frozen=True)
class Temperature(SamplingMethod):
  """Samples from softmax(logits / temperature)."""
  temperature: float = 1.0

  def __post_init__(self):
    _check_temperature(self.temperature)

  def adjust(self, logits):
    return logits.astype(jnp.float32) / self.temperature


def _top_k_mask(adj, k):
  kth = jax.lax.top_k(adj, k)[0][:, -1:]
  return jnp.where(adj >= kth, adj, -jnp.inf)  # ties with the k-th value are all kept


@dataclasses.dataclass(frozen=True)
class TopK(SamplingMethod):
  """Keeps the k largest logits (plus ties with the k-th), then samples at `temperature`."""
  k: int
  temperature: float = 1.0

  def __post_init__(self):
    _check_temperature(self.temperature)
    if self.k < 1:
      raise ValueError(f"TopK.k must be >= 1, got {self.k}")

  def adjust(self, logits):
    adj = logits.astype(jnp.float32) / self.temperature
    return _top_k_mask(adj, min(self.k, adj.shape[-1]))


@dataclasses.dataclass(frozen=True)
class TopP(SamplingMethod):
  """Nucleus sampling at `temperature`, optionally after top-k (`k`).

  Keeps the smallest set of most-probable tokens whose mass reaches p: a token
  is kept when the mass of strictly more probable tokens (in sorted order) is
  below p; ties with the last kept logit are kept too.
  """
  p: float
  temperature: float = 1.0
  k: Optional[int] = None

  def __post_init__(self):
    _check_temperature(self.temperature)
    if not 0 < self.p <= 1:
      raise ValueError(f"TopP.p must be in (0, 1], got {self.p}")
    if self.k is not None and self.k < 1:
      raise ValueError(f"TopP.k must be >= 1 or None, got {self.k}")

  def adjust(self, logits):
    adj = logits.astype(jnp.float32) / self.temperature
    if self.k is not None:
      adj = _top_k_mask(adj, min(self.k, adj.shape[-1]))
    srt = -jnp.sort(-adj, axis=-1)
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(before < self.p, axis=-1, keepdims=True), 1)
    cut = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
    return jnp.where(adj >= cut, adj, -jnp.inf)
