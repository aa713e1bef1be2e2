"""Where a slot's keys and values live, and how a decode step attends over them: the two cache layouts of the
one decode step (`rlax.sampler.step`), passed in the way `layers.block` takes `attend`.

A row's cached sequence is indexed 0, 1, 2, ...: its prompt, then every token after it (sampled or appended),
index = RoPE position. A layout writes runs of indices (`write`: admission, recompute, extension), gathers a
slot's whole sequence (`past`: the attention of an extension), and in a decode step writes each slot's new key
and value at its index and attends over indices <= it (`attend`).

- `Dense`: per slot a prompt part (indices < n_prompt, in max_prompt_len columns) and the generated part
  split into segments ending at 32, 64, 128, ... (`segments`). Keys are stored transposed ([.., Dh, n]): the
  score contraction is then a plain matmul per row and head, which XLA:CPU runs fastest.
  Every slot attends over the prompt and the first segment; a later segment only for the rows that reach it,
  in blocks of rows (`_ragged`), so a step costs what the rows' own lengths need. A decode loop attends over
  the segments the furthest running row has reached (`reach`). The slot axis leads every array, so slots can
  be gathered (the engine's shrink).
- `Paged`: one pool of pages per layer and KV head (`rlax.sampler.paged`); slot s's index i sits in page
  page_table[s, i // page] at offset i % page; on TPU the attention is jax's Pallas paged-attention kernel.

Shapes: S slots, A rows written, T indices per row, L layers, K KV heads, H query heads, Gh = H / K, Dh head
dim, P prompt columns, N generated columns.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax import models
from rlax.models import layers
from rlax.sampler import paged

BLOCK = 8  # rows per block of the ragged attention over the later segments
RAGGED_FROM = 64  # segments from this generated index on are attended only by the rows that reach them


def segments(n_new: int) -> tuple[tuple[int, int], ...]:
  """Generated segments ending at 32, 64, 128, 256, ... (the last one at least 32 long): narrower ones make
  XLA:CPU's reductions slower (a short minor axis)."""
  ends = [32]
  while ends[-1] < n_new:
    ends.append(ends[-1] * 2)
  ends[-1] = n_new
  if len(ends) > 1 and ends[-1] - ends[-2] < 32:
    ends.pop(-2)
  return tuple(zip([0] + ends[:-1], ends))


@flax.struct.dataclass
class DenseCache:
  """Per-layer tuples: pk [S, K, Dh, P], pv [S, K, P, Dh]; gk[l][i] [S, K, Dh, n_i], gv[l][i] [S, K, n_i, Dh]."""
  pk: tuple
  pv: tuple
  gk: tuple
  gv: tuple


def _partial(qf, k, v, ok):
  """Attention of qf [R, K, Gh, Dh] (scaled, f32) over k [R, K, Dh, n] / v [R, K, n, Dh] where ok [R, n],
  unnormalized: (running max m, sum l [R, K, Gh], weighted values o [R, K, Gh, Dh]); nothing valid: l = o = 0.
  Multiply-and-reduce: on a block of a few rows XLA:CPU runs it faster than a batched matmul."""
  s = jnp.sum(qf[..., None] * k.astype(jnp.float32)[:, :, None], axis=3)  # [R, K, Gh, n]
  ok = ok[:, None, None, :]
  m = jnp.max(jnp.where(ok, s, layers.NEG), axis=-1)
  p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
  return m, jnp.sum(p, axis=-1), jnp.sum(p.astype(v.dtype)[..., None] * v[:, :, None], axis=3).astype(jnp.float32)


def _first(qf, ks, vs, n_prompt, g):
  """Partial attention (as `_partial`) of every row over the prompt part (ks[0] / vs[0], columns < n_prompt) and
  the first generated segments (ks[1:], generated indices <= g): one softmax over their concatenated scores (few
  small ops: on XLA:CPU each costs a dispatch), then one contraction per part."""
  s = [jnp.einsum("rkgd,rkdn->rkgn", qf, k.astype(jnp.float32)) for k in ks]
  ok = [jnp.arange(ks[0].shape[-1])[None] < n_prompt[:, None]]
  a = 0
  for k in ks[1:]:
    ok.append((a + jnp.arange(k.shape[-1]))[None] <= g[:, None])
    a += k.shape[-1]
  s = jnp.where(jnp.concatenate(ok, axis=1)[:, None, None], jnp.concatenate(s, axis=-1), layers.NEG)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - m[..., None])
  o, off = 0.0, 0
  for v in vs:
    n = v.shape[2]
    o = o + jnp.einsum("rkgn,rknd->rkgd", p[..., off:off + n].astype(v.dtype), v).astype(jnp.float32)
    off += n
  return m, jnp.sum(p, axis=-1), o


def _merge(a, b):
  """Two partial attentions of the same rows over disjoint keys → one (log-sum-exp rescaling)."""
  m = jnp.maximum(a[0], b[0])
  ca, cb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
  return m, a[1] * ca + b[1] * cb, a[2] * ca[..., None] + b[2] * cb[..., None]


def _ragged(qf, gk, gv, g, live, a, order):
  """Partial attention over one later segment (starting at generated index a), only for rows with g >= a:
  rows furthest first (`order`), BLOCK at a time, for as many blocks as needed (a while loop)."""
  S, K, Gh, Dh = qf.shape
  blk = min(BLOCK, S)
  n = jnp.sum(live & (g >= a))

  def block(b, acc):
    rows = jax.lax.dynamic_slice_in_dim(order, b * blk, blk)
    ok = (a + jnp.arange(gk.shape[-1]))[None] <= g[rows][:, None]
    part = _partial(qf[rows], gk[rows], gv[rows], ok)
    return tuple(x.at[rows].set(y) for x, y in zip(acc, part))

  init = (jnp.full((S, K, Gh), layers.NEG, jnp.float32), jnp.zeros((S, K, Gh), jnp.float32),
          jnp.zeros((S, K, Gh, Dh), jnp.float32))
  return jax.lax.fori_loop(0, (n + blk - 1) // blk, block, init)


@dataclasses.dataclass(frozen=True)
class Dense:
  """The dense layout (module docstring) for prompts of up to `prompt_len` and `new_tokens` after them."""
  prompt_len: int
  new_tokens: int
  scans = False  # per-layer tuples: the decode step unrolls its layers

  @property
  def bounds(self) -> tuple[int, ...]:
    """Generated-index bounds of the decode loops: loop i attends over segments 0..i."""
    return tuple(b for _, b in segments(self.new_tokens))

  def init(self, cfg: models.ModelConfig, slots: int, mesh: Optional[Mesh] = None) -> DenseCache:
    S, K, Dh, P, dt = slots, cfg.n_kv_heads, cfg.head_dim, self.prompt_len, cfg.jnp_dtype
    segs = segments(self.new_tokens)
    z = lambda *shape: jnp.zeros(shape, dt)
    return DenseCache(pk=tuple(z(S, K, Dh, P) for _ in range(cfg.n_layers)),
                      pv=tuple(z(S, K, P, Dh) for _ in range(cfg.n_layers)),
                      gk=tuple(tuple(z(S, K, Dh, b - a) for a, b in segs) for _ in range(cfg.n_layers)),
                      gv=tuple(tuple(z(S, K, b - a, Dh) for a, b in segs) for _ in range(cfg.n_layers)))

  def shardings(self, cfg: models.ModelConfig, mesh: Mesh, slots: int) -> DenseCache:
    """Slots over the mesh's batch axes, KV heads over 'tensor' (as the rules table shards them)."""
    shapes = jax.eval_shape(lambda: self.init(cfg, slots))
    spec = lambda x: NamedSharding(mesh, models.spec_for(("batch", "act_kv_heads", None, None), x.shape,
                                                         dict(mesh.shape)))
    return jax.tree.map(spec, shapes)

  def write(self, cache: DenseCache, slots, k, v, start, count, n_prompt) -> DenseCache:
    """Writes k, v [L, A, T, K, Dh] as indices start[a] .. start[a] + count[a] - 1 of slots[a] (slot ids >= S
    are dropped): indices below n_prompt[a] into the prompt part, the others into the generated segments."""
    S, P = cache.pk[0].shape[0], self.prompt_len
    T = k.shape[2]
    idx = start[:, None] + jnp.arange(T)[None]  # [A, T]
    ok = (jnp.arange(T)[None] < count[:, None]) & (slots[:, None] < S)
    rows = jnp.broadcast_to(slots[:, None], idx.shape)
    g = idx - n_prompt[:, None]
    col = jnp.where(ok & (g < 0), idx, P)  # out of range: dropped
    pk, pv, gk, gv = [], [], [], []
    for l in range(len(cache.pk)):
      kl, vl = k[l].astype(cache.pk[l].dtype), v[l].astype(cache.pv[l].dtype)  # [A, T, K, Dh]
      pk.append(cache.pk[l].at[rows, :, :, col].set(kl, mode="drop"))
      pv.append(cache.pv[l].at[rows, :, col, :].set(vl, mode="drop"))
      segk, segv = [], []
      for (a, b), sk, sv in zip(segments(self.new_tokens), cache.gk[l], cache.gv[l]):
        at = jnp.where(ok & (g >= a) & (g < b), g - a, b - a)
        segk.append(sk.at[rows, :, :, at].set(kl, mode="drop"))
        segv.append(sv.at[rows, :, at, :].set(vl, mode="drop"))
      gk.append(tuple(segk))
      gv.append(tuple(segv))
    return DenseCache(pk=tuple(pk), pv=tuple(pv), gk=tuple(gk), gv=tuple(gv))

  def past(self, cache: DenseCache, slots, n_prompt, n_cached):
    """Slots' cached sequences as (k, v [L, A, P + N, K, Dh], valid [A, P + N]); order does not matter to
    attention, only which entries are valid: prompt columns < n_prompt, generated < n_cached - n_prompt."""
    P, N = self.prompt_len, self.new_tokens
    ks = jnp.stack([jnp.concatenate([cache.pk[l][slots]] + [g[slots] for g in cache.gk[l]], axis=-1)
                    for l in range(len(cache.pk))]).transpose(0, 1, 4, 2, 3)
    vs = jnp.stack([jnp.concatenate([cache.pv[l][slots]] + [g[slots] for g in cache.gv[l]], axis=2)
                    for l in range(len(cache.pv))]).transpose(0, 1, 3, 2, 4)
    j = jnp.arange(P + N)[None]
    valid = jnp.where(j < P, j < n_prompt[:, None], j - P < (n_cached - n_prompt)[:, None])
    return ks, vs, valid

  def attend(self, cache: DenseCache, layer: int, q, k, v, *, pos, n_prompt, live, reach: int):
    """One decode step of layer `layer`: writes k, v [S, K, Dh] at each running slot's index pos (generated
    index g = pos - n_prompt, inside segments < reach), then attends q [S, H, Dh] over the slot's prompt and
    generated indices <= g. Returns ([S, H, Dh], cache)."""
    S, H, Dh = q.shape
    K = k.shape[1]
    dt = cache.pk[layer].dtype
    segs = segments(self.new_tokens)[:reach]
    g = pos - n_prompt
    rows = jnp.arange(S)
    gk, gv = list(cache.gk[layer]), list(cache.gv[layer])
    # Write first, then attend over the written buffers: reading the old buffer beside an in-place write makes
    # XLA copy the whole cache every step.
    for i, (a, b) in enumerate(segs):
      at = jnp.where(live & (g >= a) & (g < b), g - a, b - a)  # other segments' rows: dropped
      gk[i] = gk[i].at[rows, :, :, at].set(k.astype(dt), mode="drop")
      gv[i] = gv[i].at[rows, :, at, :].set(v.astype(dt), mode="drop")
    qf = q.reshape(S, K, H // K, Dh).astype(jnp.float32) / math.sqrt(Dh)
    out = _first(qf, [cache.pk[layer]] + [gk[i] for i, (a, _) in enumerate(segs) if a < RAGGED_FROM],
                 [cache.pv[layer]] + [gv[i] for i, (a, _) in enumerate(segs) if a < RAGGED_FROM], n_prompt, g)
    order = None
    for i, (a, _) in enumerate(segs):
      if a < RAGGED_FROM:
        continue
      if order is None:
        order = jnp.argsort(jnp.where(live, -g, 1))  # furthest rows first; idle slots last
        order = jnp.concatenate([order, order[:(-S) % min(BLOCK, S)]])  # whole blocks
      out = _merge(out, _ragged(qf, gk[i], gv[i], g, live, a, order))
    o = out[2] / jnp.maximum(out[1], 1e-30)[..., None]
    cache = cache.replace(gk=_set(cache.gk, layer, tuple(gk)), gv=_set(cache.gv, layer, tuple(gv)))
    return o.astype(q.dtype).reshape(S, H, Dh), cache


def _set(t: tuple, i: int, x) -> tuple:
  return t[:i] + (x,) + t[i + 1:]


@flax.struct.dataclass
class PagedCache:
  """k, v: [K, L, pool pages, page, Dh]; page_table: [S, n] page ids, local to the slot's shard."""
  k: jax.Array
  v: jax.Array
  page_table: jax.Array


@dataclasses.dataclass(frozen=True)
class Paged:
  """The paged layout: slot s owns n = ceil(max_len / page_size) pages of its shard's pool (a contiguous page
  table); `attention` "kernel" (Pallas, TPU), "interpret" (the kernel in interpret mode) or "reference"."""
  max_len: int
  page_size: int
  attention: str = "reference"
  scans = True  # the pools ride in a scan's carry: a 64-layer model compiles as one layer

  @property
  def bounds(self) -> tuple[int, ...]:
    return (2 ** 31 - 1,)  # one decode loop: each slot's length already bounds its attention

  @property
  def pages(self) -> int:
    return paged.pages_per_slot(self.max_len, self.page_size)

  def init(self, cfg: models.ModelConfig, slots: int, mesh: Optional[Mesh] = None) -> PagedCache:
    n = self.pages
    table = paged.contiguous_page_table(slots, n, paged.slot_shards(mesh, slots, cfg.n_kv_heads))
    shape = (cfg.n_kv_heads, cfg.n_layers, slots * n, self.page_size, cfg.head_dim)
    return PagedCache(k=jnp.zeros(shape, cfg.jnp_dtype), v=jnp.zeros(shape, cfg.jnp_dtype),
                      page_table=jnp.asarray(table))

  def shardings(self, cfg: models.ModelConfig, mesh: Mesh, slots: int) -> PagedCache:
    """Pools over (KV heads: tensor, pages: the slots' axes), the page table over slots."""
    slot, head = paged.mesh_axes(dict(mesh.shape), slots, cfg.n_kv_heads)
    ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
    pool = ns(head, None, slot, None, None)
    return PagedCache(k=pool, v=pool, page_table=ns(slot, None))

  def _global_pages(self, cache: PagedCache, slots, idx):
    """Global pool page of index idx [A, T] of slots [A] (page-table ids are local to the slot's shard)."""
    K, L, Pp = cache.k.shape[:3]
    S, n = cache.page_table.shape
    shards = paged.slot_shards(jax.sharding.get_abstract_mesh(), S, K)
    rows = jnp.clip(slots, 0, S - 1)
    local = jnp.take_along_axis(cache.page_table[rows], jnp.clip(idx // self.page_size, 0, n - 1), axis=1)
    return local + (rows // (S // shards) * (Pp // shards))[:, None]

  def write(self, cache: PagedCache, slots, k, v, start, count, n_prompt) -> PagedCache:
    """Writes k, v [L, A, T, K, Dh] as indices start[a] .. + count[a] - 1 of slots[a] (ids >= S: dropped)."""
    del n_prompt  # one index space: prompt and generated tokens alike
    T, S, Pp = k.shape[2], cache.page_table.shape[0], cache.k.shape[2]
    idx = start[:, None] + jnp.arange(T)[None]
    ok = (jnp.arange(T)[None] < count[:, None]) & (slots[:, None] < S) & (idx < self.pages * self.page_size)
    page = jnp.where(ok, self._global_pages(cache, slots, idx), Pp)  # out of range: dropped
    put = lambda pool, x: pool.at[:, :, page, idx % self.page_size].set(x.transpose(3, 0, 1, 2, 4).astype(pool.dtype),
                                                                         mode="drop")
    return cache.replace(k=put(cache.k, k), v=put(cache.v, v))

  def past(self, cache: PagedCache, slots, n_prompt, n_cached):
    """Slots' cached sequences as (k, v [L, A, n * page, K, Dh], valid [A, n * page])."""
    del n_prompt
    T = self.pages * self.page_size
    idx = jnp.broadcast_to(jnp.arange(T)[None], (slots.shape[0], T))
    page = self._global_pages(cache, slots, idx)
    get = lambda pool: pool[:, :, page, idx % self.page_size].transpose(1, 2, 3, 0, 4)  # [L, A, T, K, Dh]
    return get(cache.k), get(cache.v), idx < n_cached[:, None]

  def attend(self, cache: PagedCache, layer, q, k, v, *, pos, n_prompt, live, reach: int):
    """One decode step of layer `layer` (an int or a scanned index): writes k, v [S, K, Dh] at index pos of
    every running slot's pages, then attends q [S, H, Dh] over indices <= pos (under a mesh, per shard)."""
    del n_prompt, reach
    local = functools.partial(paged.write_and_attend, attention=self.attention)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
      S, K = q.shape[0], k.shape[1]
      slot, head = paged.mesh_axes(dict(mesh.shape), S, K)
      P_ = PartitionSpec
      pool, sh = P_(head, None, slot, None, None), P_(slot, head, None)
      # Mosaic kernels are not partitioned by XLA: each shard runs the kernel on its own slots, pages and heads.
      local = jax.shard_map(local, mesh=mesh, in_specs=(sh, sh, sh, pool, pool, P_(slot, None), P_(slot), P_(slot),
                                                         P_()), out_specs=(sh, pool, pool), check_vma=False)
    o, kp, vp = local(q, k, v, cache.k, cache.v, cache.page_table, pos, live, jnp.asarray(layer, jnp.int32))
    return o, cache.replace(k=kp, v=vp)


ATTENTION = ("auto", "dense", "paged", "paged_interpret")  # Sampler(attention=...)


def make_layout(cfg: models.ModelConfig, attention: str, prompt_len: int, new_tokens: int,
                page_size: Optional[int] = None, platform: Optional[str] = None):
  """The cache layout `attention` names ("auto": paged on a TPU the kernel compiles for, else dense); platform:
  the devices' (default: the default backend's); page_size default: `paged.default_page_size`."""
  if attention not in ATTENTION:
    raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
  tpu = (platform or jax.default_backend()) == "tpu"
  if attention == "auto":
    attention = "paged" if tpu and paged.kernel_supports(cfg) else "dense"
  if attention == "dense":
    return Dense(prompt_len, new_tokens)
  kind = ("interpret" if attention == "paged_interpret" else "kernel" if tpu and paged.kernel_supports(cfg)
          else "reference")
  max_len = prompt_len + new_tokens
  return Paged(max_len, page_size or paged.default_page_size(max_len), kind)
