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
the static engine's segments (`decode.segments`); a decode step writes each slot's new key and value at
its own position with a scatter and attends over the segments that any running row has reached.
"""

from __future__ import annotations

import collections
import contextlib
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
from rlax.sampler import decode, loop
from rlax.sampler.engine import SampleOutput, Sampler, _pow2_buckets
from rlax.sampler.strategies import SamplingMethod, Temperature


@flax.struct.dataclass
class SlotState:
  """S slots, P prompt positions, N new-token budget (see the module docstring for the cache layout).

  tokens / logprobs / versions [S, N] (pad / 0 / -1 past a row's end); t [S] tokens drawn so far;
  limit [S] the request's max new tokens; done [S] (free slots are done); last [S] the token fed next;
  work [] slot-steps that decoded a running row; steps [] decode steps run (utilization).
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


def _attend(q, pk, pv, gks, gvs, prompt_valid, g, starts):
  """q [S, K, Gh, Dh] over the slot's prompt and generated segments; generated slots <= g[s] are valid."""
  Dh = q.shape[-1]
  f32 = jnp.float32
  qf = q.astype(f32) / math.sqrt(Dh)
  sp = jnp.sum(qf[..., None] * pk.astype(f32)[:, :, None], axis=3)  # [S, K, Gh, P]
  scores = [jnp.where(prompt_valid[:, None, None, :], sp, layers.NEG)]
  for gk, a in zip(gks, starts):
    sg = jnp.sum(qf[..., None] * gk.astype(f32)[:, :, None], axis=3)  # [S, K, Gh, n_i]
    ok = (a + jnp.arange(gk.shape[-1]))[None] <= g[:, None]
    scores.append(jnp.where(ok[:, None, None, :], sg, layers.NEG))
  p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(pv.dtype)
  P = sp.shape[-1]
  return decode.add_segment_values(jnp.sum(p[..., :P, None] * pv[:, :, None], axis=3), p, gvs, P)


def _decode_step(fused, cfg: models.ModelConfig, st: SlotState, live, n_seg: int):
  """Feeds every slot's last token (written at its own generated slot t-1); attends over segments < n_seg."""
  S = st.last.shape[0]
  H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  dt = cfg.jnp_dtype
  N = st.tokens.shape[1]
  segs = decode.segments(N)
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
                  st.prompt_valid, g, starts[:n_seg])
      return o.astype(dt).reshape(S, 1, H, Dh)

    x = layers.block(cfg, w, x, pos[:, None], inv_freq, attend)
  x = layers.rms_norm(x[:, 0], fused["final_norm"], cfg.norm_eps)
  logits = jnp.dot(x, fused["lm_head"], preferred_element_type=jnp.float32)
  return logits, st.replace(gk=tuple(map(tuple, gks)), gv=tuple(map(tuple, gvs)))


def decode_steps(params, cfg: models.ModelConfig, st: SlotState, version, n_steps, *, strategy: SamplingMethod,
                 eos_ids, stops, pad_id: int) -> SlotState:
  """Up to `n_steps` decode steps over all slots, stopping early once no slot is running.

  One `while_loop` per generated segment: loop i runs while every running row's next write lands in
  segments 0..i, so short rows never pay for attention over slots nobody has reached.
  """
  fused = decode.fuse_params(params, cfg)
  segs = decode.segments(st.tokens.shape[1])
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
  pk = tuple(put(st.pk[l], k[l][which].transpose(0, 2, 3, 1)) for l in range(L))
  pv = tuple(put(st.pv[l], v[l][which].transpose(0, 2, 1, 3)) for l in range(L))
  A = sid.shape[0]
  new = st.replace(
      pk=pk, pv=pv, prompt=put(st.prompt, prompt[which]), prompt_valid=put(st.prompt_valid, prompt_mask[which]),
      n_prompt=put(st.n_prompt, jnp.sum(prompt_mask[which], axis=1).astype(jnp.int32)),
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
  new = decode.from_model_cache(mc, P, 1, N)
  return st.replace(pk=new.pk, pv=new.pv, gk=new.gk, gv=new.gv)


class ContinuousSampler:
  """Continuous-batching generation over one (sub)mesh; see the module docstring.

  slots: rows decoded at once (a multiple of the largest samples_per_prompt used, and of the mesh's
  row shards). decode_chunk: decode steps between admissions (and weight swaps). on_swap: "recompute"
  or "keep" (the unfinished rows' cache after a weight swap).
  """

  def __init__(self, cfg: models.ModelConfig, mesh: Optional[Mesh] = None, *, max_prompt_len: int,
               max_new_tokens: int, slots: int, stop_sequences: Sequence[Sequence[int]] = (),
               eos_id: Union[int, Sequence[int], None] = None, pad_id: int = 0, decode_chunk: int = 16,
               on_swap: str = "recompute", memory_budget_bytes: Optional[int] = None,
               params: Optional[models.Params] = None, version: int = 0):
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
    self.decode_chunk, self.on_swap = decode_chunk, on_swap
    self.eos_ids, self.stops = self._static.eos_ids, self._static.stops
    self.memory = self._static.memory
    self.trace_counts = collections.Counter()
    self.last_timings: dict = {}
    statics = dict(eos_ids=self.eos_ids, stops=self.stops, pad_id=pad_id)
    with_cfg = lambda fn: lambda params, *rest, **kw: fn(params, cfg, *rest, **kw)
    self._prefill = jax.jit(self._traced("prefill", with_cfg(prefill)))
    self._admit = jax.jit(self._traced("admit", admit, **statics), static_argnames=("strategy",),
                          donate_argnums=(0,))
    self._chunk = jax.jit(self._traced("decode", with_cfg(decode_steps), **statics),
                          static_argnames=("strategy",), donate_argnums=(1,))
    self._recompute = jax.jit(self._traced("recompute", with_cfg(recompute)), donate_argnums=(1,))
    if params is not None:
      self.update_weights(params, version)

  def _traced(self, name, fn, **statics):
    """fn(*args, **statics, **kw), counting traces (i.e. compiles) in trace_counts[name]."""
    def call(*args, **kw):
      self.trace_counts[name] += 1  # runs at trace time only
      return fn(*args, **statics, **kw)
    return call

  def update_weights(self, params: models.Params, version: int) -> None:
    """Installs new weights (validated and cast like the static engine). Thread-safe."""
    self._static.update_weights(params, version)

  @property
  def version(self) -> Optional[int]:
    return self._static.version

  def _ctx(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _empty(self) -> SlotState:
    cfg, S, P, N = self.cfg, self.slots, self.max_prompt_len, self.max_new_tokens
    K, Dh, dt = cfg.n_kv_heads, cfg.head_dim, cfg.jnp_dtype
    segs = decode.segments(N)
    z = lambda shape, dtype: jnp.zeros(shape, dtype)
    st = SlotState(
        pk=tuple(z((S, K, Dh, P), dt) for _ in range(cfg.n_layers)),
        pv=tuple(z((S, K, P, Dh), dt) for _ in range(cfg.n_layers)),
        gk=tuple(tuple(z((S, K, Dh, b - a), dt) for a, b in segs) for _ in range(cfg.n_layers)),
        gv=tuple(tuple(z((S, K, b - a, Dh), dt) for a, b in segs) for _ in range(cfg.n_layers)),
        prompt=z((S, P), jnp.int32), prompt_valid=z((S, P), bool), n_prompt=z((S,), jnp.int32),
        tokens=jnp.full((S, N), self.pad_id, jnp.int32), logprobs=z((S, N), jnp.float32),
        versions=jnp.full((S, N), -1, jnp.int32), t=z((S,), jnp.int32), limit=z((S,), jnp.int32),
        done=jnp.ones((S,), bool), reason=z((S,), jnp.int32), last=z((S,), jnp.int32),
        keys=jax.random.split(jax.random.key(0), S), work=z((), jnp.int32), steps=z((), jnp.int32))
    if self.mesh is None:
      return st
    return jax.device_put(st, jax.tree.map(lambda x: shd.batch_sharding(self.mesh, S, x.ndim) if x.ndim else
                                           NamedSharding(self.mesh, jax.sharding.PartitionSpec()), st))

  def generate(self, prompts, *, samples_per_prompt: int = 1, strategy: SamplingMethod = Temperature(1.0),
               seed: int = 0, step: int = 0, prompt_ids: Optional[Sequence[int]] = None, prompt_mask=None,
               max_new_tokens: Union[int, Sequence[int], None] = None,
               on_chunk: Optional[Callable[[int, int], None]] = None) -> SampleOutput:
    """Same contract as `Sampler.generate`, plus per-request limits.

    max_new_tokens: None (the engine's budget), an int, or one limit per row (prompt-major, n × G).
    on_chunk(chunk_index, tokens_of_finished_rows) runs before each decode chunk.
    """
    if self.version is None:
      raise ValueError("generate: no weights; call update_weights(params, version) first")
    G = int(samples_per_prompt)
    if G < 1 or self.slots % G:
      raise ValueError(f"samples_per_prompt={G} must be >= 1 and divide slots={self.slots}")
    toks, valid = self._static._pad_prompts(prompts, prompt_mask)  # pylint: disable=protected-access
    n = len(toks)  # one prompt bucket (max_prompt_len): the slot state never changes shape
    ids = np.arange(n) if prompt_ids is None else np.asarray(prompt_ids, np.int64)
    if ids.shape != (n,):
      raise ValueError(f"prompt_ids has shape {ids.shape}, expected ({n},)")
    R, N = n * G, self.max_new_tokens
    limits = np.asarray(N if max_new_tokens is None else max_new_tokens, np.int64)
    if limits.ndim and limits.shape != (R,):
      raise ValueError(f"generate: max_new_tokens has {limits.size} entries, expected one per row ({n} prompts x "
                       f"{G} samples = {R})")
    limits = np.broadcast_to(limits, (R,)).copy()
    if limits.min() < 1 or limits.max() > N:
      raise ValueError(f"generate: max_new_tokens must lie in [1, {N}] (the engine's budget), got "
                       f"{limits.min()}..{limits.max()}")
    keys = np.asarray(jax.random.key_data(loop.row_keys(seed, step, jnp.asarray(np.repeat(ids, G).astype(np.uint32)),
                                                        jnp.asarray(np.tile(np.arange(G), n).astype(np.uint32)))))
    out_tok = np.full((R, N), self.pad_id, np.int32)
    out_lp = np.zeros((R, N), np.float32)
    out_ver = np.full((R, N), -1, np.int32)
    out_len = np.zeros(R, np.int32)
    out_reason = np.zeros(R, np.int32)
    owner = np.full(self.slots, -1)  # row held by each slot
    queue = collections.deque(range(n))
    groups = self.slots // G
    q_buckets = _pow2_buckets(1, groups)
    t0 = time.perf_counter()
    n_chunks = n_swaps = 0
    with self._ctx():
      st = self._empty()
      params, ver = self._static._weights  # pylint: disable=protected-access
      newest = ver
      while queue or (owner >= 0).any():
        free = np.flatnonzero(owner < 0)
        take = min(len(free) // G, len(queue))
        if take:
          q = next(b for b in q_buckets if b >= take)
          which_p = [queue.popleft() for _ in range(take)]
          sel = np.asarray(which_p + [which_p[0]] * (q - take))
          k, v, logits = self._prefill(params, jnp.asarray(toks[sel]), jnp.asarray(valid[sel]))
          A = q * G
          slot_ids = np.full(A, self.slots, np.int32)  # padding: dropped
          slot_ids[:take * G] = free[:take * G]
          rows = np.concatenate([np.arange(p * G, p * G + G) for p in which_p] + [np.zeros(A - take * G, np.int64)])
          which = np.repeat(np.arange(q), G)
          st = self._admit(st, k, v, logits, jnp.asarray(toks[sel]), jnp.asarray(valid[sel]),
                           jnp.asarray(slot_ids), jnp.asarray(which, np.int32),
                           jax.random.wrap_key_data(jnp.asarray(keys[rows])),
                           jnp.asarray(limits[rows].astype(np.int32)), np.int32(newest), strategy=strategy)
          owner[free[:take * G]] = rows[:take * G]
        if on_chunk is not None:
          on_chunk(n_chunks, int(out_len.sum()))
        params, v_now = self._static._weights  # pylint: disable=protected-access
        if v_now != newest:
          if self.on_swap == "recompute":
            st = self._recompute(params, st)
          newest, n_swaps = v_now, n_swaps + 1
        st = self._chunk(params, st, np.int32(newest), np.int32(self.decode_chunk), strategy=strategy)
        n_chunks += 1
        done = np.asarray(st.done)
        fin = np.flatnonzero(done & (owner >= 0))
        if len(fin):
          r = owner[fin]
          out_tok[r], out_lp[r], out_ver[r] = (np.asarray(st.tokens)[fin], np.asarray(st.logprobs)[fin],
                                               np.asarray(st.versions)[fin])
          out_len[r], out_reason[r] = np.asarray(st.t)[fin], np.asarray(st.reason)[fin]
          owner[fin] = -1
      work, steps = int(st.work), int(st.steps)
    self.last_timings = dict(total_s=time.perf_counter() - t0, chunks=n_chunks, swaps=n_swaps, decode_steps=steps,
                             slot_utilization=work / max(1, steps * self.slots), rows=R)
    pt = np.repeat(toks, G, axis=0)
    return SampleOutput(tokens=jnp.asarray(out_tok), logprobs=jnp.asarray(out_lp), lengths=jnp.asarray(out_len),
                        finish_reason=jnp.asarray(out_reason), prompt_tokens=jnp.asarray(pt),
                        prompt_mask=jnp.asarray(np.repeat(valid, G, axis=0)), versions=jnp.asarray(out_ver),
                        prompt_ids=jnp.asarray(np.repeat(ids, G).astype(np.int32)),
                        sample_ids=jnp.asarray(np.tile(np.arange(G), n).astype(np.int32)), version=newest)
