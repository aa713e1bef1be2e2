"""The sampler engine: bucketed shapes, one prefill per distinct prompt, chunked decode with weight swaps.

    sampler = Sampler(cfg, mesh, max_prompt_len=512, max_new_tokens=1024, batch_size=256,
                      eos_id=2, decode_chunk=64)
    sampler.update_weights(params, version=0)
    out = sampler.generate(prompts, samples_per_prompt=8, strategy=Temperature(1.0), seed=0, step=3)

Prompts are left-padded into static length buckets and the row count into batch
buckets, so a new prompt length or batch size inside a bucket reuses the
compiled programs (`trace_counts` counts traces). Params are jit arguments, so
`update_weights` never recompiles; a swap between decode chunks is recorded per
token in `SampleOutput.versions` and the KV cache is recomputed under the new
weights (see `loop.refill`). Weights are held in the model's compute dtype
(`cfg.dtype`): the parameter server casts on the trainer side so fewer bytes cross.
The planner lowers the same programs through `abstract_params`, `lower_prefill`
and `lower_decode`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from typing import Callable, Optional, Sequence, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Bool, Float, Int

from rlax import models
from rlax.models import sharding as shd
from rlax.models.init import abstract_params as model_params
from rlax.sampler import loop
from rlax.sampler.strategies import SamplingMethod, Temperature

FINISH_REASONS = {loop.LENGTH: "length", loop.EOS: "eos", loop.STOP: "stop"}


@flax.struct.dataclass
class SampleOutput:
  """Rows are prompt-major: row r is sample r % G of prompt r // G. N = max_new_tokens, P = prompt bucket.

  tokens [B, N] (pad_id after the end), logprobs [B, N] behaviour log-probs (0 after the end),
  lengths [B] (EOS / stop tokens included), finish_reason [B] (loop.LENGTH / EOS / STOP),
  prompt_tokens / prompt_mask [B, P] (left-padded), versions [B, N] weight version that drew each
  token (-1 after the end), prompt_ids / sample_ids [B]; version: the newest version used.
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
  version: int = flax.struct.field(pytree_node=False, default=0)


def concat_outputs(outs: Sequence[SampleOutput]) -> SampleOutput:
  """Host (numpy) SampleOutputs → one, rows in order; `version` the newest."""
  cat = jax.tree.map(lambda *xs: np.concatenate(xs), *[o.replace(version=0) for o in outs])
  return cat.replace(version=max(o.version for o in outs))


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= 2
  return tuple(out) + (hi,)


def _bytes_per_device(shape, dtype, sharding: Optional[NamedSharding]) -> int:
  shard = sharding.shard_shape(shape) if sharding is not None else shape
  return int(np.prod(shard)) * jnp.dtype(dtype).itemsize


def _detect_budget(devices) -> int:
  stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  # CPU devices share host RAM.
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return host // max(1, len(jax.local_devices()))


class Sampler:
  """Generation engine over one (sub)mesh; see the module docstring.

  batch_size is the most rows (prompts × samples) one call may use and sizes
  the KV cache; batch_buckets / prompt_buckets default to powers of two.
  stop_sequences end a row when its last tokens equal one of them; eos_id
  (int, ints or None) ends it on that token. decode_chunk=N decodes N tokens
  per jitted call so that `update_weights` from another thread (or
  `on_chunk`) takes effect at the next chunk; None decodes in one call.
  """

  def __init__(self, cfg: models.ModelConfig, mesh: Optional[Mesh] = None, *, max_prompt_len: int,
               max_new_tokens: int, batch_size: Optional[int] = None,
               batch_buckets: Optional[Sequence[int]] = None, prompt_buckets: Optional[Sequence[int]] = None,
               stop_sequences: Sequence[Sequence[int]] = (), eos_id: Union[int, Sequence[int], None] = None,
               pad_id: int = 0, decode_chunk: Optional[int] = None, memory_budget_bytes: Optional[int] = None,
               params: Optional[models.Params] = None, version: int = 0):
    if max_prompt_len < 1 or max_new_tokens < 1:
      raise ValueError(f"max_prompt_len={max_prompt_len} and max_new_tokens={max_new_tokens} must be >= 1")
    if batch_size is None and not batch_buckets:
      raise ValueError("give batch_size or batch_buckets")
    if decode_chunk is not None and decode_chunk < 1:
      raise ValueError(f"decode_chunk must be >= 1 or None, got {decode_chunk}")
    self.cfg, self.mesh = cfg, mesh
    self.max_new_tokens, self.pad_id, self.decode_chunk = max_new_tokens, pad_id, decode_chunk
    self.batch_buckets = tuple(sorted(batch_buckets)) if batch_buckets else _pow2_buckets(1, batch_size)
    self.batch_size = self.batch_buckets[-1]
    self.prompt_buckets = (tuple(sorted(prompt_buckets)) if prompt_buckets
                           else _pow2_buckets(min(8, max_prompt_len), max_prompt_len))
    if self.prompt_buckets[-1] < max_prompt_len:
      raise ValueError(f"largest prompt bucket {self.prompt_buckets[-1]} < max_prompt_len {max_prompt_len}")
    self.max_prompt_len = self.prompt_buckets[-1]
    self.eos_ids = () if eos_id is None else tuple(np.atleast_1d(eos_id).tolist())
    self.stops = tuple(tuple(int(t) for t in s) for s in stop_sequences)
    if any(len(s) == 0 for s in self.stops):
      raise ValueError("stop sequences must be non-empty")
    self.devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    self._param_shardings = models.param_shardings(cfg, mesh) if mesh is not None else None
    self.memory = self._check_memory(memory_budget_bytes)
    cast = lambda p: jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), p)
    self._cast = jax.jit(cast, out_shardings=self._param_shardings) if mesh is not None else jax.jit(cast)
    self.trace_counts = collections.Counter()
    self.last_timings: dict[str, float] = {}
    self._weights = None
    statics = dict(eos_ids=self.eos_ids, stops=self.stops, pad_id=pad_id)
    self._prefill = jax.jit(self._traced("prefill", loop.prefill, cfg=cfg, n_new=max_new_tokens, **statics),
                            static_argnames=("samples", "strategy"))
    self._chunk = jax.jit(self._traced("decode", loop.decode_chunk, cfg=cfg, n_new=max_new_tokens, **statics),
                          static_argnames=("strategy",), donate_argnums=(1,))
    self._refill = jax.jit(self._traced("refill", loop.refill, cfg=cfg), donate_argnums=(1,))
    if params is not None:
      self.update_weights(params, version)

  def _traced(self, name, fn, *, cfg, **statics):
    """fn(first, cfg, *rest, **statics, **kw), counting traces (i.e. compiles) in trace_counts[name]."""
    def call(first, *rest, **kw):
      self.trace_counts[name] += 1  # runs at trace time only
      return fn(first, cfg, *rest, **statics, **kw)
    return call

  # -- layouts and lowerings (shared by `generate` and the planner) ------------------------------------------------
  def batch_sharding(self, ndim: int) -> Optional[NamedSharding]:
    """Sharding of every [rows, ...] array the engine feeds its programs (None without a mesh)."""
    return shd.batch_sharding(self.mesh, self.batch_size, ndim) if self.mesh is not None else None

  def abstract_params(self) -> models.Params:
    """The weights as the sampler holds them: ShapeDtypeStructs in the compute dtype on its shardings."""
    sds = lambda s, sh=None: jax.ShapeDtypeStruct(s.shape, self.cfg.jnp_dtype, sharding=sh)
    if self.mesh is None:
      return jax.tree.map(sds, model_params(self.cfg))
    return jax.tree.map(sds, model_params(self.cfg), self._param_shardings)

  def _padded_prompts(self, n: int, samples: int) -> int:
    """Prefill rows (distinct prompts, padded) for n prompts x `samples`: the batch bucket, whole shards."""
    rows = n * samples
    fits = [b for b in self.batch_buckets if b >= rows]
    if not fits or -(-fits[0] // samples) * samples > self.batch_size:
      raise ValueError(f"generate: {n} prompts x {samples} samples = {rows} rows exceed batch_size "
                       f"{self.batch_size}")
    n_pad, shards = -(-fits[0] // samples), shd.row_shards(self.mesh, self.batch_size)
    return -(-n_pad // shards) * shards  # the per-prompt prefill rows are sharded like the batch

  def _prompt_bucket(self, longest: int) -> int:
    if longest > self.max_prompt_len:
      raise ValueError(f"generate: prompt of {longest} tokens exceeds max_prompt_len {self.max_prompt_len}")
    return next(b for b in self.prompt_buckets if b >= longest)

  def _abstract(self, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.batch_sharding(len(shape)))

  def lower_prefill(self, n_prompts: int, prompt_len: int, samples: int, strategy: SamplingMethod
                    ) -> jax.stages.Lowered:
    """The prefill `generate` runs for `n_prompts` prompts of up to `prompt_len` tokens x `samples`, lowered."""
    n, L = self._padded_prompts(n_prompts, samples), self._prompt_bucket(prompt_len)
    B = n * samples
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    with self._ctx():
      return self._prefill.lower(self.abstract_params(), self._abstract((n, L), jnp.int32),
                                 self._abstract((n, L), jnp.bool_), self._abstract((B,), key_dtype), scalar,
                                 self._abstract((B,), jnp.bool_), samples=samples, strategy=strategy)

  def lower_decode(self, state, strategy: SamplingMethod) -> jax.stages.Lowered:
    """The decode chunk lowered on the state a prefill returns.

    state: a compiled prefill (`lower_prefill(...).compile()`: its output shapes and shardings), or a
    DecodeState of arrays or ShapeDtypeStructs.
    """
    if isinstance(state, jax.stages.Compiled):
      state = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh), state.out_info,
                           state.output_shardings)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    with self._ctx():
      return self._chunk.lower(self.abstract_params(), state, scalar, scalar, strategy=strategy)

  def _ctx(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _check_memory(self, budget: Optional[int]) -> dict[str, int]:
    """Per-device bytes of params + KV cache + the largest transient cache, against the budget.

    The transient is the prefill's model-layout cache, or with decode_chunk set
    the refill's whole-sequence cache after a weight swap (as big as the cache).
    """
    cfg, B, S = self.cfg, self.batch_size, self.max_prompt_len + self.max_new_tokens
    one_layer = (B, cfg.n_kv_heads, S, cfg.head_dim)  # one layer's keys (or values), as decode stores them
    csh = None
    if self.mesh is not None:
      csh = NamedSharding(self.mesh, models.spec_for(("batch", "act_kv_heads", None, None), one_layer,
                                                dict(self.mesh.shape)))
    cache = _bytes_per_device(one_layer, cfg.jnp_dtype, csh) * 2 * cfg.n_layers
    prefill = cache if self.decode_chunk else cache * self.max_prompt_len // S
    # In the compute dtype: that is what `update_weights` stores.
    params = sum(_bytes_per_device(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(self.abstract_params()))
    budget = int(budget) if budget is not None else _detect_budget(self.devices)
    need = cache + prefill + params
    if need > budget:
      raise ValueError(
          f"sampler needs {need:,} bytes per device (KV cache {cache:,} for batch {B} x {S} slots, transient "
          f"cache {prefill:,}, params {params:,}) but the memory budget is {budget:,} bytes per device")
    return dict(cache=cache, transient=prefill, params=params, budget=budget)

  def update_weights(self, params: models.Params, version: int) -> None:
    """Installs new weights (same tree and shapes) on the sampler's shardings, in the compute dtype. Thread-safe.

    Leaves in `cfg.dtype` are kept as they are (the parameter server delivers those); leaves in
    `cfg.param_dtype` are cast by a jitted cast on the sampler mesh.
    """
    want = models.param_shapes(self.cfg)
    if jax.tree.structure(params) != jax.tree.structure(want, is_leaf=lambda s: isinstance(s, tuple)):
      raise ValueError("update_weights: parameter tree does not match the sampler's model config")
    ok = {self.cfg.jnp_dtype, self.cfg.jnp_param_dtype}
    for (path, x), shape in zip(jax.tree.flatten_with_path(params)[0],
                                jax.tree.leaves(want, is_leaf=lambda s: isinstance(s, tuple))):
      if tuple(x.shape) != tuple(shape) or x.dtype not in ok:
        raise ValueError(f"update_weights: {jax.tree_util.keystr(path)} is {x.dtype}{list(x.shape)}, expected "
                         f"{' or '.join(sorted({self.cfg.dtype, self.cfg.param_dtype}))}{list(shape)}")
    if self.mesh is not None:
      params = jax.device_put(params, self._param_shardings)
    if any(x.dtype != self.cfg.jnp_dtype for x in jax.tree.leaves(params)):
      with self._ctx():
        params = self._cast(params)
    self._weights = (params, int(version))  # one assignment: readers see old or new, never a mix

  @property
  def version(self) -> Optional[int]:
    return None if self._weights is None else self._weights[1]

  def _pad_prompts(self, prompts, mask):
    """Left-aligns prompts into [n, bucket] numpy arrays (tokens, mask)."""
    if isinstance(prompts, (list, tuple)) and (not prompts or not hasattr(prompts[0], "shape") or
                                               np.ndim(prompts[0]) == 1):
      rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
    else:
      arr = np.asarray(prompts)
      if arr.ndim != 2:
        raise ValueError(f"prompts must be a list of token lists or a [P, L] array, got shape {arr.shape}")
      m = np.ones(arr.shape, bool) if mask is None else np.asarray(mask, bool)
      rows = [a[mm] for a, mm in zip(arr, m)]
    if not rows:
      raise ValueError("generate: no prompts given")
    if min(len(r) for r in rows) < 1:
      raise ValueError("generate: every prompt needs at least one token")
    L = self._prompt_bucket(max(len(r) for r in rows))
    toks = np.full((len(rows), L), self.pad_id, np.int32)
    valid = np.zeros((len(rows), L), bool)
    for i, r in enumerate(rows):
      toks[i, L - len(r):] = r
      valid[i, L - len(r):] = True
    return toks, valid

  def generate(self, prompts, *, samples_per_prompt: int = 1, strategy: SamplingMethod = Temperature(1.0),
               seed: int = 0, step: int = 0, prompt_ids: Optional[Sequence[int]] = None, prompt_mask=None,
               on_chunk: Optional[Callable[[int, int], None]] = None) -> SampleOutput:
    """Samples `samples_per_prompt` continuations of each prompt; see SampleOutput for the fields.

    prompts: list of token-id lists, or a [P, L] array (+ prompt_mask [P, L]). Row keys derive from
    (seed, step, prompt_ids[p], sample index). on_chunk(chunk_index, tokens_so_far) runs before each
    decode chunk (a hook for weight swaps in tests and controllers).
    """
    if self._weights is None:
      raise ValueError("generate: no weights; call update_weights(params, version) first")
    G = int(samples_per_prompt)
    if G < 1:
      raise ValueError(f"samples_per_prompt must be >= 1, got {G}")
    toks, valid = self._pad_prompts(prompts, prompt_mask)
    n = len(toks)
    ids = np.arange(n) if prompt_ids is None else np.asarray(prompt_ids, np.int64)
    if ids.shape != (n,):
      raise ValueError(f"prompt_ids has shape {ids.shape}, expected ({n},)")
    rows = n * G
    n_pad = self._padded_prompts(n, G)
    toks = np.concatenate([toks, np.full((n_pad - n, toks.shape[1]), self.pad_id, np.int32)])
    valid = np.concatenate([valid, np.zeros((n_pad - n, toks.shape[1]), bool)])
    ids = np.concatenate([ids, np.zeros(n_pad - n, np.int64)]).astype(np.uint32)
    B = n_pad * G
    live = np.arange(B) < rows
    sample_ids = np.tile(np.arange(G, dtype=np.uint32), n_pad)
    put = (lambda x: jax.device_put(x, self.batch_sharding(np.ndim(x)))) if self.mesh is not None else jnp.asarray
    keys = loop.row_keys(seed, step, put(np.repeat(ids, G)), put(sample_ids))
    params, ver = self._weights
    with self._ctx():
      t0 = time.perf_counter()
      st = self._prefill(params, put(toks), put(valid), keys, np.int32(ver), put(live), samples=G,
                         strategy=strategy)
      all_done = bool(jnp.all(st.done))
      t1 = time.perf_counter()
      t, chunk_i, n_refill, newest = 1, 0, 0, ver
      N = self.max_new_tokens
      while t < N and not all_done:
        t_end = N if self.decode_chunk is None else min(N, (t // self.decode_chunk + 1) * self.decode_chunk)
        if on_chunk is not None:
          on_chunk(chunk_i, t)
        params, v = self._weights
        if v != newest:
          st = self._refill(params, st)
          newest, n_refill = v, n_refill + 1
        st = self._chunk(params, st, np.int32(v), np.int32(t_end), strategy=strategy)
        all_done = bool(jnp.all(st.done))
        t, chunk_i = t_end, chunk_i + 1
      jax.block_until_ready(st.tokens)
    t2 = time.perf_counter()
    self.last_timings = dict(prefill_s=t1 - t0, decode_s=t2 - t1, chunks=chunk_i, refills=n_refill,
                             steps=int(st.t),
                             rows=rows, batch_bucket=B, prompt_bucket=toks.shape[1])
    sl = lambda x: x[:rows]
    return SampleOutput(tokens=sl(st.tokens), logprobs=sl(st.logprobs), lengths=sl(st.lengths),
                        finish_reason=sl(st.reason), prompt_tokens=sl(st.prompt),
                        prompt_mask=sl(st.prompt_mask), versions=sl(st.versions),
                        prompt_ids=jnp.asarray(np.repeat(ids[:n], G).astype(np.int32)),
                        sample_ids=jnp.asarray(sample_ids[:rows].astype(np.int32)), version=newest)

