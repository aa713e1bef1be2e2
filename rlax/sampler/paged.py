"""Paged-attention primitives of the paged cache layout (`rlax.sampler.layouts.Paged`): page tables, and one
layer's write-and-attend over a slot's pages, on TPU by jax's Pallas paged-attention kernel.

Layout: keys and values each live in one pool `[K, L, P, page, Dh]` (P pages per layer and KV head); slot s's
index i sits in page `page_table[s, i // page]` at offset `i % page`. A slot's pages need not be contiguous or
in order, so an allocator can hand pages to slots as they grow. Every layer's pool is addressed as pages
`l*P .. (l+1)*P` of one `[K, L*P, page, Dh]` view: the kernel reads layer l's pages through offset page
indices, so no layer's pool is ever sliced (copied) out of a scan carry.

Attention (`write_and_attend`):
- "kernel": `jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic; compiles for TPU only). It takes
  one query per sequence and a length per sequence, which is exactly a decode step over slots at
  different positions. The kernel loads K/V pages as bfloat16 whatever the cache dtype.
- "interpret": the same kernel in Pallas TPU interpret mode (runs on CPU; tests use it).
- "reference": pure jnp (gather the slot's pages, masked softmax in f32).

jax also ships `ragged_paged_attention` (mixed prefill + decode). In jax 0.10.2 it does not run in either
Pallas interpret mode on CPU (TPU interpret mode: "'ReshapeTransform' object has no attribute 'indices'"
on its reshaped VMEM ref; HLO interpret mode: "'TypedInt' object has no attribute 'shape'" in its masked
store), so its numerics could not be tested here; decode needs only one query per slot, which
`paged_attention` covers.

Under a mesh the layout runs `write_and_attend` in `shard_map`: slots and the pool's pages split over the
'batch' mesh axes (data), KV heads (and their query heads) over 'tensor'. Page ids are then local to the
slot's own shard of the pool (P / shards pages each).

Shapes: S slots, L layers, K KV heads, H query heads, Dh head dim, P pool pages, n pages per slot.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rlax import models
from rlax.models import layers
from rlax.models import sharding as shd

def pages_per_slot(max_len: int, page_size: int) -> int:
  return -(-max_len // page_size)


def default_page_size(max_len: int) -> int:
  """Tokens per page: 1/16 of the context rounded up to a power of two, within [16, 128] (jax's
  `get_min_page_size` rule; 128 = one (128, 128) tile of keys at head_dim 128)."""
  return min(128, max(16, (1 << max(0, max_len - 1).bit_length()) // 16))


def contiguous_page_table(slots: int, n: int, shards: int = 1) -> np.ndarray:
  """[slots, n] page ids giving each slot n pages of its own, local to its shard (slots split in `shards`
  equal blocks, as the 'batch' sharding splits them)."""
  if slots % shards:
    raise ValueError(f"{slots} slots do not split into {shards} shards")
  local = np.arange(slots) % (slots // shards)
  return (local[:, None] * n + np.arange(n)[None]).astype(np.int32)


def mesh_axes(mesh_shape: dict[str, int], slots: int, kv_heads: int):
  """Mesh axes of the slot (and page) dimension and of the KV-head dimension, from the rules table."""
  slot = shd.spec_for(("batch",), (slots,), mesh_shape)[0]
  head = shd.spec_for(("act_kv_heads",), (kv_heads,), mesh_shape)[0]
  return slot, head


def slot_shards(mesh, slots: int, kv_heads: int) -> int:
  """How many shards the slots (and the pool's pages) split into on `mesh` (concrete or abstract; None or a
  one-device mesh: 1), as `layouts.Paged.attend` splits them under shard_map."""
  if mesh is None or mesh.empty or mesh.size == 1:
    return 1
  mshape = dict(mesh.shape)
  return shd.entry_size(mshape, mesh_axes(mshape, slots, kv_heads)[0])


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


def write_and_attend(q, k, v, kp, vp, page_table, lengths, active, layer, *, attention: str,
                     pages_per_block: Optional[int] = None):
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
