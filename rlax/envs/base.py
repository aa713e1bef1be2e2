"""The environment protocol of multi-turn episodes: the framework owns the token stream, an environment
answers each sampled turn with tokens to append (or ends the episode with a reward).

    class Env(Environment):
      async def reset(self, record) -> Observation:          # the first prompt, as tokens
      async def step(self, turn: Turn) -> StepResult:       # a reward and done, or tokens to append

One environment object serves one episode (`EpisodeStream` builds one per sample from the registry's
factory). Both methods are coroutines, so a tool call awaits its process while other rows decode. The
sampled ids are never re-encoded: `Turn.tokens` are what the policy drew, `StepResult.tokens` are appended as
given, and the training row of an episode is exactly the sampled and appended segments in order.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from rlax.envs.config import EnvConfig  # also rlax.envs.base.EnvConfig, where it used to live

# Why an episode ended (counted per step as env/stop_<reason>).
STOP_REASONS = ("final_answer", "max_turns", "max_tool_calls", "context_full", "length")
# What a tool call came to (counted per step as env/calls_<outcome>).
CALL_OUTCOMES = ("ok", "parse_error", "unknown_tool", "bad_arguments", "tool_error", "timeout", "truncated")


@dataclasses.dataclass(frozen=True)
class Observation:
  """An episode's first prompt: token ids, and the first turn's new-token limit (None: the configured turn
  length, clamped to the context left); the engine's end-of-turn ids stop it."""
  tokens: Sequence[int]
  max_new_tokens: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Turn:
  """One sampled turn: the ids the policy drew (its end token included), their behaviour log-probs and
  weight versions, why it ended ("eos", "stop", "length", "budget"), its index (0 = first), the tokens
  of context still free after it, and its key (seed, step, prompt id, sample, turn): what a resumed run
  regenerates it under (set on training episodes; None elsewhere), for journaling side effects."""
  tokens: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  finish_reason: str
  index: int
  context_left: int
  key: Optional[tuple] = None


@dataclasses.dataclass(frozen=True)
class StepResult:
  """The environment's answer to a turn. done: the episode ends with `reward` (and `stop_reason`, one of
  STOP_REASONS); else `tokens` are appended (role headers, a tool's output, the next generation header)
  and the policy samples its next turn, at most `max_new_tokens` (None: the context's rest) and also
  stopping on `stop`. `prompt` instead of `tokens`: the conversation re-rendered, for a template that is not
  append-only at this turn (one that drops earlier reasoning): the episode goes on in a new row whose prompt
  is these tokens, and trains as its rows in order, one sequence (the engine's end ids stop the new row).
  `info` is kept with the episode; `calls` lists the outcome of each tool call made this turn
  (CALL_OUTCOMES)."""
  reward: float = 0.0
  done: bool = False
  tokens: Sequence[int] = ()
  max_new_tokens: Optional[int] = None
  stop: Sequence[int] = ()
  stop_reason: str = ""
  calls: Sequence[str] = ()
  info: dict = dataclasses.field(default_factory=dict)
  prompt: Sequence[int] = ()

  def __post_init__(self):
    if self.done and self.stop_reason and self.stop_reason not in STOP_REASONS:
      raise ValueError(f"StepResult.stop_reason={self.stop_reason!r}: use one of {', '.join(STOP_REASONS)}")
    bad = [c for c in self.calls if c not in CALL_OUTCOMES]
    if bad:
      raise ValueError(f"StepResult.calls has {bad[0]!r}: use one of {', '.join(CALL_OUTCOMES)}")
    if len(self.prompt) and (len(self.tokens) or len(self.stop)):
      raise ValueError("StepResult: a re-rendered `prompt` starts a new row; it takes neither `tokens` to "
                       "append nor `stop` ids")
    if not self.done and not len(self.tokens) and not len(self.prompt):
      raise ValueError("StepResult: an episode that goes on needs tokens to append (at least the next "
                       "turn's generation header) or a re-rendered prompt")


class Environment(abc.ABC):
  """One episode's environment; see the module docstring."""

  @abc.abstractmethod
  async def reset(self, record: Any) -> Observation:
    ...

  @abc.abstractmethod
  async def step(self, turn: Turn) -> StepResult:
    ...

  def metrics(self) -> dict[str, float]:
    """The ended episode's own numbers (a search environment's searches, recall); each is averaged over the
    episodes that report it and logged per step as env/<name>."""
    return {}


@dataclasses.dataclass(frozen=True)
class EnvContext:
  """What an environment is built with: the tokenizer, the run's prompt renderer (rlax.data.prompts), the
  reward function, `grade(fn, texts, records) -> [(reward, info)]` (the verifier pool's), the verifier pool
  itself (for tools: rlax.envs.tools.ToolRunner), the run's `env` config section, its tool-result
  journal (rlax.envs.journal.ToolJournal; None: no journal) and its one retrieval service
  (rlax.envs.retrieval.RetrievalService; None where env.retriever is unset)."""
  tokenizer: Any
  render: Any
  reward_fn: Any
  grade: Any
  pool: Any
  config: "EnvConfig"
  journal: Any = None
  retrieval: Any = None
