"""One-token decode step over the rlax parameter tree, laid out for speed.

`models.forward(tok[B, 1], cache=...)` is exact but slow for decoding: it slices a
copy of each layer's cache every step, runs seven projections per layer and
attends every sample to its own copy of the prompt. This path applies the same
block (`rlax.models.layers.block`; tests compare it with `models.forward` without a
cache) with its own attention and cache layout:

- splits the cache into a *prompt* part stored once per distinct prompt (the G
  samples of a prompt share it: G-fold less attention traffic over the prompt)
  and a *generated* part per row, written in place by `dynamic_update_slice`
  inside the `while_loop` carry;
- stores the generated part as a few separate segments (`segments`); the
  decode loop for segment i reads segments 0..i only, so early tokens do not
  scan all max_new_tokens slots, and no window is ever sliced (copied);
- stores keys transposed ([.., Dh, S]) so both attention contractions are
  multiply-and-reduce over a non-minor axis, which XLA:CPU vectorizes along the
  contiguous one (~5x faster here than a batched dot_general of these shapes);
- fuses q/k/v and gate/up into one matmul each (`layers.fuse`, once per chunk,
  outside the loop).

Shapes: B = Pb * G rows (prompt-major), P prompt slots, N generated slots,
K kv heads, Gh = H / K query heads per kv head, Dh head dim.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rlax import models
from rlax.models import layers


@flax.struct.dataclass
class LayerCache:
  """Per-layer tuples. pk: [Pb, K, Dh, P], pv: [Pb, K, P, Dh] (per distinct prompt);
  gk[l][i]: [B, K, Dh, n_i], gv[l][i]: [B, K, n_i, Dh] (per row, segment i of the generated
  slots, see `segments`); prompt_valid: [Pb, P] (left-padded prompts)."""
  pk: tuple
  pv: tuple
  gk: tuple
  gv: tuple
  prompt_valid: jax.Array

  @property
  def samples(self) -> int:
    return self.gk[0][0].shape[0] // self.pk[0].shape[0]


def segments(n_new: int) -> tuple[tuple[int, int], ...]:
  """(start, end) of the generated-slot segments: up to 4, boundaries at multiples of 64.

  Segments shorter than 64 slots make XLA:CPU's reductions much slower (short
  minor axis), so short generations use one segment.
  """
  if n_new <= 128:
    return ((0, n_new),)
  ends = sorted({min(n_new, -(-(n_new * i // 4) // 64) * 64) for i in range(1, 5)})
  return tuple(zip([0] + ends[:-1], ends))


def doubling_segments(n_new: int) -> tuple[tuple[int, int], ...]:
  """Segments ending at 64, 128, 256, ... (the last one at least 64 long): for rows at different positions.

  The continuous engine attends every slot over the segments the furthest running row has reached; with
  long-tailed lengths most rows are short, so the first segments are kept short.
  """
  ends = [64]
  while ends[-1] < n_new:
    ends.append(ends[-1] * 2)
  ends[-1] = n_new
  if len(ends) > 1 and ends[-1] - ends[-2] < 64:
    ends.pop(-2)
  return tuple(zip([0] + ends[:-1], ends))


def _split(x, axis, segs):
  return tuple(jax.lax.slice_in_dim(x, a, b, axis=axis) for a, b in segs)


def from_model_cache(cache: models.KVCache, n_prompt_slots: int, samples: int, n_new: int,
                     prompt_rows: slice = slice(None), segs=None) -> LayerCache:
  """Builds a LayerCache from an `models.KVCache` [L, R, S, K, Dh] whose first `n_prompt_slots` slots are prompts.

  The prompt part is taken from rows `prompt_rows` (one per distinct prompt); the
  generated part is slots [P, S) padded to n_new per row, or zeros when R rows
  are distinct prompts to be repeated `samples` times. segs: the generated slots' segments
  (default `segments(n_new)`).
  """
  segs = segments(n_new) if segs is None else segs
  L, R, S, K, Dh = cache.k.shape
  P = n_prompt_slots
  pk = tuple(cache.k[l, prompt_rows, :P].transpose(0, 2, 3, 1) for l in range(L))
  pv = tuple(cache.v[l, prompt_rows, :P].transpose(0, 2, 1, 3) for l in range(L))
  if S > P:
    pad = ((0, 0), (0, 0), (0, n_new - (S - P)), (0, 0))
    gk = tuple(_split(jnp.pad(cache.k[l, :, P:].transpose(0, 2, 1, 3), pad).transpose(0, 1, 3, 2), 3, segs)
               for l in range(L))
    gv = tuple(_split(jnp.pad(cache.v[l, :, P:].transpose(0, 2, 1, 3), pad), 2, segs) for l in range(L))
  else:
    B = R * samples
    gk = tuple(tuple(jnp.zeros((B, K, Dh, b - a), cache.k.dtype) for a, b in segs) for _ in range(L))
    gv = tuple(tuple(jnp.zeros((B, K, b - a, Dh), cache.v.dtype) for a, b in segs) for _ in range(L))
  return LayerCache(pk=pk, pv=pv, gk=gk, gv=gv, prompt_valid=cache.valid[prompt_rows, :P])


def constrain_cache(cache: LayerCache) -> LayerCache:
  """Shards the cache along batch (and KV heads on the tensor axis) under the ambient mesh."""
  ax = ("batch", "act_kv_heads", None, None)
  c = lambda xs: jax.tree.map(lambda x: models.constrain(x, ax), xs)
  return LayerCache(pk=c(cache.pk), pv=c(cache.pv), gk=c(cache.gk), gv=c(cache.gv),
                    prompt_valid=models.constrain(cache.prompt_valid, ("batch", None)))


def fuse_params(params: models.Params, cfg: models.ModelConfig) -> dict[str, Any]:
  """Per-layer weights fused by `layers.fuse` (a list over layers), plus embed, final norm and lm head."""
  lay = params["layers"]
  return {"layers": [layers.fuse(cfg, jax.tree.map(lambda w: w[l], lay)) for l in range(cfg.n_layers)],
          "embed": params["embed"], "final_norm": params["final_norm"].astype(cfg.jnp_dtype),
          "lm_head": models.lm_head(params, cfg)}


def _attend(q, pk, pv, gks, gvs, prompt_valid, last):
  """q [B, K, Gh, Dh] over the shared prompt and the generated segments gks/gvs.

  All segments but the last are full; in the last, slots <= `last` are valid
  (the current token was just written there).
  """
  B, K, Gh, Dh = q.shape
  Pb = pk.shape[0]
  G = B // Pb
  f32 = jnp.float32
  qf = q.astype(f32) / math.sqrt(Dh)
  qp = qf.reshape(Pb, G, K, Gh, Dh)
  sp = jnp.sum(qp[..., None] * pk.astype(f32)[:, None, :, None], axis=4)  # [Pb, G, K, Gh, P]
  scores = [jnp.where(prompt_valid[:, None, None, None, :], sp, layers.NEG).reshape(B, K, Gh, -1)]
  for i, gk in enumerate(gks):
    sg = jnp.sum(qf[..., None] * gk.astype(f32)[:, :, None], axis=3)  # [B, K, Gh, n_i]
    if i == len(gks) - 1:
      sg = jnp.where(jnp.arange(gk.shape[-1]) <= last, sg, layers.NEG)
    scores.append(sg)
  p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(pv.dtype)
  P = sp.shape[-1]
  pp = p[..., :P].reshape(Pb, G, K, Gh, P)
  out = jnp.sum(pp[..., None] * pv[:, None, :, None], axis=4).reshape(B, K, Gh, Dh)
  return add_segment_values(out, p, gvs, P)


def add_segment_values(out, p, gvs, off: int):
  """out [B, K, Gh, Dh] + the generated segments' values gvs weighted by p[..., off:] (segment after segment)."""
  for gv in gvs:
    n = gv.shape[2]
    out = out + jnp.sum(p[..., off:off + n, None] * gv[:, :, None], axis=3)
    off += n
  return out


def decode_step(fused: dict, cfg: models.ModelConfig, cache: LayerCache, tok: Int[Array, "B"],
                pos: Int[Array, "B"], gslot: Int[Array, ""], seg: int
                ) -> tuple[Float[Array, "B V"], LayerCache]:
  """Feeds one token per row, written at generated slot `gslot` (inside segment `seg`), RoPE position `pos`.

  Returns f32 logits [B, V] for the next token and the updated cache.
  """
  B = tok.shape[0]
  H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  dt = cfg.jnp_dtype
  inv_freq = layers.rope_inv_freq(cfg)
  start = segments(sum(g.shape[-1] for g in cache.gk[0]))[seg][0]
  x = jnp.take(fused["embed"], tok, axis=0).astype(dt)[:, None]  # [B, 1, D]
  gks, gvs = [list(g) for g in cache.gk], [list(g) for g in cache.gv]
  z = jnp.zeros((), jnp.int32)
  local = gslot - start
  for l, w in enumerate(fused["layers"]):

    def attend(q, k, v, l=l):
      # Write first, then attend over the updated buffers: reading the old buffer
      # alongside an in-place write makes XLA copy the whole cache every step.
      gks[l][seg] = jax.lax.dynamic_update_slice(gks[l][seg], k.reshape(B, K, Dh, 1).astype(dt), (z, z, z, local))
      gvs[l][seg] = jax.lax.dynamic_update_slice(gvs[l][seg], v.reshape(B, K, 1, Dh).astype(dt), (z, z, local, z))
      a = _attend(q.reshape(B, K, H // K, Dh), cache.pk[l], cache.pv[l], gks[l][:seg + 1], gvs[l][:seg + 1],
                  cache.prompt_valid, local)
      return a.astype(dt).reshape(B, 1, H, Dh)

    x = layers.block(cfg, w, x, pos[:, None], inv_freq, attend)
  x = layers.rms_norm(x[:, 0], fused["final_norm"], cfg.norm_eps)
  logits = jnp.dot(x, fused["lm_head"], preferred_element_type=jnp.float32)
  return logits, cache.replace(gk=tuple(map(tuple, gks)), gv=tuple(map(tuple, gvs)))
