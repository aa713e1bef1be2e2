"""One-shot tasks as one-turn episodes: where every single-turn run's rollouts come from.

    make = single_turn_episodes(render, reward_fn, grade)   # as rlax.builders.episodes builds for env.name ""
    with make(sampler.stream(method), sync=True) as eps:
      done = eps.run(records, samples_per_prompt=8, seed=0, step=s)   # [FinishedEpisodes], record order

An episode's one turn is the reply to the run's rendered prompt, and its reward is the run's reward on it:
`SingleTurnEnv`'s episode. Run here without an environment object per sample, because a turn that ends the
episode needs none of what `EpisodeStream` keeps for the next one: rows are not held (a group's slots free as
its rows stop, for the next prompts to take) and the replies are graded in one `grade` call per step (per
`run`: once, after every group stopped) rather than one per sample. So a single-turn run samples and grades
exactly as a plain stream does, at its speed.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from rlax.envs.episodes import FinishedEpisodes
from rlax.rewards import results
from rlax.sampler import concat_outputs
from rlax.sampler.rows import LENGTH


class OneTurnEpisodes:
  """`EpisodeStream`'s interface over a sampler stream for one-turn episodes; see the module docstring.
  `grade(reward_fn, texts, records) -> [(reward, info)]` (the verifier pool's)."""

  def __init__(self, stream, render, reward_fn, grade: Callable):
    self.stream, self.render, self.reward_fn, self.grade = stream, render, reward_fn, grade
    self.reward_s = 0.0  # seconds spent grading (in the caller's thread, between decode chunks)

  @property
  def pending(self) -> int:
    return self.stream.pending

  def close(self) -> None:
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def submit(self, records: Sequence, *, samples_per_prompt: int = 1, seed: int = 0, step: int = 0,
             prompt_ids: Optional[Sequence[int]] = None, tags: Optional[Sequence] = None) -> list:
    """Queues G samples of each record's rendered prompt; returns the tags."""
    tags = list(range(len(records))) if tags is None else list(tags)
    self.stream.submit(self.render.encode_all(records), samples_per_prompt=samples_per_prompt, seed=seed,
                       step=step, prompt_ids=prompt_ids, tags=list(zip(tags, records)))
    return tags

  def step(self) -> list[FinishedEpisodes]:
    """Decodes one chunk; returns the groups that stopped, graded."""
    return self._graded(self.stream.step())

  def run(self, records: Sequence, **submit) -> list[FinishedEpisodes]:
    """Every episode of `records` to its end; groups in record order."""
    tags = self.submit(records, tags=range(len(records)), **submit)
    done = {}
    while self.stream.pending:
      done.update((f.tag[0], f) for f in self.stream.step())
    return self._graded([done[t] for t in tags])

  def cancel_older(self, version: int) -> list:
    return [tag for tag, _ in self.stream.cancel_older(version)]

  def timings(self) -> dict:
    return self.stream.timings()

  def stats(self, episodes: Sequence[dict]) -> dict[str, float]:
    """No env/* step metrics (a one-turn episode has no turns, tool calls or appended tokens to count); the
    reward's own (`results.metrics`: a judge's)."""
    return results.metrics(e.get("info") for e in episodes)

  def _graded(self, finished: Sequence) -> list[FinishedEpisodes]:
    if not finished:
      return []
    t0 = time.perf_counter()
    out = concat_outputs([f.out for f in finished])
    toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = [self.render.tokenizer.decode(t[:n]) for t, n in zip(toks, lens)]
    records = [f.tag[1] for f in finished for _ in range(len(f.out.lengths))]
    graded = self.grade(self.reward_fn, texts, records)
    res, i = [], 0
    for f in finished:
      G = len(f.out.lengths)
      # float64 as graded: held-out means stay exact; the producer trains on float32.
      rewards = np.array([g[0] for g in graded[i:i + G]], np.float64)
      episodes = [dict(turns=1, rows=1, calls=[], appended=0, tokens=int(n), info=info,
                       stop="length" if int(r) == LENGTH else "final_answer")
                  for (_, info), n, r in zip(graded[i:i + G], f.out.lengths, f.out.finish_reason)]
      res.append(FinishedEpisodes(f.tag[0], f.out, rewards, episodes, None))
      i += G
    self.reward_s += time.perf_counter() - t0
    return res


def single_turn_episodes(render, reward_fn, grade: Callable) -> Callable[..., OneTurnEpisodes]:
  """The episodes factory of a single-turn run, `make(stream, sync, keys)` as `rlax.builders.episodes` builds
  for a configured environment: each sample a one-turn episode of `render`'s prompt, rewarded by `reward_fn`
  through `grade` (a `VerifierPool.grade`); its `close` and `check_prompts` have nothing to do (the rendered
  prompt is the one `train_and_eval_records` measured; no service to stop)."""

  def make(stream, sync: bool = False, keys: bool = False) -> OneTurnEpisodes:
    del sync, keys  # graded as it stops, in order; no tool call to journal
    return OneTurnEpisodes(stream, render, reward_fn, grade)

  make.close = lambda: None
  make.check_prompts = lambda records: None
  return make
