"""Multi-turn episodes on the sampling stream: each sample of a prompt group is an episode whose row holds
its slot and KV cache between turns; an environment answers each turn while other rows decode.

    episodes = EpisodeStream(sampler.stream(method, weights=...), make_env, context_tokens=..., turn_tokens=...)
    episodes.submit(records, samples_per_prompt=8, seed=0, step=s, prompt_ids=[...], tags=[...])
    while episodes.pending:
      for group in episodes.step():   # FinishedEpisodes(tag, out: SampleOutput of G rows, rewards [G], episodes)
        ...

A row's tokens after the prompt are its turns and the environment's appended tokens, in order: the sampled
ids verbatim (`sampled` True, with their behaviour log-probs and per-token weight versions), the appended ids
as given (`sampled` False, log-prob 0), so `rollout.packing.pack` trains on exactly what was sampled.
An environment whose template is not append-only at a turn answers with the re-rendered conversation
(`StepResult.prompt`): the episode goes on in a new row after that prompt, and `FinishedEpisodes` gives it as
one training row all the same, its rows in order with `forks` marking where each new row starts (the
packer gives each its own attention segment: after the episode's first prompt when the new prompt extends
it, else alone), so advantages, REINFORCE++ returns and staleness stay per episode.
`env.step` runs on an asyncio loop in a thread of its own, so tool calls (in the verifier processes) overlap
the decoding of other rows. With `sync=True` every turn's answer is applied before the next decode chunk,
so the schedule, and with it every token, is a function of the tokens alone (deterministic runs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from rlax.envs.base import CALL_OUTCOMES, STOP_REASONS, Environment, StepResult, Turn
from rlax.models import moe
from rlax.rewards import results
from rlax.sampler import concat_outputs
from rlax.sampler.rows import FINISH_REASONS, SampleOutput


# forks: what starts a new row of an episode in its training row.
CONTINUES, AFTER_PROMPT, ALONE = 0, 1, 2


@dataclasses.dataclass
class _Episode:
  env: Environment
  prompt_len: int        # of its current row
  row: int = -1          # the stream's request id of its current row (known after the row's first turn)
  start: int = 0         # tokens after the row's prompt where the next turn starts
  offset: int = 0        # where the current row's tokens start in the episode's training row
  parts: list = dataclasses.field(default_factory=list)  # earlier rows (host outputs), each followed by a fork
  forks: list = dataclasses.field(default_factory=list)  # (position, AFTER_PROMPT or ALONE, new prompt tokens)
  turns: int = 0
  appended: int = 0
  calls: list = dataclasses.field(default_factory=list)
  done: bool = False
  reward: float = 0.0
  stop: str = ""
  info: dict = dataclasses.field(default_factory=dict)
  future: Optional[concurrent.futures.Future] = None


@dataclasses.dataclass
class _Group:
  key: int                # its tag on the stream
  tag: Any
  episodes: list
  prompt: list            # the first prompt
  left: int               # episodes not done
  ident: tuple = ()       # (seed, step, prompt id): with the sample and turn, a turn's Turn.key
  oldest: Optional[int] = None  # the weight version of its first token


@dataclasses.dataclass
class FinishedEpisodes:
  """A prompt group whose episodes all ended: `out` its G training rows (sample order), `rewards` [G], per
  episode a dict of turns, rows, tool-call outcomes, stop reason, appended and total token counts, and info,
  and `forks` [G, N] (N: out's response width): AFTER_PROMPT or ALONE where a new row of the episode starts
  (its re-rendered prompt's tokens past the first prompt, or all of them, then its turns), else 0; None from
  a source whose episodes are one row each (rlax.envs.one_turn)."""
  tag: Any
  out: SampleOutput
  rewards: np.ndarray
  episodes: list
  forks: np.ndarray


class EpisodeStream:
  """See the module docstring. make_env() builds one Environment per episode; context_tokens bounds prompt +
  turns (clamped to the engine's prompt + new-token budget); turn_tokens caps one turn's new tokens; keys: give
  each Turn its key (training episodes, whose tool calls are journaled)."""

  def __init__(self, stream, make_env: Callable[[], Environment], *, context_tokens: int = 0, turn_tokens: int = 0,
               sync: bool = False, keys: bool = False):
    self.stream, self.make_env, self.sync, self.keys = stream, make_env, sync, keys
    e = stream.e
    self.budget = min(context_tokens or (e.max_prompt_len + e.max_new_tokens), e.max_prompt_len + e.max_new_tokens)
    self.turn_tokens = turn_tokens or e.max_new_tokens
    self._groups: dict[int, _Group] = {}
    self._waiting: dict[int, tuple[_Group, _Episode]] = {}  # row → its episode, awaiting env.step
    self._next = 0
    self.reward_s = 0.0  # environments grade on their own loop, overlapping the decode: that time is in gen_s
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="episode-envs")
    self._thread.start()

  @property
  def pending(self) -> int:
    """Groups submitted and not yet returned."""
    return len(self._groups)

  def close(self) -> None:
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=10)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _run(self, coros: Sequence) -> list:
    async def gather():
      return await asyncio.gather(*coros)
    return asyncio.run_coroutine_threadsafe(gather(), self._loop).result()

  def _room(self, ep: _Episode, t: int) -> int:
    """Tokens of context left for an episode whose current row has t tokens after its prompt (the row's
    context, and the episode's training row within the engine's new-token width)."""
    return min(self.budget - ep.prompt_len - t, self.stream.e.max_new_tokens - ep.offset - t)

  def submit(self, records: Sequence, *, samples_per_prompt: int = 1, seed: int = 0, step: int = 0,
             prompt_ids: Optional[Sequence[int]] = None, tags: Optional[Sequence] = None) -> list:
    """Resets G environments per record and queues the group (their first prompts must agree); returns the tags."""
    G, tags = int(samples_per_prompt), list(range(len(records))) if tags is None else list(tags)
    ids = list(range(len(records))) if prompt_ids is None else list(prompt_ids)
    for rec, tag, pid in zip(records, tags, ids):
      envs = [self.make_env() for _ in range(G)]
      obs = self._run([env.reset(rec) for env in envs])
      prompt = [int(x) for x in obs[0].tokens]
      if any([int(x) for x in o.tokens] != prompt for o in obs[1:]):
        raise ValueError(f"env.reset gave different first prompts for the {G} samples of record "
                         f"{getattr(rec, 'id', rec)!r}; an episode group needs one prompt")
      if not 0 < len(prompt) <= self.stream.e.max_prompt_len:
        raise ValueError(f"env.reset: the first prompt of record {getattr(rec, 'id', rec)!r} has {len(prompt)} "
                         f"tokens; rollout.max_prompt_len is {self.stream.e.max_prompt_len}")
      key, self._next = self._next, self._next + 1
      g = self._groups[key] = _Group(key, tag, [_Episode(env, len(prompt)) for env in envs], prompt, G,
                                     (int(seed), int(step), int(pid)))
      room = self._room(g.episodes[0], 0)
      if room < 1:
        raise ValueError(f"env.context_tokens={self.budget} leaves no room after a {len(prompt)}-token prompt")
      limits = [min(o.max_new_tokens or self.turn_tokens, room) for o in obs]
      self.stream.submit([prompt], samples_per_prompt=G, seed=seed, step=step, prompt_ids=[pid],
                         max_new_tokens=limits, tags=[key], hold=True)
    return tags

  # -- turns ----------------------------------------------------------------------------------------------------
  def _on_turn(self, f) -> None:
    """A row stopped: its new tokens are a turn; hand it to its environment."""
    r, out = f.requests[0], f.out
    key, i = f.tag if isinstance(f.tag, tuple) else (f.tag, int(out.sample_ids[0]))  # a later row: (group, sample)
    if key not in self._groups:  # a later row of a group cancelled meanwhile
      self.stream.release(r)
      return
    g = self._groups[key]
    ep = g.episodes[i]
    ep.row, t = r, int(out.lengths[0])
    if g.oldest is None:
      g.oldest = int(out.versions[0, 0])
    s = ep.start
    turn = Turn(tokens=out.tokens[0, s:t].copy(), logprobs=out.logprobs[0, s:t].copy(),
                versions=out.versions[0, s:t].copy(), finish_reason=FINISH_REASONS[int(out.finish_reason[0])],
                index=ep.turns, context_left=self._room(ep, t), key=(*g.ident, i, ep.turns) if self.keys else None)
    ep.turns, ep.start = ep.turns + 1, t
    ep.future = asyncio.run_coroutine_threadsafe(ep.env.step(turn), self._loop)
    self._waiting[r] = (g, ep)

  def _ready(self) -> list[int]:
    return sorted(r for r, (_, ep) in self._waiting.items() if ep.future.done())

  def _apply(self, rows: Sequence[int]) -> list[FinishedEpisodes]:
    finished = []
    for r in rows:
      g, ep = self._waiting.pop(r)
      try:
        res: StepResult = ep.future.result()
      except Exception as e:  # an environment's own bug: the run stops and says where
        raise RuntimeError(f"{type(ep.env).__name__}.step raised {type(e).__name__}: {e}") from e
      ep.calls += list(res.calls)
      if not res.done and len(res.prompt):
        if self._split(g, ep, r, res):
          continue
        res = StepResult(done=True, stop_reason="context_full")
      if not res.done:
        limit = min(res.max_new_tokens or self.turn_tokens, self._room(ep, ep.start) - len(res.tokens))
        if limit >= 1 and self.stream.extend(r, res.tokens, max_new_tokens=limit, stop=res.stop):
          ep.appended, ep.start = ep.appended + len(res.tokens), ep.start + len(res.tokens)
          continue
        res = StepResult(done=True, stop_reason="context_full")
      ep.reward, ep.stop, ep.info, ep.done = float(res.reward), res.stop_reason, dict(res.info), True
      g.left -= 1
      if not g.left:
        finished.append(self._finish(g))
    return finished

  def _split(self, g: _Group, ep: _Episode, r: int, res: StepResult) -> bool:
    """Ends row r of episode `ep` and queues its next row after the re-rendered `res.prompt`; False (nothing
    changed) when the prompt or one more token does not fit."""
    e, new = self.stream.e, [int(x) for x in res.prompt]
    n0 = len(g.prompt)
    kind, extra = (AFTER_PROMPT, new[n0:]) if len(new) > n0 and new[:n0] == g.prompt else (ALONE, new)
    at = ep.offset + ep.start
    limit = min(res.max_new_tokens or self.turn_tokens, self.budget - len(new), e.max_new_tokens - at - len(extra))
    if len(new) > e.max_prompt_len or limit < 1:
      return False
    ep.parts.append(self.stream.output(r))
    self.stream.release(r)
    ep.forks.append((at, kind, extra))
    ep.offset, ep.prompt_len, ep.start, ep.row = at + len(extra), len(new), 0, -1
    ep.appended += len(extra)
    seed, step, pid = g.ident
    i = g.episodes.index(ep)  # its row keys: (seed, step, prompt id, a sample number past the group's)
    self.stream.submit([new], samples_per_prompt=1, seed=seed, step=step, prompt_ids=[pid], max_new_tokens=[limit],
                       tags=[(g.key, i)], hold=True, first_sample=len(g.episodes) * len(ep.parts) + i)
    return True

  def _training_row(self, ep: _Episode) -> tuple[SampleOutput, np.ndarray]:
    """The episode as one row (its rows' tokens in order, each new prompt's tokens between them) and its
    forks [1, N]."""
    last = self.stream.output(ep.row)
    forks = np.zeros((1, self.stream.e.max_new_tokens), np.int32)
    if not ep.parts:
      return last, forks
    arrays = {k: np.array(getattr(last, k)) for k in ("tokens", "logprobs", "versions", "sampled")}
    parts, first = ep.parts + [last], ep.parts[0]
    # A MoE sampler's routes: the first row's prompt, then each row's tokens; a new prompt's extra tokens were
    # fed (and routed) as the last prompt tokens of the row after them.
    routes, P = None if first.routes is None else np.array(first.routes), self.stream.e.max_prompt_len
    at = 0
    for j, part in enumerate(parts):
      n = int(part.lengths[0])
      for k, a in arrays.items():
        a[0, at:at + n] = np.asarray(getattr(part, k))[0, :n]
      if routes is not None:
        routes[0, P + at:P + at + n] = part.routes[0, P:P + n]
      at += n
      if j == len(ep.forks):
        break
      _, kind, extra = ep.forks[j]
      m = len(extra)
      if routes is not None:
        routes[0, P + at:P + at + m] = parts[j + 1].routes[0, P - m:P]
      arrays["tokens"][0, at:at + m], arrays["logprobs"][0, at:at + m] = extra, 0.0
      arrays["versions"][0, at:at + m], arrays["sampled"][0, at:at + m] = arrays["versions"][0, max(at - 1, 0)], False
      forks[0, at] = kind
      at += m
    for k in arrays:
      rest = {"tokens": self.stream.e.pad_id, "logprobs": 0.0, "versions": -1, "sampled": False}[k]
      arrays[k][0, at:] = rest
    if routes is not None:
      routes[0, P + at:] = moe.NO_ROUTE
      arrays["routes"] = routes
    return first.replace(**arrays, lengths=np.array([at], np.int32), finish_reason=last.finish_reason,
                         version=max(p.version for p in parts)), forks

  def _finish(self, g: _Group) -> FinishedEpisodes:
    rows = [self._training_row(ep) for ep in g.episodes]
    out = concat_outputs([o for o, _ in rows])
    for ep in g.episodes:
      self.stream.release(ep.row)
    del self._groups[g.key]
    stats = [dict(turns=ep.turns, rows=len(ep.parts) + 1, calls=list(ep.calls), stop=ep.stop, appended=ep.appended,
                  tokens=int(out.lengths[i]), info=ep.info, metrics=ep.env.metrics())
             for i, ep in enumerate(g.episodes)]
    return FinishedEpisodes(g.tag, out, np.array([ep.reward for ep in g.episodes], np.float32), stats,
                            np.concatenate([f for _, f in rows]))

  def _can_decode(self) -> bool:
    st = self.stream
    if st.running:
      return True
    return bool(st.queued) and int((st.owner < 0).sum()) >= st.queue[0].samples

  def step(self) -> list[FinishedEpisodes]:
    """Applies the environments' answers that are in, decodes one chunk (or, with nothing to decode, waits for
    an answer), and returns the groups whose episodes all ended. With sync, every answer is applied (in row
    order) before the next chunk."""
    if self.sync and self._waiting:
      concurrent.futures.wait([ep.future for _, ep in self._waiting.values()])
    done = self._apply(self._ready())
    if self._can_decode():
      for f in self.stream.step():
        self._on_turn(f)
    elif self._waiting:
      concurrent.futures.wait([ep.future for _, ep in self._waiting.values()],
                              return_when=concurrent.futures.FIRST_COMPLETED)
    elif self._groups:
      raise RuntimeError(f"episodes: {len(self._groups)} group(s) pending with nothing decoding, queued or "
                         "awaiting an environment")
    return done if self.sync else done + self._apply(self._ready())

  def cancel_older(self, version: int) -> list:
    """Ends the groups whose first tokens were drawn with weights older than `version` (their rows freed,
    their environments' pending answers dropped); returns their tags."""
    freed = set()  # (group, sample) whose current row the stream freed: it was decoding with older weights
    for t in self.stream.cancel_older(version):
      if isinstance(t, tuple):
        freed.add(t)
      elif t in self._groups:
        freed |= {(t, i) for i, ep in enumerate(self._groups[t].episodes) if not ep.parts}
    tags = []
    for key, g in list(self._groups.items()):
      if key not in {k for k, _ in freed} and (g.oldest is None or g.oldest >= version):
        continue
      for i, ep in enumerate(g.episodes):
        held = ep.done or (ep.row >= 0 and ep.row in self._waiting)
        if ep.row >= 0 and self._waiting.pop(ep.row, None) is not None:
          ep.future.cancel()
        if held and (key, i) not in freed:
          self.stream.release(ep.row)
        # a row still decoding or queued is released when it stops (`_on_turn`: its group is gone)
      del self._groups[key]
      tags.append(g.tag)
    return tags

  def timings(self) -> dict:
    return self.stream.timings()

  def stats(self, episodes: Sequence[dict]) -> dict[str, float]:
    """Step metrics over these episodes (`batch_stats`)."""
    return batch_stats(episodes)

  def run(self, records: Sequence, **submit) -> list[FinishedEpisodes]:
    """Every episode of `records` to its end; groups in record order."""
    tags = self.submit(records, tags=range(len(records)), **submit)
    out = {}
    while self.pending:
      for f in self.step():
        out[f.tag] = f
    return [out[t] for t in tags]


def batch_stats(episodes: Sequence[dict]) -> dict[str, float]:
  """Step metrics over episodes: turns, rows and tool calls per episode, the share of each stop reason and call
  outcome, the valid-tool-call rate, the share of appended (not sampled) tokens in the responses, and each of
  the environments' own metrics (Environment.metrics) averaged over the episodes that report it, and the reward's."""
  n = max(1, len(episodes))
  calls = [c for e in episodes for c in e["calls"]]
  tokens = sum(e["tokens"] for e in episodes)
  out = {"env/turns": sum(e["turns"] for e in episodes) / n, "env/rows": sum(e.get("rows", 1) for e in episodes) / n,
         "env/tool_calls": len(calls) / n,
         "env/valid_call_rate": sum(c in ("ok", "truncated") for c in calls) / max(1, len(calls)),
         "env/appended_share": sum(e["appended"] for e in episodes) / max(1, tokens)}
  for s in STOP_REASONS:
    out[f"env/stop_{s}"] = sum(e["stop"] == s for e in episodes) / n
  for c in CALL_OUTCOMES:
    out[f"env/calls_{c}"] = float(sum(x == c for x in calls))
  out.update(results.mean_fields((e.get("metrics") or {} for e in episodes), "env/"))
  out.update(results.metrics(e.get("info") for e in episodes))  # the reward's own (a judge's)
  return out


def rewards_fn(make: Callable, sampler, method, *, seed: int, weights=None) -> Callable:
  """`rewards(records, n) -> [len(records), n]` episode rewards over the sampler (held-out evaluation of any
  task); `make(stream, sync)` as `rlax.builders.episodes` or `single_turn_episodes` returns. `rewards.episodes`
  collects every episode's stats, `rewards.lengths` its (tokens, truncated: it ran out of room);
  `rewards.stats()` the episodes' metrics as their source reports them."""
  calls, report = [0], []

  def rewards(records: Sequence, n: int) -> np.ndarray:
    with make(sampler.stream(method, weights=weights), sync=True) as eps:
      done = eps.run(records, samples_per_prompt=n, seed=seed, step=0,
                     prompt_ids=list(range(calls[0], calls[0] + len(records))))
    report[:] = [eps.stats]
    calls[0] += len(records)
    rewards.episodes += [e for f in done for e in f.episodes]
    rewards.lengths += [(e["tokens"], e["stop"] in ("length", "context_full")) for f in done for e in f.episodes]
    return np.stack([f.rewards for f in done])

  rewards.episodes, rewards.lengths = [], []
  rewards.stats = lambda: report[0](rewards.episodes) if report else {}
  return rewards
