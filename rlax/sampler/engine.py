"""The sampling engine: continuous batching over a fixed number of decode slots.

    sampler = Sampler(cfg, mesh, max_prompt_len=512, max_new_tokens=1024, slots=64, eos_id=2)
    sampler.update_weights(params, version=0)
    out = sampler.generate(prompts, samples_per_prompt=8, seed=0, step=3, max_new_tokens=limits)

Every slot holds one request (prompt, sample index) with its own position and limit. Between decode chunks,
finished rows are copied out and whole groups of queued requests take the free slots: the G samples of a
prompt share one prefill, whose keys and values are written into their G slots. A uniform batch (every row
admitted at once, one limit) is the case where no slot is ever refilled. When nothing is queued, the running
rows move to fewer slots (the dense layout's shrink; `Stream`). Shapes are static (slots, prompt length,
new-token budget, admission buckets), so nothing recompiles in steady state (`trace_counts`).

The cache layout (`rlax.sampler.layouts`) is "dense" (XLA:CPU-shaped, with ragged attention over the later
generated segments) or "paged" (a page pool; on TPU jax's Pallas paged-attention kernel): `attention="auto"`
takes "paged" on a TPU the kernel compiles for, else "dense". Both run the same decode step, prefill and token
record, so both draw the same tokens. A weight swap between chunks is recorded per token in `versions`;
`on_swap="recompute"` recomputes every slot's keys and values under the new weights (tokens drawn under version
v come from exactly the policy v), `"keep"` continues over the old cache.

The engine holds no weights: a `Stream` reads them at every step from a source (the run's `WeightsService`,
or `update_weights`' own one). The planner lowers the same programs (`lower_admit`, `lower_decode`), which every
engine of the process that runs them shares (`rlax.sampler.programs`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax import models
from rlax.models import moe
from rlax.models import sharding as shd
from rlax.sampler import layouts
from rlax.sampler import params as params_lib
from rlax.sampler import programs
from rlax.sampler import prompts as prompts_lib
from rlax.sampler import warmup
from rlax.sampler import sizing
from rlax.sampler import slots as slots_lib
from rlax.sampler.rows import SampleOutput, concat_outputs
from rlax.sampler.strategies import SamplingMethod, Temperature
from rlax.weights.service import WeightsService

class Sampler:
  """Continuous-batching generation over one (sub)mesh; see the module docstring.

  slots: rows decoded at once (a multiple of every samples_per_prompt used, and of the mesh's row shards).
  decode_chunk: decode steps between admissions (and weight swaps). on_swap: "recompute" or "keep". shrink:
  once no request waits, decode the running rows on fewer slots (dense layout only: the paged pool is not laid
  out by slot). admit_factor: admissions are padded to 1, f, f^2, ... prompts (a prefill program each: a larger
  factor compiles fewer of them and pads more). prompt_factor: 0, every prefill runs at max_prompt_len; else at
  the smallest of 32, 32 f, ..., max_prompt_len tokens that holds the admission's longest prompt (a program
  each, all warmed up; its keys and values padded to max_prompt_len, so one admission program). eos_id (int,
  ints or None) and stop_sequences end a row.
  weights: the WeightsService streams read by default (its own, made empty; params=... publishes version
  `version` to it).
  """

  def __init__(self, cfg: models.ModelConfig, mesh: Optional[Mesh] = None, *, max_prompt_len: int,
               max_new_tokens: int, slots: int, stop_sequences: Sequence[Sequence[int]] = (),
               eos_id: Union[int, Sequence[int], None] = None, pad_id: int = 0, decode_chunk: int = 16,
               on_swap: str = "recompute", shrink: bool = True, memory_budget_bytes: Optional[int] = None,
               params: Optional[models.Params] = None, version: int = 0, attention: str = "auto",
               page_size: Optional[int] = None, weights: Optional[WeightsService] = None,
               admit_factor: int = warmup.ADMIT_FACTOR, prompt_factor: int = 0):
    if max_prompt_len < 1 or max_new_tokens < 1:
      raise ValueError(f"max_prompt_len={max_prompt_len} and max_new_tokens={max_new_tokens} must be >= 1")
    if page_size is not None and page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    if on_swap not in ("recompute", "keep"):
      raise ValueError(f"on_swap must be 'recompute' or 'keep', got {on_swap!r}")
    if admit_factor < 2 or prompt_factor not in (0, *range(2, 65)):
      raise ValueError(f"admit_factor={admit_factor} must be >= 2 and prompt_factor={prompt_factor} 0 or 2..64")
    if decode_chunk < 1:
      raise ValueError(f"decode_chunk must be >= 1, got {decode_chunk}")
    shards = shd.row_shards(mesh, slots) if mesh is not None else 1
    if slots < 1 or slots % shards:
      raise ValueError(f"slots={slots} must be a positive multiple of the mesh's {shards} row shards")
    self.stops = tuple(tuple(int(t) for t in s) for s in stop_sequences)
    if any(len(s) == 0 for s in self.stops):
      raise ValueError("stop sequences must be non-empty")
    self.eos_ids = () if eos_id is None else tuple(np.atleast_1d(eos_id).tolist())
    self.cfg, self.mesh, self.slots = cfg, mesh, slots
    self.max_prompt_len, self.max_new_tokens, self.pad_id = max_prompt_len, max_new_tokens, pad_id
    self.devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    platform = self.devices[0].platform
    self.layout = layouts.make_layout(cfg, attention, max_prompt_len, max_new_tokens, page_size, platform)
    self.paged = isinstance(self.layout, layouts.Paged)
    self.attention = ("dense" if not self.paged else "paged_interpret" if self.layout.attention == "interpret"
                      else "paged")
    self.decode_chunk, self.on_swap = decode_chunk, on_swap
    self.sizes = warmup.sizes(slots, shards, paged=self.paged, on_swap=on_swap, max_prompt_len=max_prompt_len,
                              max_new_tokens=max_new_tokens, shrink=shrink, admit_factor=admit_factor,
                              prompt_factor=prompt_factor)
    self.memory = sizing.sampler_memory(cfg, self.layout, slots, max_prompt_len + max_new_tokens, mesh)
    self.memory["budget"] = sizing.budget_or_default(memory_budget_bytes, self.devices)
    sizing.check({k: v for k, v in self.memory.items() if k != "budget"}, self.memory["budget"], slots,
                 max_prompt_len + max_new_tokens)
    self.placer = params_lib.Placer(cfg, mesh)
    self._traces: dict = {}  # id -> (program name, its shared trace count, the count when this engine took it)
    self.last_timings: dict = {}
    statics = dict(eos_ids=self.eos_ids, stops=self.stops, pad_id=pad_id)
    lay = dict(layout=self.layout)
    self._prefills: dict[int, Callable] = {}
    self._admit = self._jit("admit", functools.partial(slots_lib.admit, **lay, **statics), static=("strategy",),
                            donate=(0,))
    self._decode = self._jit("decode", functools.partial(slots_lib.decode_chunk, cfg=cfg, **lay, **statics),
                             static=("strategy",), donate=(1,))
    stacked, joined = params_lib.fused_layout(cfg, self.layout, platform)
    self.fused = params_lib.Fused(cfg, self._jit, stacked=stacked, joined=joined, ctx=self.ctx)
    self._recompute = self._jit("recompute", functools.partial(slots_lib.recompute, cfg=cfg, **lay), donate=(1,))
    self._extend = self._jit("extend", functools.partial(slots_lib.extend, cfg=cfg, **lay), static=("block",),
                             donate=(1,))
    self._gather = self._jit("shrink", slots_lib.gather)
    self._cancel = self._jit("cancel", slots_lib.cancel, donate=(0,))
    self._grow = self._jit("grow", slots_lib.grow, donate=(0,))
    self._states: dict[int, tuple] = {}
    self.weights = weights if weights is not None else WeightsService()
    if params is not None:
      self.update_weights(params, version)

  def _jit(self, name: str, fn, *, static=(), donate=(), out_shardings=None):
    """jit(fn), shared by the process's engines (rlax.sampler.programs); its traces count in trace_counts."""
    jitted, traces = programs.get(name, fn, static=static, donate=donate, out_shardings=out_shardings)
    self._traces.setdefault(id(traces), (name, traces, traces[0]))
    return jitted

  @property
  def trace_counts(self) -> collections.Counter:
    """Traces since this engine was built of the programs it runs, by name (by any engine sharing them:
    rlax.sampler.programs): the warm-up's, then nothing."""
    return +sum((collections.Counter({n: t[0] - t0}) for n, t, t0 in self._traces.values()), collections.Counter())

  def _prefill(self, groups: int):
    """The prefill of `groups` prompts, its outputs on fixed shardings (prompts over the batch axes, KV heads
    over 'tensor', as the rules table allows): the admission's inputs are then the same at lowering and at run."""
    if groups not in self._prefills:
      out = None if self.mesh is None else self._prefill_shardings(groups)
      self._prefills[groups] = self._jit("prefill", functools.partial(
          slots_lib.prefill, cfg=self.cfg, pad_to=self.max_prompt_len), out_shardings=out)
    return self._prefills[groups]

  def _prefill_shardings(self, groups: int) -> tuple:
    cfg, shape = self.cfg, dict(self.mesh.shape)
    kv = (cfg.n_layers, groups, self.max_prompt_len, cfg.n_kv_heads, cfg.head_dim)
    ns = lambda axes, dims: NamedSharding(self.mesh, models.spec_for(axes, dims, shape))
    kv_sh = ns((None, "batch", None, "act_kv_heads", None), kv)
    routes = moe.replayed_routes(cfg)
    routes_sh = None if routes is None else ns((None, "batch", None, None), (routes[0], groups, self.max_prompt_len,
                                                                             routes[1]))
    return kv_sh, kv_sh, ns(("batch", "act_vocab"), (groups, cfg.vocab_size)), routes_sh

  # -- weights ---------------------------------------------------------------------------------------------------
  def update_weights(self, params: models.Params, version: int) -> None:
    """Validates `params`, puts them on the sampler's shardings in the compute dtype, and publishes them as
    `version` (newer than any before) to the engine's WeightsService. Thread-safe."""
    self.weights.publish(self.placer(params), int(version))

  @property
  def version(self) -> Optional[int]:
    """The newest version of the engine's WeightsService (None before any)."""
    return None if self.weights.version < 0 else self.weights.version

  def weights_source(self, weights=None) -> Callable[[], tuple]:
    """A () -> (params, version) for a stream: `weights` as given (a WeightsService, such a callable, or one
    (params, version) pair), else the engine's own service."""
    if weights is None:
      if self.version is None:
        raise ValueError("generate: no weights; call update_weights(params, version) first")
      return self.weights.latest
    if isinstance(weights, tuple):
      return lambda: weights
    return weights.latest if hasattr(weights, "latest") else weights

  # -- programs (the Stream's steps; each a compiled call) ----------------------------------------------------------
  def ctx(self):
    """The engine's mesh as the ambient mesh (every program runs under it)."""
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def empty(self, slots: Optional[int] = None) -> slots_lib.SlotState:
    """A state with every slot free, built by one compiled call."""
    S = slots or self.slots
    build = functools.partial(slots_lib.empty, self.cfg, self.layout, S, self.max_prompt_len, self.max_new_tokens,
                              self.pad_id, self.mesh)
    with self.ctx():
      return programs.get("empty", build, out_shardings=self.state_shardings(S))[0]()

  def _state(self, S: int) -> tuple:
    """(shapes, shardings or None) of an S-slot state: traced once a size (every gather and grow places one)."""
    if S not in self._states:
      shapes = jax.eval_shape(functools.partial(slots_lib.empty, self.cfg, self.layout, S, self.max_prompt_len,
                                                self.max_new_tokens, self.pad_id))
      sh = None if self.mesh is None else jax.tree.map(
          lambda x: shd.batch_sharding(self.mesh, S, x.ndim) if x.ndim else NamedSharding(self.mesh, PartitionSpec()),
          shapes.replace(cache=None)).replace(cache=self.layout.shardings(self.cfg, self.mesh, S))
      self._states[S] = shapes, sh
    return self._states[S]

  def state_shardings(self, slots: Optional[int] = None) -> slots_lib.SlotState:
    """Slot rows over the mesh's row shards (scalars replicated); the cache as its layout shards it."""
    return self._state(slots or self.slots)[1]

  def put(self, x) -> jax.Array:
    """A host input of an admission or extension (prompts, slot ids, keys, ...) on the engine's devices, replicated
    (what `lower_admit` lowers with)."""
    if self.mesh is None:
      return jnp.asarray(x)
    return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec()))

  def place(self, st: slots_lib.SlotState) -> slots_lib.SlotState:
    return st if self.mesh is None else jax.device_put(st, self.state_shardings(st.t.shape[0]))

  def prefill(self, params, prompt, n_prompt):
    """Distinct prompts [Q, P <= max_prompt_len] (right-padded) → keys, values [L, Q, max_prompt_len, K, Dh],
    next-token logits [Q, V], the prompts' experts [L, Q, max_prompt_len, k] (None unless routes are replayed)."""
    return self._prefill(prompt.shape[0])(self.fused(params), prompt, n_prompt)

  def admit(self, st, prefilled, prompt, n_prompt, slot_ids, which, keys, limits, version, strategy):
    return self._admit(st, *prefilled, prompt, n_prompt, slot_ids, which, keys, limits, version, strategy=strategy)

  def admission(self, params, st, prompts, n_prompt, slot_ids, keys, limits, version: int, strategy):
    """Prefills `prompts` [q, P] (host) and admits their G rows each into `slot_ids` [q G] (>= S: padding), rows
    drawing with key data `keys` [q G, ...] up to `limits` [q G] tokens: the admission `Stream` runs."""
    G = len(slot_ids) // len(prompts)
    prompts, n_prompt = np.asarray(prompts, np.int32), np.asarray(n_prompt, np.int32)
    P = prompts_lib.bucket(max(1, int(n_prompt.max())), self.prompt_buckets)  # the prefill's width
    toks, n_prompt = self.put(prompts), self.put(n_prompt)
    which = self.put(np.repeat(np.arange(len(prompts)), G).astype(np.int32))
    prefilled = self.prefill(params, self.put(prompts[:, :P]), n_prompt)
    return self.admit(st, prefilled, toks, n_prompt, self.put(np.asarray(slot_ids, np.int32)),
                      which, jax.random.wrap_key_data(self.put(keys)), self.put(np.asarray(limits, np.int32)),
                      np.int32(version), strategy)

  def extension(self, params, st, slot_ids, appends, limits, stops, version: int):
    """Appends appends[a] (token lists) to the stopped rows in slots slot_ids[a], which then decode up to
    limits[a] with stops[a] as extra stop ids: one compiled call, rows padded to `extend_buckets`, the appended
    tokens fed in blocks (`warmup.extend_block`)."""
    rows, blocks = self.extend_buckets()
    A = prompts_lib.bucket(len(slot_ids), rows)
    block = warmup.extend_block(blocks, max([1] + [len(x) for x in appends]))
    ids = np.full(A, st.t.shape[0], np.int32)  # padding: dropped
    append = np.zeros((A, warmup.extend_width(block, self.max_new_tokens)), np.int32)
    n_append, lim = np.zeros(A, np.int32), np.zeros(A, np.int32)
    stop_ids = np.full((A, slots_lib.MAX_STOP_IDS), -1, np.int32)
    for a, (slot, toks, limit, stop) in enumerate(zip(slot_ids, appends, limits, stops)):
      ids[a], append[a, :len(toks)], n_append[a], lim[a] = slot, toks, len(toks), limit
      stop_ids[a, :len(stop)] = stop
    return self._extend(self.fused(params), st, *map(self.put, (ids, append, n_append, lim, stop_ids)),
                        np.int32(version), block=block)

  def extend_buckets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return self.sizes.extend_buckets()

  def warm_up_calls(self, uses, *, extend: bool = False) -> list[tuple]:
    """`warm_up`'s calls (rlax.sampler.warmup.Sizes.calls) for these (samples per group, strategy) uses."""
    return self.sizes.calls(uses, extend=extend)

  def warm_up(self, params, uses, *, extend: bool = False) -> None:
    """Runs every program a stream can call on empty states (each returns at once), so that a run compiles them
    before its first batch rather than in the middle of one. uses: the (samples per group, strategy) pairs the
    run samples with; admissions are of `group_buckets(G)` groups; extend: a multi-turn run's extensions too."""
    warmup.run(self, params, self.warm_up_calls(uses, extend=extend))

  def group_buckets(self, samples: int) -> tuple[int, ...]:
    return self.sizes.group_buckets(samples)

  @property
  def shrink(self) -> bool:
    return self.sizes.shrink

  @property
  def slot_buckets(self) -> tuple[int, ...]:
    return self.sizes.slot_buckets

  @property
  def prompt_buckets(self) -> tuple[int, ...]:
    return self.sizes.prompt_widths

  def decode(self, params, st, version, strategy, stop_at: int = 0):
    """One chunk: up to `decode_chunk` decode steps, ending once at most `stop_at` slots are running."""
    return self._decode(self.fused(params), st, np.int32(version), np.int32(self.decode_chunk), np.int32(stop_at),
                        strategy=strategy)

  def recompute(self, params, st):
    return self._recompute(self.fused(params), st)

  # The index and mask arguments are cast to host arrays here: a device array's sharding is part of a program's
  # key, so the warm-up's and a stream's calls would otherwise compile twice.
  def cancel(self, st, mask):
    return self._cancel(st, np.asarray(mask, bool))

  def gather(self, st, idx):
    return self.place(self._gather(st, np.asarray(idx, np.int32)))

  def grow(self, st):
    """st's rows in the first slots of a full-size state."""
    return self.place(self._grow(self.empty(), st))

  # -- lowerings for the planner -----------------------------------------------------------------------------------
  def abstract_params(self) -> models.Params:
    """The weights as the sampler holds them: ShapeDtypeStructs in the compute dtype on its shardings."""
    return params_lib.abstract(self.cfg, self.mesh)

  def abstract_state(self, slots: Optional[int] = None) -> slots_lib.SlotState:
    """ShapeDtypeStructs (with shardings on a mesh) of the slot state `empty` builds."""
    shapes, sh = self._state(slots or self.slots)
    return shapes if sh is None else jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                                                  shapes, sh)

  def lower_decode(self, strategy: SamplingMethod, slots: Optional[int] = None) -> jax.stages.Lowered:
    """The decode chunk `Stream.step` runs, lowered on `abstract_state(slots)`."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    with self.ctx():
      return self._decode.lower(self.abstract_fused(), self.abstract_state(slots), scalar, scalar, scalar,
                                strategy=strategy)

  def abstract_fused(self):
    """ShapeDtypeStructs of `fused`'s output: every sampler program's weights."""
    return self.fused.abstract(self.abstract_params())

  def lower_fuse(self) -> jax.stages.Lowered:
    """The weights every program reads, made from a new version (`fused`), lowered."""
    return self.fused.lower(self.abstract_params())

  def lower_recompute(self) -> jax.stages.Lowered:
    """The recompute after a weight swap (`on_swap="recompute"`), lowered on `abstract_state()`."""
    with self.ctx():
      return self._recompute.lower(self.abstract_fused(), self.abstract_state())

  def lower_admit(self, groups: int, samples: int, strategy: SamplingMethod) -> dict[str, jax.stages.Lowered]:
    """The prefill of `groups` prompts and the admission of their `samples` rows each, lowered:
    {"prefill": ..., "admit": ...}."""
    rep = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rep)
    key = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), groups * samples))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    with self.ctx():
      prefill = self._prefill(groups)
      pre = prefill.lower(self.abstract_fused(), i32(groups, self.max_prompt_len), i32(groups))
      outs = pre.out_info
      if self.mesh is not None:
        outs = tuple(None if o is None else jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh)
                     for o, sh in zip(outs, self._prefill_shardings(groups)))
      A = groups * samples
      adm = self._admit.lower(self.abstract_state(), *outs, i32(groups, self.max_prompt_len), i32(groups),
                              i32(A), i32(A), key, i32(A), jax.ShapeDtypeStruct((), jnp.int32), strategy=strategy)
    return {"prefill": pre, "admit": adm}

  # -- sessions ----------------------------------------------------------------------------------------------------
  def stream(self, strategy: SamplingMethod = Temperature(1.0), *, weights=None,
             on_chunk: Optional[Callable[[int, int], None]] = None):
    """An open session: `submit` groups at any time, `step` decodes and returns the groups that finished.
    weights: see `weights_source`."""
    from rlax.sampler.stream import Stream  # pylint: disable=g-import-not-at-top
    return Stream(self, strategy, self.weights_source(weights), on_chunk)

  def generate(self, prompts, *, samples_per_prompt: int = 1, strategy: SamplingMethod = Temperature(1.0),
               seed: int = 0, step: int = 0, prompt_ids: Optional[Sequence[int]] = None, prompt_mask=None,
               max_new_tokens: Union[int, Sequence[int], None] = None, weights=None,
               on_chunk: Optional[Callable[[int, int], None]] = None) -> SampleOutput:
    """Samples `samples_per_prompt` continuations of each prompt; see SampleOutput for the fields.

    prompts: token-id lists, or a [P, L] array (+ prompt_mask). Row keys derive from (seed, step,
    prompt_ids[p], sample index). max_new_tokens: None (the engine's budget), an int, or one limit per row
    (prompt-major). on_chunk(chunk_index, tokens_of_finished_rows) runs before each decode chunk.
    """
    stream = self.stream(strategy, weights=weights, on_chunk=on_chunk)
    n = len(stream.submit(prompts, samples_per_prompt=samples_per_prompt, seed=seed, step=step,
                          prompt_ids=prompt_ids, prompt_mask=prompt_mask, max_new_tokens=max_new_tokens))
    done = {}
    while stream.pending:
      done.update((g.tag, g.out) for g in stream.step())
    self.last_timings = stream.timings()
    return jax.tree.map(jnp.asarray, concat_outputs([done[i] for i in range(n)]))

