"""The decode slots' state and the pure programs the engine compiles over it: admit, decode a chunk, extend,
recompute after a weight swap, cancel, and gather / grow (moving rows between slot counts).

A slot holds one request: its prompt (n_prompt tokens), every token after it (`tokens`: sampled, or appended
by an extension) with its log-prob, weight version and whether it was sampled, the cache (a
`rlax.sampler.layouts` layout's) of its sequence, and for a MoE model that replays routes the experts each
token of it went to when a forward fed it (`routes`, by index in the sequence: what the trainer replays).
t[s] tokens follow the prompt; the last one is fed by the next decode step, so indices 0 .. n_prompt + t - 2 are
cached. Shapes are static (S slots, P prompt columns, N new-token budget, M stop ids per slot), so nothing
recompiles in steady state.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from rlax import models
from rlax.models import moe
from rlax.sampler import rows as rows_lib
from rlax.sampler import step as step_lib
from rlax.sampler.strategies import SamplingMethod

MAX_STOP_IDS = 4  # per-slot stop tokens (an extension's `stop`) beyond the engine's eos ids


@flax.struct.dataclass
class SlotState:
  """tokens / logprobs / versions / sampled [S, N] (pad / 0 / -1 / False past a row's end); prompt [S, P]
  right-padded, n_prompt [S]; t [S] tokens after the prompt; limit [S] t at which the row stops; done [S]
  (free and held slots are done); reason [S]; last [S] the token fed next; keys [S] row keys; stop_ids [S, M]
  (-1: none); work [] slot-steps that decoded a running row; steps [] decode steps run; routes [S, P + N, L, k]
  (`moe.replayed_routes`; else None) the experts of sequence index i in layer l (moe.NO_ROUTE: not fed yet)."""
  cache: object
  prompt: jax.Array
  n_prompt: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  versions: jax.Array
  sampled: jax.Array
  t: jax.Array
  limit: jax.Array
  done: jax.Array
  reason: jax.Array
  last: jax.Array
  keys: jax.Array
  stop_ids: jax.Array
  work: jax.Array
  steps: jax.Array
  routes: object = None


def empty(cfg: models.ModelConfig, layout, slots: int, prompt_len: int, new_tokens: int, pad_id: int,
          mesh=None) -> SlotState:
  """Every slot free."""
  S, N = slots, new_tokens
  z = lambda shape, dt: jnp.zeros(shape, dt)
  return SlotState(cache=layout.init(cfg, S, mesh), prompt=z((S, prompt_len), jnp.int32), n_prompt=z((S,), jnp.int32),
                   tokens=jnp.full((S, N), pad_id, jnp.int32), logprobs=z((S, N), jnp.float32),
                   versions=jnp.full((S, N), -1, jnp.int32), sampled=z((S, N), bool), t=z((S,), jnp.int32),
                   limit=z((S,), jnp.int32), done=jnp.ones((S,), bool), reason=z((S,), jnp.int32),
                   last=z((S,), jnp.int32), keys=jax.random.split(jax.random.key(0), S),
                   stop_ids=jnp.full((S, MAX_STOP_IDS), -1, jnp.int32), work=z((), jnp.int32), steps=z((), jnp.int32),
                   routes=_no_routes(cfg, S, prompt_len + new_tokens))


def _no_routes(cfg: models.ModelConfig, rows: int, length: int):
  """[rows, length, L, k] of moe.NO_ROUTE, or None when `cfg` replays no routes."""
  shape = moe.replayed_routes(cfg)
  return None if shape is None else jnp.full((rows, length, *shape), moe.NO_ROUTE, moe.ROUTE_DTYPE)


def _put_routes(routes, rows, cols, chosen):
  """routes[rows[a], cols[a, j]] = chosen[l, a, j] (layer-major, as forwards return them) for every layer l;
  rows or cols out of range are dropped."""
  return routes.at[rows[:, None], cols].set(moe.as_routes(jnp.moveaxis(chosen, 0, 2)), mode="drop")


def record(st: SlotState, live, tok, lp, version, eos_ids: Sequence[int], stops, pad_id: int) -> SlotState:
  """Writes the drawn token t[s] of every running slot s and updates done / reason / t / last."""
  S, N = st.tokens.shape
  rows = jnp.arange(S)
  t = st.t
  tok = jnp.where(live, tok, pad_id).astype(jnp.int32)
  at = jnp.where(live, t, N)  # out of range: dropped
  tokens = st.tokens.at[rows, at].set(tok, mode="drop")
  is_eos, is_stop = rows_lib.ends(tok, tokens, t, eos_ids, stops, st.stop_ids)
  finished = live & (is_eos | is_stop | (t + 1 >= st.limit))
  reason = jnp.where(live & is_eos, rows_lib.EOS, jnp.where(live & is_stop, rows_lib.STOP, st.reason))
  return st.replace(tokens=tokens, logprobs=st.logprobs.at[rows, at].set(lp.astype(jnp.float32), mode="drop"),
                    versions=st.versions.at[rows, at].set(jnp.broadcast_to(version, (S,)).astype(jnp.int32),
                                                          mode="drop"),
                    sampled=st.sampled.at[rows, at].set(True, mode="drop"), done=st.done | finished,
                    reason=reason.astype(jnp.int32), t=jnp.where(live, t + 1, t), last=jnp.where(live, tok, st.last))


def _no_routes_like(routes, rows: int):
  return jnp.full((rows, *routes.shape[1:]), moe.NO_ROUTE, routes.dtype)


def prefill(fused, prompt, n_prompt, *, cfg: models.ModelConfig, pad_to: int):
  """Distinct prompts [Q, P] (right-padded, n_prompt [Q] tokens each) → (keys, values [L, Q, pad_to, K, Dh],
  logits after the last prompt token [Q, V], the prompt tokens' experts [L, Q, pad_to, k] or None:
  `moe.replayed_routes`); positions past P are zeros (past n_prompt, never read)."""
  zero = jnp.zeros_like(n_prompt)
  logits, k, v, routes = step_lib.forward(fused, cfg, prompt, zero, n_prompt)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, pad_to - x.shape[2])] + [(0, 0)] * (x.ndim - 3))
  return pad(k), pad(v), logits, None if moe.replayed_routes(cfg) is None else pad(moe.as_routes(routes))


def admit(st: SlotState, k, v, logits, routes, prompt, n_prompt, slot_ids, which, keys, limits, version, *,
          layout, strategy: SamplingMethod, eos_ids, stops, pad_id: int) -> SlotState:
  """Request a (prompt `which[a]` of a prefill: its keys / values / logits / tokens) takes slot slot_ids[a] (ids
  >= S are padding, dropped) and draws its token 0. A slot's old tokens past its new t are masked, never read."""
  S, N = st.tokens.shape
  sid = slot_ids
  put = lambda x, y: x.at[sid].set(y, mode="drop")
  n = n_prompt[which]
  zero = jnp.zeros_like(n)
  cache = layout.write(st.cache, sid, k[:, which], v[:, which], zero, n, n)
  A = sid.shape[0]
  P = prompt.shape[1]
  if st.routes is not None:  # the prompt's experts; its padding and every later index not fed yet
    cols = jnp.where(jnp.arange(P)[None] < n[:, None], jnp.arange(P)[None], st.routes.shape[1])
    fresh_routes = _put_routes(_no_routes_like(st.routes, A), jnp.arange(A), cols, routes[:, which])
    st = st.replace(routes=put(st.routes, fresh_routes))
  new = st.replace(
      cache=cache, prompt=put(st.prompt, prompt[which]), n_prompt=put(st.n_prompt, n),
      tokens=put(st.tokens, jnp.full((A, N), pad_id, jnp.int32)),
      logprobs=put(st.logprobs, jnp.zeros((A, N), jnp.float32)),
      versions=put(st.versions, jnp.full((A, N), -1, jnp.int32)), sampled=put(st.sampled, jnp.zeros((A, N), bool)),
      t=put(st.t, zero), limit=put(st.limit, limits.astype(jnp.int32)),
      done=put(st.done, jnp.zeros((A,), bool)), reason=put(st.reason, jnp.full((A,), rows_lib.LENGTH, jnp.int32)),
      keys=put(st.keys, keys), stop_ids=put(st.stop_ids, jnp.full((A, st.stop_ids.shape[1]), -1, jnp.int32)))
  fresh = jnp.zeros((S,), bool).at[sid].set(True, mode="drop")
  row_logits = jnp.zeros((S, logits.shape[-1]), logits.dtype).at[sid].set(logits[which], mode="drop")
  tok, lp = strategy.sample(row_logits, rows_lib.uniforms(new.keys, new.t))
  return record(new, fresh, tok, lp, version, eos_ids, stops, pad_id)


def decode_chunk(fused, st: SlotState, version, n_steps, stop_at, *, cfg: models.ModelConfig, layout,
                 strategy: SamplingMethod, eos_ids, stops, pad_id: int) -> SlotState:
  """Up to `n_steps` decode steps over all slots, stopping early once at most `stop_at` slots are running (0:
  none; the host's `Stream.stop_at` says when fewer running rows change what it would run).

  One `while_loop` per bound of the layout (`layout.bounds`): loop i runs while every running row's next
  generated index is below bound i, and attends over the cache up to it, so short rows never pay for
  attention over entries nobody has reached. fused: the weights as `params.fuse` lays them out for decoding
  (made once per weights version, `Sampler.fused`).
  """
  end_step = st.steps + n_steps
  for i, bound in enumerate(layout.bounds):

    def cond(st, bound=bound):
      live = ~st.done
      return (st.steps < end_step) & (jnp.sum(live) > stop_at) & (jnp.max(jnp.where(live, st.t - 1, -1)) < bound)

    def body(st, i=i):
      live = ~st.done
      pos = st.n_prompt + st.t - 1
      logits, cache, chosen = step_lib.decode_step(fused, cfg, layout, st.cache, st.last, pos, st.n_prompt, live,
                                                   i + 1)
      tok, lp = strategy.sample(logits, rows_lib.uniforms(st.keys, st.t))
      st = st.replace(cache=cache)
      if st.routes is not None:  # the fed tokens' experts, at their indices
        at = jnp.where(live, pos, st.routes.shape[1])[:, None]
        st = st.replace(routes=_put_routes(st.routes, jnp.arange(st.t.shape[0]), at, chosen[:, :, None]))
      st = record(st, live, tok, lp, version, eos_ids, stops, pad_id)
      return st.replace(work=st.work + jnp.sum(live).astype(jnp.int32), steps=st.steps + 1)

    st = jax.lax.while_loop(cond, body, st)
  return st


def extend(fused, st: SlotState, slot_ids, append, n_append, limits, stop_ids, version, *, cfg: models.ModelConfig,
           layout, block: int) -> SlotState:
  """Appends tokens append[a, :n_append[a]] to the stopped row in slot slot_ids[a] (ids >= S: padding) and makes
  it run again until t = limits[a]: the keys and values of its last token and of all appended tokens but the
  last are written into its cache over the cached prefix (no re-prefill), the last appended token is fed by the
  next decode step. Appended tokens are not sampled: log-prob 0, sampled False, the version in force.

  The fed tokens go through the model `block` at a time, in a loop of as many blocks as the longest append
  needs: one program serves every append length up to append's width (a multiple of `block`)."""
  S, N = st.tokens.shape
  A, M = append.shape
  assert M % block == 0, (M, block)
  sid = jnp.clip(slot_ids, 0, S - 1)
  ok = slot_ids < S
  rows = jnp.where(ok, sid, S)
  n_prompt, t = st.n_prompt[sid], st.t[sid]
  start = n_prompt + t - 1  # index of the row's last token, not yet cached
  feed = jnp.concatenate([st.last[sid][:, None], append[:, :-1]], axis=1)
  j = jnp.arange(block)[None]

  def one(i, carry):  # block i: fed tokens i * block .. (i + 1) * block - 1, over the cache written so far
    cache, routes = carry
    at, count = start + i * block, jnp.clip(n_append - i * block, 0, block)
    past = layout.past(cache, sid, n_prompt, at)
    _, k, v, chosen = step_lib.forward(fused, cfg, jax.lax.dynamic_slice_in_dim(feed, i * block, block, 1), at,
                                       count, past)
    cache = layout.write(cache, rows, k, v, at, count, n_prompt)
    if routes is not None:  # the fed tokens' experts, at their sequence indices
      routes = _put_routes(routes, rows, jnp.where(j < count[:, None], at[:, None] + j, routes.shape[1]), chosen)
    return cache, routes

  cache, routes = jax.lax.fori_loop(0, (jnp.max(n_append) + block - 1) // block, one, (st.cache, st.routes))
  cols = t[:, None] + jnp.arange(M)[None]
  cols = jnp.where(jnp.arange(M)[None] < n_append[:, None], cols, N)  # past the appended tokens: dropped
  put = lambda x, y: x.at[rows[:, None], cols].set(y, mode="drop")
  row_put = lambda x, y: x.at[rows].set(y, mode="drop")
  last = jnp.take_along_axis(append, jnp.clip(n_append - 1, 0, M - 1)[:, None], axis=1)[:, 0]
  return st.replace(
      cache=cache, routes=routes, tokens=put(st.tokens, append.astype(jnp.int32)),
      logprobs=put(st.logprobs, jnp.zeros(append.shape)),
      versions=put(st.versions, jnp.broadcast_to(version, append.shape).astype(jnp.int32)),
      sampled=put(st.sampled, jnp.zeros(append.shape, bool)), t=row_put(st.t, t + n_append),
      limit=row_put(st.limit, limits.astype(jnp.int32)), done=row_put(st.done, jnp.zeros(sid.shape, bool)),
      reason=row_put(st.reason, jnp.full(sid.shape, rows_lib.LENGTH, jnp.int32)),
      last=row_put(st.last, jnp.where(n_append > 0, last, st.last[sid])), stop_ids=row_put(st.stop_ids, stop_ids))


def recompute(fused, st: SlotState, *, cfg: models.ModelConfig, layout) -> SlotState:
  """Recomputes every slot's cached keys and values (prompt + tokens but the last) under the weights `fused`
  (laid out by `Sampler.fused`), after a weight swap: tokens drawn under version v then come from exactly the
  policy v. The recorded routes become the new forward's, the experts the cache (and every later token) now
  follows. A state with nothing cached (the warm-up's) skips the forward."""
  S, P = st.prompt.shape
  N = st.tokens.shape[1]
  count = jnp.where(st.t > 0, st.n_prompt + st.t - 1, 0)

  def forward(st):
    i = jnp.arange(P + N)[None]
    n = st.n_prompt[:, None]
    seq = jnp.where(i < n, jnp.take_along_axis(st.prompt, jnp.clip(i, 0, P - 1), axis=1),
                    jnp.take_along_axis(st.tokens, jnp.clip(i - n, 0, N - 1), axis=1))
    zero = jnp.zeros((S,), jnp.int32)
    _, k, v, chosen = step_lib.forward(fused, cfg, seq, zero, count)
    st = st.replace(cache=layout.write(st.cache, jnp.arange(S), k, v, zero, count, st.n_prompt))
    if st.routes is not None:
      st = st.replace(routes=_put_routes(st.routes, jnp.arange(S), jnp.where(i < count[:, None], i, P + N), chosen))
    return st

  return jax.lax.cond(jnp.any(count > 0), forward, lambda st: st, st)


def cancel(st: SlotState, mask) -> SlotState:
  return st.replace(done=st.done | mask)


def gather(st: SlotState, idx) -> SlotState:
  """Slots idx, in order (every array's leading axis is the slot's, the dense cache's included)."""
  return jax.tree.map(lambda x: x[idx] if x.ndim else x, st)


def grow(big: SlotState, st: SlotState) -> SlotState:
  """st's slots into the first slots of `big` (a state with more slots); scalars from st."""
  return jax.tree.map(lambda a, b: a.at[:b.shape[0]].set(b) if a.ndim else b, big, st)
