"""Paged KV cache and a one-token decode step over it; on TPU the attention is jax's Pallas paged kernel.

    cache = paged.init_cache(cfg, slots=64, max_len=4096, page_size=128)
    logits, cache = jax.jit(paged.decode_step, static_argnums=1)(params, cfg, cache, tok)

Layout: keys and values each live in one pool `[K, L, P, page, Dh]` (a pool of P pages per layer and KV
head); slot s's token t sits in page `page_table[s, t // page]` at offset `t % page`, and `lengths[s]`
tokens of slot s are cached. A slot's pages need not be contiguous or in order, so an allocator can hand
pages to slots as they grow, and the pool is sized from a byte budget (`pages_for_budget`), not from
slots x the longest sequence. Every layer's pool is addressed as pages `l*P .. (l+1)*P` of one
`[K, L*P, page, Dh]` view: the kernel reads layer l's pages through offset page indices, so no layer's
pool is ever sliced (copied) out of the scan carry.

The step applies `rlax.models.layers.block` (the same block the full forward and `decode.decode_step`
apply) with an `attend` callback that writes the new key/value of every slot into its page and attends
over the slot's `lengths + 1` tokens with:

- "kernel": `jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic; compiles for TPU only). It takes
  one query per sequence and a length per sequence, which is exactly a decode step over slots at
  different positions. The kernel loads K/V pages as bfloat16 whatever the cache dtype.
- "interpret": the same kernel in Pallas TPU interpret mode (runs on CPU; tests use it).
- "reference": pure jnp (gather the slot's pages, masked softmax in f32).
- "auto": "kernel" on a TPU backend when `kernel_supports(cfg)`, else "reference".

jax also ships `ragged_paged_attention` (mixed prefill + decode). In jax 0.10.2 it does not run in either
Pallas interpret mode on CPU (TPU interpret mode: "'ReshapeTransform' object has no attribute 'indices'"
on its reshaped VMEM ref; HLO interpret mode: "'TypedInt' object has no attribute 'shape'" in its masked
store), so its numerics could not be tested here; decode needs only one query per slot, which
`paged_attention` covers.

Under a mesh (`jax.set_mesh`) the write and the attention run in `shard_map`: slots and the pool's pages
split over the 'batch' mesh axes (data), KV heads (and their query heads) over 'tensor'. Page indices are
then local to the slot's own shard of the pool (P / shards pages each).

Shapes: S slots, L layers, K KV heads, H query heads, Dh head dim, P pool pages, n pages per slot, V vocab.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from rlax import models
from rlax.models import layers
from rlax.models import sharding as shd

ATTENTION = ("auto", "kernel", "interpret", "reference")


@flax.struct.dataclass
class PagedKVCache:
  """k, v: [K, L, P, page, Dh] page pools; page_table: [S, n] int32 page ids (local to the slot's shard);
  lengths: [S] int32 tokens cached per slot (= the RoPE position of the slot's next token)."""
  k: jax.Array
  v: jax.Array
  page_table: jax.Array
  lengths: jax.Array

  @property
  def page_size(self) -> int:
    return self.k.shape[3]

  @property
  def capacity(self) -> int:
    """Most tokens one slot can hold: its page-table row x page size."""
    return self.page_table.shape[1] * self.page_size


def page_bytes(cfg: models.ModelConfig, page_size: int, dtype=None) -> int:
  """Bytes of one page index across the pools: keys + values, every layer and KV head."""
  item = jnp.dtype(dtype or cfg.jnp_dtype).itemsize
  return 2 * cfg.n_layers * cfg.n_kv_heads * page_size * cfg.head_dim * item


def pages_for_budget(cfg: models.ModelConfig, budget_bytes: int, page_size: int, dtype=None,
                     multiple_of: int = 1) -> int:
  """The most pool pages that fit `budget_bytes` (whole model, all devices), rounded down to `multiple_of`
  (the number of slot shards, so every shard owns the same number of pages)."""
  n = int(budget_bytes) // page_bytes(cfg, page_size, dtype)
  return n // multiple_of * multiple_of


def pages_per_slot(max_len: int, page_size: int) -> int:
  return -(-max_len // page_size)


def contiguous_page_table(slots: int, n: int, shards: int = 1) -> np.ndarray:
  """[slots, n] page ids giving each slot n pages of its own, local to its shard (slots split in `shards`
  equal blocks, as the 'batch' sharding splits them)."""
  if slots % shards:
    raise ValueError(f"{slots} slots do not split into {shards} shards")
  local = np.arange(slots) % (slots // shards)
  return (local[:, None] * n + np.arange(n)[None]).astype(np.int32)


def init_cache(cfg: models.ModelConfig, slots: int, max_len: int, page_size: int, num_pages: Optional[int] = None,
               page_table=None, dtype=None) -> PagedKVCache:
  """An empty cache (zeros, lengths 0). num_pages defaults to slots x pages_per_slot(max_len) and the page
  table to `contiguous_page_table`; pass both to size the pool from a budget and map pages yourself."""
  n = pages_per_slot(max_len, page_size)
  num_pages = slots * n if num_pages is None else int(num_pages)
  table = contiguous_page_table(slots, n) if page_table is None else np.asarray(page_table, np.int32)
  if table.shape != (slots, n):
    raise ValueError(f"page_table has shape {table.shape}, expected ({slots}, {n})")
  if table.size and (table.min() < 0 or table.max() >= num_pages):
    raise ValueError(f"page_table ids must be in [0, {num_pages})")
  shape = (cfg.n_kv_heads, cfg.n_layers, num_pages, page_size, cfg.head_dim)
  dtype = dtype or cfg.jnp_dtype
  return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), page_table=jnp.asarray(table),
                      lengths=jnp.zeros((slots,), jnp.int32))


def _axes(mesh_shape: dict[str, int], slots: int, kv_heads: int):
  """Mesh axes of the slot (and page) dimension and of the KV-head dimension, from the rules table."""
  slot = shd.spec_for(("batch",), (slots,), mesh_shape)[0]
  head = shd.spec_for(("act_kv_heads",), (kv_heads,), mesh_shape)[0]
  return slot, head


def _size(mesh_shape: dict[str, int], axes) -> int:
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return int(np.prod([mesh_shape[a] for a in axes], dtype=np.int64))


def cache_shardings(cfg: models.ModelConfig, mesh: Mesh, slots: int) -> PagedKVCache:
  """NamedShardings of a PagedKVCache on `mesh`: pools over (KV heads: tensor, pages: data), slots over data."""
  slot, head = _axes(dict(mesh.shape), slots, cfg.n_kv_heads)
  ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
  pool = ns(head, None, slot, None, None)
  return PagedKVCache(k=pool, v=pool, page_table=ns(slot, None), lengths=ns(slot))


def abstract_cache(cfg: models.ModelConfig, slots: int, max_len: int, page_size: int, mesh: Optional[Mesh] = None,
                   num_pages: Optional[int] = None, dtype=None) -> PagedKVCache:
  """ShapeDtypeStructs of `init_cache(...)` (on `cache_shardings` when a mesh is given): for AOT lowering."""
  shapes = jax.eval_shape(lambda: init_cache(cfg, slots, max_len, page_size, num_pages, dtype=dtype))
  if mesh is None:
    return shapes
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                      cache_shardings(cfg, mesh, slots))


def slot_shards(mesh, slots: int, kv_heads: int) -> int:
  """How many shards the slots (and the pool's pages) split into on `mesh` (concrete or abstract; None or a
  one-device mesh: 1), as `decode_step` splits them under shard_map."""
  if mesh is None or mesh.empty or mesh.size == 1:
    return 1
  mshape = dict(mesh.shape)
  return _size(mshape, _axes(mshape, slots, kv_heads)[0])


def write_prefix(cache: PagedKVCache, slots: Int[Array, "A"], k: Float[Array, "L A T K Dh"],
                 v: Float[Array, "L A T K Dh"], lengths: Int[Array, "A"]) -> PagedKVCache:
  """Writes k, v as tokens 0..T-1 of slots `slots` (ids >= S: padding, dropped) and sets their lengths.

  For admission (a prefill's keys/values) and for recomputing a slot's cache after a weight swap. Page ids are
  local to the slot's shard (as `decode_step` reads them under a mesh set with `jax.set_mesh`); the write
  turns them into global pool indices.
  """
  K, L, P, pg, Dh = cache.k.shape
  S, n = cache.page_table.shape
  T = k.shape[2]
  if T > n * pg:
    raise ValueError(f"{T} tokens do not fit a slot's {n} pages of {pg}")
  shards = slot_shards(jax.sharding.get_abstract_mesh(), S, K)
  ok = slots < S
  rows = jnp.where(ok, slots, 0)
  j = jnp.arange(T)
  page = cache.page_table[rows][:, j // pg] + (rows // (S // shards) * (P // shards))[:, None]  # [A, T]
  page = jnp.where(ok[:, None], page, P)  # out of range: dropped
  put = lambda pool, x: pool.at[:, :, page, j % pg].set(x.transpose(3, 0, 1, 2, 4).astype(pool.dtype),
                                                         mode="drop")
  return cache.replace(k=put(cache.k, k), v=put(cache.v, v),
                       lengths=cache.lengths.at[slots].set(lengths.astype(jnp.int32), mode="drop"))


def fuse_layers(params: models.Params, cfg: models.ModelConfig) -> models.Params:
  """params with every layer's weights `layers.fuse`d (q|k|v and gate|up concatenated), still stacked [L, ...]
  so the step can scan them: one matmul each instead of three and two (what XLA:CPU wants; on TPU a
  decode step reads the same bytes either way). Do it once per weight version, not per step."""
  out = dict(params)
  out["layers"] = jax.vmap(lambda w: layers.fuse(cfg, w))(params["layers"])
  return out


def reference_attention(q: Float[Array, "S H Dh"], k_pages: Float[Array, "K P pg Dh"],
                        v_pages: Float[Array, "K P pg Dh"], lengths: Int[Array, "S"],
                        page_table: Int[Array, "S n"]) -> Float[Array, "S H Dh"]:
  """Attention of each slot's query over its first lengths[s] tokens, read from its pages; softmax in f32."""
  S, H, Dh = q.shape
  K, _, pg, _ = k_pages.shape
  n = page_table.shape[1]
  f32 = jnp.float32
  k = k_pages[:, page_table].reshape(K, S, n * pg, Dh).astype(f32)  # gathers only the slots' pages
  v = v_pages[:, page_table].reshape(K, S, n * pg, Dh).astype(f32)
  qh = q.reshape(S, K, H // K, Dh).astype(f32)
  s = jnp.einsum("skgd,kstd->skgt", qh, k) / math.sqrt(Dh)
  valid = jnp.arange(n * pg)[None] < lengths[:, None]
  s = jnp.where(valid[:, None, None], s, layers.NEG)
  o = jnp.einsum("skgt,kstd->skgd", jax.nn.softmax(s, axis=-1), v)
  return o.reshape(S, H, Dh).astype(q.dtype)


def default_pages_per_block(n: int, page_size: int, max_tokens: int = 1024) -> int:
  """The kernel's pages per compute block: the largest divisor of n (it must divide) spanning <= max_tokens."""
  best = 1
  for d in range(1, n + 1):
    if n % d == 0 and d * page_size <= max_tokens:
      best = d
  return best


def kernel_attention(q: Float[Array, "S H Dh"], k_pages: Float[Array, "K P pg Dh"], v_pages: Float[Array, "K P pg Dh"],
                     lengths: Int[Array, "S"], page_table: Int[Array, "S n"], *, pages_per_block: Optional[int] = None,
                     interpret: bool = False) -> Float[Array, "S H Dh"]:
  """`reference_attention` by jax's Pallas TPU `paged_attention` kernel (interpret=True: Pallas TPU interpret
  mode, which runs on CPU). lengths must be >= 1. K/V pages are loaded as bfloat16 by the kernel."""
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  n, pg = page_table.shape[1], k_pages.shape[2]
  ppb = pages_per_block or default_pages_per_block(n, pg)
  # The kernel does not scale the scores; scaling q in f32 keeps bf16 rounding out of the scale.
  qs = q.astype(jnp.float32) * (1.0 / math.sqrt(q.shape[-1]))
  call = functools.partial(paged_attention, pages_per_compute_block=ppb)
  if interpret:
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      out = call(qs, k_pages, v_pages, lengths, page_table)
  else:
    out = call(qs, k_pages, v_pages, lengths, page_table)
  return out.reshape(q.shape).astype(q.dtype)


def kernel_supports(cfg: models.ModelConfig) -> bool:
  """Whether the Mosaic kernel compiles for this model: its per-head softmax statistics are blocked like the
  output, (heads, head_dim) over an array whose last dim is 1, which Mosaic accepts only for head_dim % 128 == 0
  (interpret mode does not check this)."""
  return cfg.head_dim % 128 == 0


def _resolve(attention: str, cfg: models.ModelConfig) -> str:
  if attention not in ATTENTION:
    raise ValueError(f"attention={attention!r}; expected one of {ATTENTION}")
  if attention == "auto":
    return "kernel" if jax.default_backend() == "tpu" and kernel_supports(cfg) else "reference"
  return attention


def _write_and_attend(q, k, v, kp, vp, page_table, lengths, active, layer, *, attention: str,
                      pages_per_block: Optional[int]):
  """One layer on one shard: writes k, v [S, K, Dh] at each active slot's next position in layer `layer`'s
  pages, then attends q [S, H, Dh] over the slot's tokens. kp, vp: the whole [K, L, P, pg, Dh] pools."""
  K, L, P, pg, Dh = kp.shape
  n = page_table.shape[1]
  write = active & (lengths < n * pg)  # a full slot writes nothing (its page row has no room)
  page = jnp.take_along_axis(page_table, jnp.minimum(lengths // pg, n - 1)[:, None], axis=1)[:, 0]
  # Out-of-range page ids drop the write; the [K, L*P, pg, Dh] view merges major dims only (a bitcast).
  gpage = jnp.where(write, layer * P + page, L * P)
  kf = kp.reshape(K, L * P, pg, Dh).at[:, gpage, lengths % pg].set(k.transpose(1, 0, 2).astype(kp.dtype),
                                                                    mode="drop")
  vf = vp.reshape(K, L * P, pg, Dh).at[:, gpage, lengths % pg].set(v.transpose(1, 0, 2).astype(vp.dtype),
                                                                    mode="drop")
  # Write first, then attend over the written pool: reading the old pool beside an in-place write would
  # make XLA copy it. Idle slots attend over what they hold (their output is not used).
  kv_len = jnp.clip(lengths + write, 1, n * pg).astype(jnp.int32)
  table = (page_table + layer * P).astype(jnp.int32)
  if attention == "reference":
    out = reference_attention(q, kf, vf, kv_len, table)
  else:
    out = kernel_attention(q, kf, vf, kv_len, table, pages_per_block=pages_per_block,
                           interpret=attention == "interpret")
  return out, kf.reshape(kp.shape), vf.reshape(vp.shape)


def decode_step(params: models.Params, cfg: models.ModelConfig, cache: PagedKVCache, tok: Int[Array, "S"],
                active: Optional[Bool[Array, "S"]] = None, *, attention: str = "auto",
                pages_per_block: Optional[int] = None) -> tuple[Float[Array, "S V"], PagedKVCache]:
  """Feeds one token per slot at its own position (cache.lengths) and returns f32 logits [S, V] for the next
  token and the cache with the token's keys/values written and active slots' lengths advanced.

  params: the model's parameter tree (per-layer weights stacked [L, ...]), as is or `fuse_layers`d; they are
  used in `cfg.dtype`. active [S] (default all): idle slots write nothing and keep their length, and their
  logits are meaningless. A slot whose page row is full writes nothing either. With `cfg.scan_layers` the
  layers run under `lax.scan` (a 64-layer model compiles as one layer). Jit with cfg static.
  """
  attention = _resolve(attention, cfg)
  S, K, dt = tok.shape[0], cfg.n_kv_heads, cfg.jnp_dtype
  if active is None:
    active = jnp.ones((S,), bool)
  inv_freq = layers.rope_inv_freq(cfg)
  pos = cache.lengths
  x = jnp.take(params["embed"], tok, axis=0).astype(dt)[:, None]  # [S, 1, D]
  x = models.constrain(x, ("batch", "act_seq", "act_embed"))

  local = functools.partial(_write_and_attend, attention=attention, pages_per_block=pages_per_block)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.size > 1:
    mshape = dict(mesh.shape)
    slot, head = _axes(mshape, S, K)
    if cache.k.shape[2] % _size(mshape, slot):
      raise ValueError(f"{cache.k.shape[2]} pool pages do not split over the {_size(mshape, slot)} slot shards")
    P_ = PartitionSpec
    pool, sh = P_(head, None, slot, None, None), P_(slot, head, None)
    # Mosaic kernels are not partitioned by XLA: each shard runs the kernel on its own slots, pages and heads.
    local = jax.shard_map(local, mesh=mesh, in_specs=(sh, sh, sh, pool, pool, P_(slot, None), P_(slot), P_(slot), P_()),
                          out_specs=(sh, pool, pool), check_vma=False)

  def layer(x, w, kp, vp, l):
    def attend(q, k, v):
      nonlocal kp, vp
      o, kp, vp = local(q[:, 0], k[:, 0], v[:, 0], kp, vp, cache.page_table, pos, active, l)
      return o[:, None]

    x = layers.block(cfg, w, x, pos[:, None], inv_freq, attend)
    return x, kp, vp

  lay = params["layers"]
  if cfg.scan_layers:
    # The pools ride in the carry (updated in place), the stacked weights are the scanned input.
    def body(carry, xs):
      w, l = xs
      return layer(carry[0], w, carry[1], carry[2], l), None

    (x, kp, vp), _ = jax.lax.scan(body, (x, cache.k, cache.v), (lay, jnp.arange(cfg.n_layers, dtype=jnp.int32)))
  else:
    kp, vp = cache.k, cache.v
    for l in range(cfg.n_layers):
      x, kp, vp = layer(x, jax.tree.map(lambda w: w[l], lay), kp, vp, jnp.int32(l))
  x = layers.rms_norm(x[:, 0], params["final_norm"].astype(dt), cfg.norm_eps)
  logits = jnp.dot(x, models.lm_head(params, cfg), preferred_element_type=jnp.float32)
  logits = models.constrain(logits, ("batch", "act_vocab"))
  new_len = cache.lengths + (active & (cache.lengths < cache.capacity)).astype(jnp.int32)
  return logits, cache.replace(k=kp, v=vp, lengths=new_len)


def kernel_cost(cfg: models.ModelConfig, kv_lens, page_size: int, pages_per_block: int = 1, kv_dtype=None,
                q_dtype=jnp.float32) -> dict[str, float]:
  """Bytes and FLOPs of one decode step's attention kernels (all layers), which XLA's cost analysis cannot
  see inside a Mosaic custom call: the kernel copies whole blocks of `pages_per_block` pages, so every block
  a slot has started is read (keys and values, every KV head); q is read and the output written once per
  layer. kv_lens: the slots' key counts (after the write)."""
  lens = np.asarray(kv_lens, np.int64)
  K, H, Dh, L = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim, cfg.n_layers
  kv_item = jnp.dtype(kv_dtype or cfg.jnp_dtype).itemsize
  pages = int(np.sum(-(-lens // (page_size * pages_per_block)))) * pages_per_block
  kv = 2 * K * pages * page_size * Dh * kv_item
  qo = 2 * len(lens) * H * Dh * jnp.dtype(q_dtype).itemsize
  flops = 4 * H * Dh * float(np.sum(lens))  # q.k and p.v
  return dict(bytes_accessed=float(L * (kv + qo)), flops=float(L * flops), pages_read=L * pages)
