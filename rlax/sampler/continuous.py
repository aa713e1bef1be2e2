"""Continuous batching: a fixed number of decode slots; a finished row's slot takes the next queued request.

    sampler = ContinuousSampler(cfg, mesh, max_prompt_len=512, max_new_tokens=1024, slots=64, eos_id=2)
    sampler.update_weights(params, version=0)
    out = sampler.generate(prompts, samples_per_prompt=8, seed=0, step=3, max_new_tokens=limits)

The static engine (`rlax.sampler.engine.Sampler`) decodes a batch until its longest row stops; with
long-tailed lengths most of that work is padding. Here every slot holds one request (prompt, sample
index) with its own position and limit. Between decode chunks, finished rows are copied out and whole
groups of queued requests take the free slots: the G samples of a prompt share one prefill, whose keys
and values are copied into their G slots. Shapes are static (slots, prompt length, new-token budget, the
admission bucket), so nothing recompiles in steady state (`trace_counts`).

Token t of a row is drawn with the uniform of fold_in(row_key, t), the row key deriving from (seed, step,
prompt id, sample index) exactly as in the static engine, so both engines sample the same tokens from the
same weights (up to floating-point ties). A weight swap between chunks is recorded per token in
`versions`; `on_swap="recompute"` recomputes the unfinished rows' keys and values under the new weights
(tokens drawn under version v come from exactly the policy v), `"keep"` continues over the old cache.

Cache layout per layer: the prompt part [S, K, Dh, P] / [S, K, P, Dh] and the generated part split into
segments ending at 64, 128, 256, ... (`decode.doubling_segments`); a decode step writes each slot's new
key and value at its own position with a scatter. Every slot attends over the prompt and the first
segment; a later segment only for the rows that have reached it, in blocks of rows (`_attend`), so a
step costs what the rows' own lengths need, not the longest row's. When nothing is queued, the running
rows move to a smaller slot bucket (`Stream._resize`).

`attention="paged"` (the default on TPU when `paged.kernel_supports(cfg)`) keeps the keys and values in a
`paged.PagedKVCache` instead (slot s owning its own pages; a row's tokens at positions 0..n-1 whatever its
prompt padding) and decodes with `paged.decode_step`, i.e. on TPU jax's Pallas `paged_attention` kernel over
each slot's own length, under `lax.scan` over layers when `cfg.scan_layers`. Admission writes the prefill's
keys/values into the slot's pages, `recompute` rewrites them; sampling and recording are the same code, so
both layouts draw the same tokens. The paged path does not shrink to fewer slots.

`stream()` opens a session for the rollout producer: prompt groups are submitted at any time and come
back from `Stream.step()` as soon as all their samples have finished; `generate` is one such session.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from typing import Callable, Optional, Sequence, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rlax import models
from rlax.models import layers
from rlax.models import sharding as shd
from rlax.sampler import decode, loop, paged
from rlax.sampler import engine as engine_lib
from rlax.sampler.engine import SampleOutput, Sampler, _pow2_buckets, concat_outputs
from rlax.sampler.strategies import SamplingMethod, Temperature


@flax.struct.dataclass
class SlotState:
  """S slots, P prompt positions, N new-token budget (see the module docstring for the cache layout).

  tokens / logprobs / versions [S, N] (pad / 0 / -1 past a row's end); t [S] tokens drawn so far;
  limit [S] the request's max new tokens; done [S] (free slots are done); last [S] the token fed next;
  work [] slot-steps that decoded a running row; steps [] decode steps run (utilization).
  kv: the paged KV cache on the paged path (`ContinuousSampler(attention="paged")`); pk / pv / gk / gv are
  then empty. Its lengths[s] is the position of the token slot s feeds next, n_prompt + t - 1.
  """
  pk: tuple
  pv: tuple
  gk: tuple
  gv: tuple
  prompt: jax.Array
  prompt_valid: jax.Array
  n_prompt: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  versions: jax.Array
  t: jax.Array
  limit: jax.Array
  done: jax.Array
  reason: jax.Array
  last: jax.Array
  keys: jax.Array
  work: jax.Array
  steps: jax.Array
  kv: Optional[paged.PagedKVCache] = None


def _record(st: SlotState, live, tok, lp, version, eos_ids, stops, pad_id) -> SlotState:
  """Writes token t[s] of every running slot s and updates done / reason / t."""
  S, N = st.tokens.shape
  rows = jnp.arange(S)
  t = st.t
  tok = jnp.where(live, tok, pad_id).astype(jnp.int32)
  at = jnp.where(live, t, N)  # out of range: dropped
  tokens = st.tokens.at[rows, at].set(tok, mode="drop")
  logprobs = st.logprobs.at[rows, at].set(lp.astype(jnp.float32), mode="drop")
  versions = st.versions.at[rows, at].set(jnp.broadcast_to(version, (S,)).astype(jnp.int32), mode="drop")
  is_eos, is_stop = loop.ends(tok, tokens, t, eos_ids, stops)
  finished = live & (is_eos | is_stop | (t + 1 >= st.limit))
  reason = jnp.where(live & is_eos, loop.EOS, jnp.where(live & is_stop, loop.STOP, st.reason))
  return st.replace(tokens=tokens, logprobs=logprobs, versions=versions, done=st.done | finished,
                    reason=reason.astype(jnp.int32), t=jnp.where(live, t + 1, t),
                    last=jnp.where(live, tok, st.last))


ATTENTION = ("auto", "dense", "paged", "paged_interpret")  # ContinuousSampler(attention=...)

BLOCK = 8  # rows per block of the ragged attention over the later segments


def _partial(qf, k, v, ok):
  """Attention of qf [R, K, Gh, Dh] (scaled, f32) over k [R, K, Dh, n] / v [R, K, n, Dh] where ok [R, n],
  unnormalized: (running max m [R, K, Gh], sum l [R, K, Gh], weighted values o [R, K, Gh, Dh]); a row with
  nothing valid gives l = 0, o = 0."""
  s = jnp.sum(qf[..., None] * k.astype(jnp.float32)[:, :, None], axis=3)  # [R, K, Gh, n]
  ok = ok[:, None, None, :]
  m = jnp.max(jnp.where(ok, s, layers.NEG), axis=-1)
  p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
  return m, jnp.sum(p, axis=-1), jnp.sum(p.astype(v.dtype)[..., None] * v[:, :, None], axis=3).astype(jnp.float32)


def _merge(a, b):
  """Two partial attentions of the same rows over disjoint keys → one (log-sum-exp rescaling)."""
  m = jnp.maximum(a[0], b[0])
  ca, cb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
  return m, a[1] * ca + b[1] * cb, a[2] * ca[..., None] + b[2] * cb[..., None]


def _attend(q, pk, pv, gks, gvs, prompt_valid, g, live, starts):
  """q [S, K, Gh, Dh] over the slot's prompt and generated segments; generated slots <= g[s] are valid.

  The prompt and the first segment are attended densely by every slot. A later segment is attended only
  by the rows that have reached it: rows are taken furthest-first in blocks of BLOCK, for as many blocks
  as needed (a while loop), so the cost follows the rows' own lengths, not the longest row's. With
  long-tailed lengths most rows never leave the first segment.
  """
  S, K, Gh, Dh = q.shape
  qf = q.astype(jnp.float32) / math.sqrt(Dh)
  out = _partial(qf, pk, pv, prompt_valid)
  out = _merge(out, _partial(qf, gks[0], gvs[0], (starts[0] + jnp.arange(gks[0].shape[-1]))[None] <= g[:, None]))
  if len(gks) > 1:
    blk = min(BLOCK, S)
    order = jnp.argsort(jnp.where(live, -g, 1))  # furthest rows first; free slots last
    order = jnp.concatenate([order, order[:(-S) % blk]])  # whole blocks
    for gk, gv, a in zip(gks[1:], gvs[1:], starts[1:]):
      n = jnp.sum(live & (g >= a))

      def block(b, acc, gk=gk, gv=gv, a=a):
        rows = jax.lax.dynamic_slice_in_dim(order, b * blk, blk)
        ok = (a + jnp.arange(gk.shape[-1]))[None] <= g[rows][:, None]
        part = _partial(qf[rows], gk[rows], gv[rows], ok)
        return tuple(x.at[rows].set(y) for x, y in zip(acc, part))

      init = (jnp.full((S, K, Gh), layers.NEG, jnp.float32), jnp.zeros((S, K, Gh), jnp.float32),
              jnp.zeros((S, K, Gh, Dh), jnp.float32))
      out = _merge(out, jax.lax.fori_loop(0, (n + blk - 1) // blk, block, init))
  m, l, o = out
  return o / jnp.maximum(l, 1e-30)[..., None]


def _decode_step(fused, cfg: models.ModelConfig, st: SlotState, live, n_seg: int):
  """Feeds every slot's last token (written at its own generated slot t-1); attends over segments < n_seg."""
  S = st.last.shape[0]
  H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  dt = cfg.jnp_dtype
  N = st.tokens.shape[1]
  segs = decode.doubling_segments(N)
  starts = [a for a, _ in segs]
  g = st.t - 1
  pos = st.n_prompt + g
  rows = jnp.arange(S)
  x = jnp.take(fused["embed"], st.last, axis=0).astype(dt)[:, None]
  gks, gvs = [list(seg) for seg in st.gk], [list(seg) for seg in st.gv]
  inv_freq = layers.rope_inv_freq(cfg)
  for l, w in enumerate(fused["layers"]):

    def attend(q, k, v, l=l):
      k = k.reshape(S, K, Dh).astype(dt)
      v = v.reshape(S, K, Dh).astype(dt)
      for i, (a, b) in enumerate(segs[:n_seg]):
        at = jnp.where(live & (g >= a) & (g < b), g - a, b - a)  # other segments' rows: dropped
        gks[l][i] = gks[l][i].at[rows, :, :, at].set(k, mode="drop")
        gvs[l][i] = gvs[l][i].at[rows, :, at, :].set(v, mode="drop")
      o = _attend(q.reshape(S, K, H // K, Dh), st.pk[l], st.pv[l], gks[l][:n_seg], gvs[l][:n_seg],
                  st.prompt_valid, g, live, starts[:n_seg])
      return o.astype(dt).reshape(S, 1, H, Dh)

    x = layers.block(cfg, w, x, pos[:, None], inv_freq, attend)
  x = layers.rms_norm(x[:, 0], fused["final_norm"], cfg.norm_eps)
  logits = jnp.dot(x, fused["lm_head"], preferred_element_type=jnp.float32)
  return logits, st.replace(gk=tuple(map(tuple, gks)), gv=tuple(map(tuple, gvs)))


def decode_steps(params, cfg: models.ModelConfig, st: SlotState, version, n_steps, *, strategy: SamplingMethod,
                 eos_ids, stops, pad_id: int, attention: str = "auto") -> SlotState:
  """Up to `n_steps` decode steps over all slots, stopping early once no slot is running.

  Dense cache: one `while_loop` per generated segment: loop i runs while every running row's next write lands
  in segments 0..i, so short rows never pay for attention over slots nobody has reached. Paged cache (st.kv):
  one `while_loop` of `paged.decode_step` (`attention` is its attention mode), whose per-slot lengths already
  bound each row's attention.
  """
  if st.kv is not None:
    return _paged_decode_steps(params, cfg, st, version, n_steps, strategy=strategy, eos_ids=eos_ids,
                               stops=stops, pad_id=pad_id, attention=attention)
  fused = decode.fuse_params(params, cfg)
  segs = decode.doubling_segments(st.tokens.shape[1])
  end_step = st.steps + n_steps
  for i, (_, end) in enumerate(segs):

    def cond(st, end=end):
      live = ~st.done
      reach = jnp.max(jnp.where(live, st.t - 1, -1))
      return (st.steps < end_step) & jnp.any(live) & (reach < end)

    def body(st, i=i):
      live = ~st.done
      logits, st = _decode_step(fused, cfg, st, live, i + 1)
      tok, lp = strategy.sample(logits, loop.uniforms(st.keys, st.t))
      st = _record(st, live, tok, lp, version, eos_ids, stops, pad_id)
      return st.replace(work=st.work + jnp.sum(live).astype(jnp.int32), steps=st.steps + 1)

    st = jax.lax.while_loop(cond, body, st)
  return st


def _paged_decode_steps(params, cfg: models.ModelConfig, st: SlotState, version, n_steps, *,
                       strategy: SamplingMethod, eos_ids, stops, pad_id: int, attention: str) -> SlotState:
  fused = paged.fuse_layers(params, cfg)
  end_step = st.steps + n_steps

  def cond(st):
    return (st.steps < end_step) & jnp.any(~st.done)

  def body(st):
    live = ~st.done
    # Feeds each running row's last token at position kv.lengths = n_prompt + t - 1; finished and free
    # slots are inactive (write nothing, keep their length).
    logits, kv = paged.decode_step(fused, cfg, st.kv, st.last, live, attention=attention)
    st = st.replace(kv=kv)
    tok, lp = strategy.sample(logits, loop.uniforms(st.keys, st.t))
    st = _record(st, live, tok, lp, version, eos_ids, stops, pad_id)
    return st.replace(work=st.work + jnp.sum(live).astype(jnp.int32), steps=st.steps + 1)

  return jax.lax.while_loop(cond, body, st)


def _compact(x, mask):
  """x [L, B, T, ...] with the valid (mask [B, T]) positions moved to the front, in order: the paged cache holds
  a row's tokens at their positions 0..n-1, wherever the padding sat in the dense sequence."""
  order = jnp.argsort(~mask, axis=1, stable=True)
  return jnp.take_along_axis(x, order.reshape((1,) + order.shape + (1,) * (x.ndim - 3)), axis=2)


def prefill(params, cfg: models.ModelConfig, prompt, prompt_mask):
  """Distinct prompts [Q, P] → (keys, values [L, Q, P, K, Dh], next-token logits [Q, V])."""
  Q, P = prompt.shape
  h, mc = models.hidden_states(params, cfg, prompt, input_mask=prompt_mask, cache=models.init_cache(cfg, Q, P))
  return mc.k, mc.v, models.logits_from_hidden(params, cfg, h[:, -1:])[:, 0]


def admit(st: SlotState, k, v, logits, prompt, prompt_mask, slot_ids, which, keys, limits, version, *,
          strategy: SamplingMethod, eos_ids, stops, pad_id: int) -> SlotState:
  """Puts request a (prompt `which[a]` of the prefill) into slot `slot_ids[a]` and draws its token 0.

  Slot ids >= S are padding (dropped). The generated cache is not cleared: slots past a row's t are
  masked, and every slot is written before it is read.
  """
  S, N = st.tokens.shape
  L = k.shape[0]
  sid = slot_ids
  put = lambda x, y: x.at[sid].set(y, mode="drop")
  n_prompt = jnp.sum(prompt_mask[which], axis=1).astype(jnp.int32)
  if st.kv is not None:  # the prompt's keys/values become tokens 0..n_prompt-1 of the slot's pages
    kv = paged.write_prefix(st.kv, sid, _compact(k, prompt_mask)[:, which], _compact(v, prompt_mask)[:, which],
                            n_prompt)
    st = st.replace(kv=kv)
  else:
    st = st.replace(pk=tuple(put(st.pk[l], k[l][which].transpose(0, 2, 3, 1)) for l in range(L)),
                    pv=tuple(put(st.pv[l], v[l][which].transpose(0, 2, 1, 3)) for l in range(L)))
  A = sid.shape[0]
  new = st.replace(
      prompt=put(st.prompt, prompt[which]), prompt_valid=put(st.prompt_valid, prompt_mask[which]),
      n_prompt=put(st.n_prompt, n_prompt),
      tokens=put(st.tokens, jnp.full((A, N), pad_id, jnp.int32)),
      logprobs=put(st.logprobs, jnp.zeros((A, N), jnp.float32)),
      versions=put(st.versions, jnp.full((A, N), -1, jnp.int32)),
      t=put(st.t, jnp.zeros((A,), jnp.int32)), limit=put(st.limit, limits.astype(jnp.int32)),
      done=put(st.done, jnp.zeros((A,), bool)), reason=put(st.reason, jnp.full((A,), loop.LENGTH, jnp.int32)),
      keys=put(st.keys, keys))
  # Token 0 of the admitted rows, from their prompt's prefill logits.
  fresh = jnp.zeros((S,), bool).at[sid].set(True, mode="drop")
  row_logits = jnp.zeros((S, logits.shape[-1]), logits.dtype).at[sid].set(logits[which], mode="drop")
  tok, lp = strategy.sample(row_logits, loop.uniforms(new.keys, new.t))
  return _record(new, fresh, tok, lp, version, eos_ids, stops, pad_id)


def recompute(params, cfg: models.ModelConfig, st: SlotState) -> SlotState:
  """Recomputes every slot's keys and values (prompt + tokens so far) under `params`, after a weight swap."""
  S, P = st.prompt.shape
  N = st.tokens.shape[1]
  seq = jnp.concatenate([st.prompt, st.tokens], axis=1)
  in_cache = jnp.arange(N)[None] < (st.t - 1)[:, None]  # the last token is fed by the next step
  mask = jnp.concatenate([st.prompt_valid, in_cache], axis=1)
  _, mc = models.hidden_states(params, cfg, seq, input_mask=mask, cache=models.init_cache(cfg, S, P + N))
  if st.kv is not None:  # lengths (n_prompt + t - 1 for running rows) are unchanged
    return st.replace(kv=paged.write_prefix(st.kv, jnp.arange(S), _compact(mc.k, mask), _compact(mc.v, mask),
                                            st.kv.lengths))
  new = decode.from_model_cache(mc, P, 1, N, segs=decode.doubling_segments(N))
  return st.replace(pk=new.pk, pv=new.pv, gk=new.gk, gv=new.gv)


def _free_bytes(devices) -> int:
  """Free memory per device: the allocator's limit minus what is in use, else the host's RAM per local device."""
  stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  return engine_lib._detect_budget(devices)  # pylint: disable=protected-access


class ContinuousSampler:
  """Continuous-batching generation over one (sub)mesh; see the module docstring.

  slots: rows decoded at once (a multiple of the largest samples_per_prompt used, and of the mesh's
  row shards). decode_chunk: decode steps between admissions (and weight swaps). on_swap: "recompute"
  or "keep" (the unfinished rows' cache after a weight swap). shrink: once no request waits, decode the
  running rows on fewer slots (`Stream._resize`).

  attention: where the keys/values live and how a decode step attends over them.
    "dense": the per-slot dense cache and XLA:CPU-shaped attention of this module (`_attend`).
    "paged": a `paged.PagedKVCache` (slot s owns pages s*n .. s*n+n-1 of its shard: the static contiguous
      page table) decoded by `paged.decode_step` with its own "auto" attention: the Pallas TPU
      `paged_attention` kernel on TPU when `paged.kernel_supports(cfg)`, else the jnp reference.
    "paged_interpret": the paged path with the Pallas kernel in interpret mode (runs on CPU; for tests).
    "auto": "paged" on a TPU backend when `paged.kernel_supports(cfg)`, else "dense".
  The paged path does not shrink (`shrink` is ignored): its pool is not laid out by slot, so moving a row to
  another slot means remapping its pages (across shards under a mesh); and there an idle slot costs the
  kernel one page, not a dense block. page_size: tokens per page on the paged path.
  """

  def __init__(self, cfg: models.ModelConfig, mesh: Optional[Mesh] = None, *, max_prompt_len: int,
               max_new_tokens: int, slots: int, stop_sequences: Sequence[Sequence[int]] = (),
               eos_id: Union[int, Sequence[int], None] = None, pad_id: int = 0, decode_chunk: int = 16,
               on_swap: str = "recompute", shrink: bool = True, memory_budget_bytes: Optional[int] = None,
               params: Optional[models.Params] = None, version: int = 0, attention: str = "auto",
               page_size: int = 128):
    if attention not in ATTENTION:
      raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    if attention == "auto":
      attention = "paged" if jax.default_backend() == "tpu" and paged.kernel_supports(cfg) else "dense"
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    if on_swap not in ("recompute", "keep"):
      raise ValueError(f"on_swap must be 'recompute' or 'keep', got {on_swap!r}")
    if decode_chunk < 1:
      raise ValueError(f"decode_chunk must be >= 1, got {decode_chunk}")
    # The static engine checks shapes, memory and weights the same way: reuse it for those.
    self._static = Sampler(cfg, mesh, max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens,
                           batch_size=slots, prompt_buckets=(max_prompt_len,), stop_sequences=stop_sequences,
                           eos_id=eos_id, pad_id=pad_id, decode_chunk=decode_chunk,
                           memory_budget_bytes=memory_budget_bytes)
    shards = shd.row_shards(mesh, slots) if mesh is not None else 1
    if slots % shards:
      raise ValueError(f"slots={slots} must be a multiple of the mesh's {shards} row shards")
    self.cfg, self.mesh, self.slots = cfg, mesh, slots
    self.max_prompt_len, self.max_new_tokens, self.pad_id = max_prompt_len, max_new_tokens, pad_id
    self.attention, self.page_size = attention, page_size
    self.paged = attention != "dense"
    self.decode_chunk, self.on_swap, self.shrink = decode_chunk, on_swap, shrink and not self.paged
    self.eos_ids, self.stops = self._static.eos_ids, self._static.stops
    self.memory = self._static.memory
    self.trace_counts = collections.Counter()
    self.last_timings: dict = {}
    statics = dict(eos_ids=self.eos_ids, stops=self.stops, pad_id=pad_id)
    with_cfg = lambda fn: lambda params, *rest, **kw: fn(params, cfg, *rest, **kw)
    self._prefill = jax.jit(self._traced("prefill", with_cfg(prefill)))
    self._admit = jax.jit(self._traced("admit", admit, **statics), static_argnames=("strategy",),
                          donate_argnums=(0,))
    self._chunk = jax.jit(self._traced("decode", with_cfg(decode_steps), **statics,
                                       attention="interpret" if attention == "paged_interpret" else "auto"),
                          static_argnames=("strategy",), donate_argnums=(1,))
    self._recompute = jax.jit(self._traced("recompute", with_cfg(recompute)), donate_argnums=(1,))
    self._gather = jax.jit(self._traced("shrink", lambda st, idx: jax.tree.map(lambda x: x[idx] if x.ndim else x, st)))
    self._cancel = jax.jit(self._traced("cancel", lambda st, mask: st.replace(done=st.done | mask)),
                           donate_argnums=(0,))
    self._grow = jax.jit(self._traced("grow", lambda big, st: jax.tree.map(
        lambda a, b: a.at[:b.shape[0]].set(b) if a.ndim else b, big, st)), donate_argnums=(0,))
    # Slot buckets for the tail: slots, slots/2, slots/4, slots/8 (a decode program each; below that the step's
    # fixed cost, reading every weight, dominates).
    self._buckets = [b for b in (slots >> i for i in range(4)) if b and b % shards == 0][::-1]
    self._empty_fn = None
    if params is not None:
      self.update_weights(params, version)

  def _traced(self, name, fn, **statics):
    """fn(*args, **statics, **kw), counting traces (i.e. compiles) in trace_counts[name]."""
    def call(*args, **kw):
      self.trace_counts[name] += 1  # runs at trace time only
      return fn(*args, **statics, **kw)
    return call

  @staticmethod
  def slots_that_fit(cfg: models.ModelConfig, mesh: Optional[Mesh] = None, *, max_prompt_len: int,
                     max_new_tokens: int, unit: int, cap: int, memory_budget_bytes: Optional[int] = None) -> int:
    """The most slots (a multiple of `unit`, at most `cap`) whose KV cache, recompute transient and weights fit
    the per-device budget (default: the device's free memory; on CPU the host's RAM over the local devices).

    Raises one ValueError naming the sizes when not even `unit` slots (one whole group) fit.
    """
    probe = Sampler(cfg, mesh, max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens, batch_size=unit,
                    prompt_buckets=(max_prompt_len,), decode_chunk=1, memory_budget_bytes=1 << 62)
    per_unit = probe.memory["cache"] + probe.memory["transient"]  # both scale with the slots
    budget = memory_budget_bytes if memory_budget_bytes is not None else _free_bytes(probe.devices)
    n = (budget - probe.memory["params"]) // max(1, per_unit)
    if n < 1:
      raise ValueError(
          f"sampler: one group of {unit} slots x {max_prompt_len + max_new_tokens} tokens needs "
          f"{per_unit + probe.memory['params']:,} bytes per device (KV cache and recompute {per_unit:,}, params "
          f"{probe.memory['params']:,}) but {budget:,} are free; shorten rollout.max_new_tokens or add devices")
    return int(min(n * unit, max(unit, cap // unit * unit)))

  def update_weights(self, params: models.Params, version: int) -> None:
    """Installs new weights (validated and cast like the static engine). Thread-safe."""
    self._static.update_weights(params, version)

  @property
  def version(self) -> Optional[int]:
    return self._static.version

  @property
  def _weights(self):
    """(params, version) as installed, read in one go (the static engine's slot)."""
    return self._static._weights  # pylint: disable=protected-access

  def _ctx(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _empty(self) -> SlotState:
    """A state with every slot free, built by one compiled call rather than ~30 dispatches (with a 1024-token
    budget: 149 ms against 193 ms, mostly filling the cache with zeros)."""
    if self._empty_fn is None:
      build = self._build_empty
      if self.mesh is None:
        self._empty_fn = jax.jit(build)
      else:
        self._empty_fn = jax.jit(build, out_shardings=self._shardings(jax.eval_shape(build)))
    with self._ctx():
      return self._empty_fn()

  def _build_empty(self) -> SlotState:
    cfg, S, P, N = self.cfg, self.slots, self.max_prompt_len, self.max_new_tokens
    K, Dh, dt = cfg.n_kv_heads, cfg.head_dim, cfg.jnp_dtype
    segs = decode.doubling_segments(N)
    z = lambda shape, dtype: jnp.zeros(shape, dtype)
    if self.paged:
      # Room for the prompt and every new token; page ids local to the slot's shard, as decode_step reads them.
      n = paged.pages_per_slot(P + N, self.page_size)
      table = paged.contiguous_page_table(S, n, paged.slot_shards(self.mesh, S, K))
      dense = dict(pk=(), pv=(), gk=(), gv=(), kv=paged.init_cache(cfg, S, P + N, self.page_size, page_table=table))
    else:
      dense = dict(pk=tuple(z((S, K, Dh, P), dt) for _ in range(cfg.n_layers)),
                   pv=tuple(z((S, K, P, Dh), dt) for _ in range(cfg.n_layers)),
                   gk=tuple(tuple(z((S, K, Dh, b - a), dt) for a, b in segs) for _ in range(cfg.n_layers)),
                   gv=tuple(tuple(z((S, K, b - a, Dh), dt) for a, b in segs) for _ in range(cfg.n_layers)))
    st = SlotState(
        **dense,
        prompt=z((S, P), jnp.int32), prompt_valid=z((S, P), bool), n_prompt=z((S,), jnp.int32),
        tokens=jnp.full((S, N), self.pad_id, jnp.int32), logprobs=z((S, N), jnp.float32),
        versions=jnp.full((S, N), -1, jnp.int32), t=z((S,), jnp.int32), limit=z((S,), jnp.int32),
        done=jnp.ones((S,), bool), reason=z((S,), jnp.int32), last=z((S,), jnp.int32),
        keys=jax.random.split(jax.random.key(0), S), work=z((), jnp.int32), steps=z((), jnp.int32))
    return st

  def _shardings(self, st: SlotState) -> SlotState:
    """Slot rows split over the mesh's row shards (scalars replicated); the paged pools over (KV heads,
    pages), their page table and lengths over slots."""
    S = st.t.shape[0]
    sh = jax.tree.map(lambda x: shd.batch_sharding(self.mesh, S, x.ndim) if x.ndim else
                      NamedSharding(self.mesh, jax.sharding.PartitionSpec()), st.replace(kv=None))
    return sh.replace(kv=None if st.kv is None else paged.cache_shardings(self.cfg, self.mesh, S))

  def _placed(self, st: SlotState) -> SlotState:
    """`st` on the engine's shardings (see `_shardings`)."""
    if self.mesh is None:
      return st
    return jax.device_put(st, self._shardings(st))

  def stream(self, strategy: SamplingMethod = Temperature(1.0), *,
             on_chunk: Optional[Callable[[int, int], None]] = None) -> "Stream":
    """An open session: `submit` groups at any time, `step` decodes and returns the groups that finished."""
    if self.version is None:
      raise ValueError("generate: no weights; call update_weights(params, version) first")
    return Stream(self, strategy, on_chunk)

  def generate(self, prompts, *, samples_per_prompt: int = 1, strategy: SamplingMethod = Temperature(1.0),
               seed: int = 0, step: int = 0, prompt_ids: Optional[Sequence[int]] = None, prompt_mask=None,
               max_new_tokens: Union[int, Sequence[int], None] = None,
               on_chunk: Optional[Callable[[int, int], None]] = None) -> SampleOutput:
    """Same contract as `Sampler.generate`, plus per-request limits.

    max_new_tokens: None (the engine's budget), an int, or one limit per row (prompt-major, n × G).
    on_chunk(chunk_index, tokens_of_finished_rows) runs before each decode chunk.
    """
    stream = self.stream(strategy, on_chunk=on_chunk)
    n = len(stream.submit(prompts, samples_per_prompt=samples_per_prompt, seed=seed, step=step,
                          prompt_ids=prompt_ids, prompt_mask=prompt_mask, max_new_tokens=max_new_tokens))
    done = {}
    while stream.pending:
      done.update((g.tag, g.out) for g in stream.step())
    self.last_timings = stream.timings()
    return jax.tree.map(jnp.asarray, concat_outputs([done[i] for i in range(n)]))


@dataclasses.dataclass
class FinishedGroup:
  """The G samples of one submitted prompt, all finished: `out` a host SampleOutput of G rows; `tag`
  what `submit` was given for it."""
  tag: object
  out: SampleOutput


@dataclasses.dataclass
class _Group:
  tag: object
  prompt: np.ndarray  # [P] left-padded
  valid: np.ndarray
  prompt_id: int
  keys: np.ndarray    # [G] key data
  limits: np.ndarray  # [G]
  tokens: np.ndarray = None
  logprobs: np.ndarray = None
  versions: np.ndarray = None
  lengths: np.ndarray = None
  reason: np.ndarray = None
  left: int = 0       # samples not finished
  admitted: int = -1  # the weight version its first tokens were drawn with

  @property
  def samples(self) -> int:
    return len(self.limits)


class Stream:
  """Continuous batching as a session: groups are submitted, decoded on the engine's slots as they free up,
  and returned by `step` as soon as all G samples of a group have finished.

  One thread drives a stream (`submit` / `step`); weights may be installed on the engine from any thread
  and take effect at the next step (per-token versions record which weights drew each token).
  """

  def __init__(self, engine: ContinuousSampler, strategy: SamplingMethod,
               on_chunk: Optional[Callable[[int, int], None]] = None):
    self.e, self.strategy, self.on_chunk = engine, strategy, on_chunk
    self.queue: collections.deque[_Group] = collections.deque()
    self.owner = np.full(engine.slots, -1)  # slot → index into self._rows (-1: free)
    self._rows: dict[int, tuple[_Group, int]] = {}
    self._next_row = 0
    self.running = 0  # groups admitted, not finished
    self.st: Optional[SlotState] = None
    _, self.version = engine._weights  # pylint: disable=protected-access
    self.chunks = self.swaps = self.steps = self.slot_steps = self.finished_tokens = 0
    self.t0 = time.perf_counter()

  @property
  def pending(self) -> int:
    """Groups submitted and not yet returned (queued or decoding)."""
    return len(self.queue) + self.running

  @property
  def queued(self) -> int:
    return len(self.queue)

  def submit(self, prompts, *, samples_per_prompt: int = 1, seed: int = 0, step: int = 0,
             prompt_ids: Optional[Sequence[int]] = None, prompt_mask=None,
             max_new_tokens: Union[int, Sequence[int], None] = None, tags: Optional[Sequence] = None) -> list:
    """Queues n prompts x G samples (row keys from (seed, step, prompt id, sample) as in `generate`).

    tags: one per prompt (default 0..n-1), handed back with the finished group. Returns the tags.
    """
    e, G = self.e, int(samples_per_prompt)
    if G < 1 or e.slots % G:
      raise ValueError(f"samples_per_prompt={G} must be >= 1 and divide slots={e.slots}")
    toks, valid = e._static._pad_prompts(prompts, prompt_mask)  # pylint: disable=protected-access
    n = len(toks)  # one prompt bucket (max_prompt_len): the slot state never changes shape
    ids = np.arange(n) if prompt_ids is None else np.asarray(prompt_ids, np.int64)
    if ids.shape != (n,):
      raise ValueError(f"prompt_ids has shape {ids.shape}, expected ({n},)")
    tags = list(range(n)) if tags is None else list(tags)
    if len(tags) != n:
      raise ValueError(f"tags has {len(tags)} entries, expected one per prompt ({n})")
    R, N = n * G, e.max_new_tokens
    limits = np.asarray(N if max_new_tokens is None else max_new_tokens, np.int64)
    if limits.ndim and limits.shape != (R,):
      raise ValueError(f"generate: max_new_tokens has {limits.size} entries, expected one per row ({n} prompts x "
                       f"{G} samples = {R})")
    limits = np.broadcast_to(limits, (R,)).reshape(n, G)
    if limits.min() < 1 or limits.max() > N:
      raise ValueError(f"generate: max_new_tokens must lie in [1, {N}] (the engine's budget), got "
                       f"{limits.min()}..{limits.max()}")
    keys = np.asarray(jax.random.key_data(loop.row_keys(seed, step, jnp.asarray(np.repeat(ids, G).astype(np.uint32)),
                                                        jnp.asarray(np.tile(np.arange(G), n).astype(np.uint32)))))
    keys = keys.reshape(n, G, *keys.shape[1:])
    for i in range(n):
      self.queue.append(_Group(tags[i], toks[i], valid[i], int(ids[i]), keys[i], limits[i].copy()))
    return tags

  def _admit(self, params) -> None:
    """Whole groups of the queue's head (same G) take free slots, sharing one prefill per prompt."""
    e = self.e
    free = np.flatnonzero(self.owner < 0)
    G = self.queue[0].samples
    take = 0
    while take < len(self.queue) and self.queue[take].samples == G and (take + 1) * G <= len(free):
      take += 1
    if not take:
      return
    q = next(b for b in _pow2_buckets(1, e.slots // G) if b >= take)
    groups = [self.queue.popleft() for _ in range(take)]
    sel = groups + [groups[0]] * (q - take)
    toks = np.stack([g.prompt for g in sel])
    valid = np.stack([g.valid for g in sel])
    k, v, logits = e._prefill(params, jnp.asarray(toks), jnp.asarray(valid))  # pylint: disable=protected-access
    A = q * G
    slot_ids = np.full(A, len(self.owner), np.int32)  # padding: dropped
    slot_ids[:take * G] = free[:take * G]
    keys = np.concatenate([g.keys for g in sel])
    limits = np.concatenate([g.limits for g in sel]).astype(np.int32)
    self.st = e._admit(self.st, k, v, logits, jnp.asarray(toks), jnp.asarray(valid), jnp.asarray(slot_ids),  # pylint: disable=protected-access
                       jnp.asarray(np.repeat(np.arange(q), G).astype(np.int32)),
                       jax.random.wrap_key_data(jnp.asarray(keys)), jnp.asarray(limits), np.int32(self.version),
                       strategy=self.strategy)
    N = e.max_new_tokens
    for j, g in enumerate(groups):
      g.admitted = self.version
      g.tokens, g.logprobs = np.full((G, N), e.pad_id, np.int32), np.zeros((G, N), np.float32)
      g.versions, g.lengths, g.reason, g.left = np.full((G, N), -1, np.int32), np.zeros(G, np.int32), \
          np.zeros(G, np.int32), G
      for i in range(G):
        self._rows[self._next_row] = (g, i)
        self.owner[free[j * G + i]] = self._next_row
        self._next_row += 1
    self.running += take

  def _resize(self) -> None:
    """Full slots while requests wait; once none do, the running rows move to the smallest slot bucket that
    holds them (on a CPU a decode step costs in proportion to its slots, running or not)."""
    e, size = self.e, len(self.owner)
    if self.queue:
      if size < e.slots:  # grow back: the running rows keep their slots, the new ones are free
        self.st = e._placed(e._grow(e._empty(), self.st))  # pylint: disable=protected-access
        self.owner = np.concatenate([self.owner, np.full(e.slots - size, -1)])
      return
    live = np.flatnonzero(self.owner >= 0)
    b = next((b for b in e._buckets if b >= len(live)), size)  # pylint: disable=protected-access
    if e.shrink and len(live) and b < size:
      idx = np.concatenate([live, np.flatnonzero(self.owner < 0)[:b - len(live)]])
      self.st = e._placed(e._gather(self.st, jnp.asarray(idx, np.int32)))  # pylint: disable=protected-access
      self.owner = self.owner[idx]

  def _newest_weights(self):
    """The engine's newest params; on a version change the running rows' cache is recomputed under them
    (on_swap="recompute") and the swap counted."""
    e = self.e
    params, v_now = e._weights  # pylint: disable=protected-access
    if v_now != self.version:
      if e.on_swap == "recompute" and self.running:
        self.st = e._recompute(params, self.st)  # pylint: disable=protected-access
      self.version, self.swaps = v_now, self.swaps + 1
    return params

  def step(self) -> list[FinishedGroup]:
    """Admits queued groups into free slots, decodes one chunk, returns the groups that finished."""
    e = self.e
    if not self.pending:
      return []
    with e._ctx():  # pylint: disable=protected-access
      if self.st is None:
        self.st = e._empty()  # pylint: disable=protected-access
      self._resize()
      params = self._newest_weights()
      if self.queue:
        self._admit(params)
      if self.on_chunk is not None:
        self.on_chunk(self.chunks, self.finished_tokens)
        params = self._newest_weights()  # installed by on_chunk: admitted rows' token 0 keeps its version
      self.st = e._chunk(params, self.st, np.int32(self.version), np.int32(e.decode_chunk),  # pylint: disable=protected-access
                         strategy=self.strategy)
      self.chunks += 1
      steps = int(self.st.steps)
      self.steps, self.slot_steps = steps, self.slot_steps + (steps - self.steps) * len(self.owner)
      finished = self._collect()
      self._resize()
    return finished

  def cancel_older(self, version: int) -> list:
    """Stops the decoding groups whose first tokens were drawn with weights older than `version` (too stale
    to be used) and frees their slots; returns their tags. Queued groups start with the newest weights."""
    stale = {}
    for s in np.flatnonzero(self.owner >= 0):
      g, _ = self._rows[int(self.owner[s])]
      if g.admitted < version:
        stale.setdefault(id(g), g)
    if not stale:
      return []
    mask = np.zeros(len(self.owner), bool)
    for s in np.flatnonzero(self.owner >= 0):
      if id(self._rows[int(self.owner[s])][0]) in stale:
        del self._rows[int(self.owner[s])]
        self.owner[s], mask[s] = -1, True
    with self.e._ctx():  # pylint: disable=protected-access
      self.st = self.e._cancel(self.st, jnp.asarray(mask))  # pylint: disable=protected-access
    self.running -= len(stale)
    return [g.tag for g in stale.values()]

  def _collect(self) -> list[FinishedGroup]:
    fin = np.flatnonzero(np.asarray(self.st.done) & (self.owner >= 0))
    if not len(fin):
      return []
    st = jax.device_get((self.st.tokens, self.st.logprobs, self.st.versions, self.st.t, self.st.reason))
    tok, lp, ver, t, reason = (x[fin] for x in st)
    out = []
    for j, s in enumerate(fin):
      g, i = self._rows.pop(int(self.owner[s]))
      self.owner[s] = -1
      g.tokens[i], g.logprobs[i], g.versions[i], g.lengths[i], g.reason[i] = tok[j], lp[j], ver[j], t[j], reason[j]
      self.finished_tokens += int(t[j])
      g.left -= 1
      if not g.left:
        self.running -= 1
        out.append(FinishedGroup(g.tag, self._output(g)))
    return out

  def _output(self, g: _Group) -> SampleOutput:
    G = g.samples
    return SampleOutput(tokens=g.tokens, logprobs=g.logprobs, lengths=g.lengths, finish_reason=g.reason,
                        prompt_tokens=np.repeat(g.prompt[None], G, 0), prompt_mask=np.repeat(g.valid[None], G, 0),
                        versions=g.versions, prompt_ids=np.full(G, g.prompt_id, np.int32),
                        sample_ids=np.arange(G, dtype=np.int32), version=int(g.versions.max()))

  def timings(self) -> dict:
    """Wall time, chunks, weight swaps, decode steps and slot utilization (decoding slots over all slots
    of the steps run; a shrunk state has fewer slots) since the stream opened."""
    work = int(self.st.work) if self.st is not None else 0
    return dict(total_s=time.perf_counter() - self.t0, chunks=self.chunks, swaps=self.swaps,
                decode_steps=self.steps, slot_utilization=work / max(1, self.slot_steps))
