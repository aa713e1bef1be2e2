"""Jit-friendly sampling state and the pure functions the engine compiles: prefill, decode chunk, refill.

All functions here are pure and shape-static; `rlax.sampler.engine.Sampler`
jits them per (batch bucket, prompt bucket, samples per prompt, strategy).
Token t of a row (t = 0 comes from the prefill logits) is drawn with the
uniform number of key fold_in(row_key, t), so outputs are addressable.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from rlax import models
from rlax.sampler import decode
from rlax.sampler.strategies import SamplingMethod

LENGTH, EOS, STOP = 0, 1, 2  # finish reasons


@flax.struct.dataclass
class DecodeState:
  """Everything the decode loop carries. B rows, P prompt slots, N max new tokens.

  tokens/logprobs/versions: [B, N] (pad / 0 / -1 after a row is done);
  prompt, prompt_mask: [B, P]; done, reason, lengths, n_prompt (valid prompt
  tokens): [B]; t: [] tokens generated so far; last: [B] the last token (fed
  at the next step); row_keys: [B] typed PRNG keys.
  """
  cache: decode.LayerCache
  prompt: jax.Array
  prompt_mask: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  versions: jax.Array
  done: jax.Array
  reason: jax.Array
  lengths: jax.Array
  n_prompt: jax.Array
  last: jax.Array
  t: jax.Array
  row_keys: jax.Array


@functools.lru_cache(maxsize=64)
def _base_key(seed: int, step: int) -> jax.Array:
  # Outside jit: a Python seed may use all 64 bits.
  return jax.random.fold_in(jax.random.key(seed), step)


@jax.jit
def _fold_rows(base, prompt_ids, sample_ids):
  return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))(prompt_ids, sample_ids)


def row_keys(seed, step, prompt_ids, sample_ids):
  """key(seed) → fold_in step → fold_in prompt id → fold_in sample index, one key per row.

  One compiled call per row count (a stream submits prompt by prompt; op-by-op this cost ~5 ms a prompt).
  """
  return _fold_rows(_base_key(int(seed), int(step)), prompt_ids, sample_ids)


def uniforms(keys, t):
  """One uniform in (0, 1] per row for its token t (a scalar, or one index per row)."""
  u = jax.vmap(lambda k, tt: jax.random.uniform(jax.random.fold_in(k, tt), ()))(keys, jnp.broadcast_to(t, keys.shape))
  return 1.0 - u


def ends(tok, tokens, t, eos_ids: Sequence[int], stops: Sequence[Sequence[int]]):
  """(is_eos, is_stop) per row for `tok`, just written at index t (a scalar or one per row) of tokens [B, N]."""
  is_eos = jnp.zeros(tok.shape, bool)
  for e in eos_ids:
    is_eos |= tok == e
  is_stop = jnp.zeros(tok.shape, bool)
  for seq in stops:
    m = len(seq)
    idx = jnp.clip(jnp.reshape(t, (-1, 1)) - m + 1 + jnp.arange(m)[None], 0, tokens.shape[1] - 1)
    window = jnp.take_along_axis(tokens, jnp.broadcast_to(idx, (tokens.shape[0], m)), axis=1)
    is_stop |= (t + 1 >= m) & jnp.all(window == jnp.asarray(seq, jnp.int32)[None], axis=1)
  return is_eos, is_stop


def _record(st: DecodeState, tok, lp, version, eos_ids: Sequence[int], stops: Sequence[Sequence[int]],
            n_new: int, pad_id: int) -> DecodeState:
  """Writes token t for rows still running and updates done / reason / lengths."""
  t = st.t
  live = ~st.done
  tok = jnp.where(live, tok, pad_id).astype(jnp.int32)
  tokens = jax.lax.dynamic_update_slice(st.tokens, tok[:, None], (0, t))
  logprobs = jax.lax.dynamic_update_slice(st.logprobs, jnp.where(live, lp, 0.0)[:, None], (0, t))
  ver = jnp.where(live, version, -1).astype(jnp.int32)
  versions = jax.lax.dynamic_update_slice(st.versions, ver[:, None], (0, t))
  is_eos, is_stop = ends(tok, tokens, t, eos_ids, stops)
  finished = live & (is_eos | is_stop | (t + 1 >= n_new))
  reason = jnp.where(live & is_eos, EOS, jnp.where(live & is_stop, STOP, st.reason))
  return st.replace(tokens=tokens, logprobs=logprobs, versions=versions, done=st.done | finished,
                    reason=reason.astype(jnp.int32), lengths=jnp.where(live, t + 1, st.lengths),
                    last=tok, t=t + 1)


def prefill(params, cfg: models.ModelConfig, prompt, prompt_mask, keys, version, row_live, *, samples: int,
            n_new: int, strategy: SamplingMethod, eos_ids, stops, pad_id: int) -> DecodeState:
  """Prefills the distinct prompts [Pb, P] once, repeats each cache row `samples` times, draws token 0.

  keys, row_live: [Pb * samples] (dead rows are batch padding and start done).
  """
  Pb, P = prompt.shape
  h, mc = models.hidden_states(params, cfg, prompt, input_mask=prompt_mask, cache=models.init_cache(cfg, Pb, P))
  logits = models.logits_from_hidden(params, cfg, h[:, -1:])[:, 0]
  rep = lambda x: jnp.repeat(x, samples, axis=0)
  cache = decode.constrain_cache(decode.from_model_cache(mc, P, samples, n_new))
  B = Pb * samples
  st = DecodeState(
      cache=cache, prompt=rep(prompt), prompt_mask=rep(prompt_mask), tokens=jnp.full((B, n_new), pad_id, jnp.int32),
      logprobs=jnp.zeros((B, n_new), jnp.float32), versions=jnp.full((B, n_new), -1, jnp.int32),
      done=~row_live, reason=jnp.full((B,), LENGTH, jnp.int32), lengths=jnp.zeros((B,), jnp.int32),
      n_prompt=rep(jnp.sum(prompt_mask, axis=1).astype(jnp.int32)), last=jnp.zeros((B,), jnp.int32),
      t=jnp.zeros((), jnp.int32), row_keys=keys)
  tok, lp = strategy.sample(rep(logits), uniforms(keys, 0))
  return _record(st, tok, lp, version, eos_ids, stops, n_new, pad_id)


def decode_chunk(params, cfg: models.ModelConfig, st: DecodeState, version, t_end, *, n_new: int,
                 strategy: SamplingMethod, eos_ids, stops, pad_id: int) -> DecodeState:
  """Decodes tokens st.t .. t_end-1, exiting early once every row is done.

  One `while_loop` per cache segment (see `decode.segments`): token t is drawn
  after feeding token t-1 into generated slot t-1, so the loop for segment
  [a, b) runs while a < t <= b.
  """
  fused = decode.fuse_params(params, cfg)
  for i, (_, end) in enumerate(decode.segments(n_new)):

    def cond(st, end=end):
      return (st.t < t_end) & (st.t <= end) & ~jnp.all(st.done)

    def body(st, i=i):
      logits, cache = decode.decode_step(fused, cfg, st.cache, st.last, st.n_prompt + st.t - 1, st.t - 1, i)
      tok, lp = strategy.sample(logits, uniforms(st.row_keys, st.t))
      return _record(st.replace(cache=cache), tok, lp, version, eos_ids, stops, n_new, pad_id)

    st = jax.lax.while_loop(cond, body, st)
  return st


def refill(params, cfg: models.ModelConfig, st: DecodeState) -> DecodeState:
  """Recomputes the whole KV cache (prompt + tokens so far) under `params`, after a weight swap.

  Keeps the sampler's promise that tokens drawn under version v are drawn from
  exactly the policy v (the log-probs the trainer recomputes), not from a mix
  of new weights over keys/values cached by the old ones.
  """
  B, P = st.prompt.shape
  n_new = st.tokens.shape[1]
  G = st.cache.samples
  seq = jnp.concatenate([st.prompt, st.tokens], axis=1)
  # The last sampled token is fed by the next decode step, so slots up to P + t - 2 hold cache.
  in_cache = jnp.arange(P + n_new) < P + st.t - 1
  mask = jnp.concatenate([st.prompt_mask, jnp.ones((B, n_new), bool)], axis=1) & in_cache[None]
  _, mc = models.hidden_states(params, cfg, seq, input_mask=mask, cache=models.init_cache(cfg, B, P + n_new))
  new = decode.from_model_cache(mc, P, G, n_new, prompt_rows=slice(None, None, G))
  return st.replace(cache=decode.constrain_cache(new.replace(prompt_valid=st.cache.prompt_valid)))
