"""The `rollout` config section: how many samples a step draws, their lengths, and how they are sampled."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Per step: `prompts_per_step` prompts x `samples_per_prompt` samples; lengths and sampling method."""
  prompts_per_step: int = 16
  samples_per_prompt: int = 8
  max_prompt_len: int = 32
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  decode_chunk: int = 16         # decode steps between admissions (and weight swaps)
  inflight_updates: bool = False  # swap in the newest weights between chunks, not only between batches
  slots: int = 0                 # decode slots (0: the batch's rows; -1: as many as free memory holds)
  stream_ahead: int = -1         # prompts kept in flight for the next batch (-1: prompts_per_step)
  on_swap: str = "recompute"     # unfinished rows' KV cache after new weights: "recompute" or "keep"

  @property
  def rows(self) -> int:
    return self.prompts_per_step * self.samples_per_prompt

  @property
  def ahead(self) -> int:
    """Prompts the engine keeps in flight for the next batch."""
    return self.prompts_per_step if self.stream_ahead < 0 else self.stream_ahead

  def decode_slots(self, eval_samples: int) -> int:
    """The engine's slots: `slots`, or the batch's rows rounded up to whole groups of both the
    rollout's and the evaluation's group size."""
    g = math.lcm(self.samples_per_prompt, eval_samples)
    return self.slots if self.slots > 0 else -(-self.rows // g) * g

  def validate(self) -> "RolloutConfig":
    # slots against eval.n_samples and the algorithm's need for groups are cross-section rules (rlax.config).
    for ok, msg in (
        (self.samples_per_prompt >= 1, f"rollout.samples_per_prompt={self.samples_per_prompt} must be >= 1"),
        (self.prompts_per_step >= 1, f"rollout.prompts_per_step={self.prompts_per_step} must be >= 1"),
        (self.max_prompt_len >= 1, f"rollout.max_prompt_len={self.max_prompt_len} must be >= 1"),
        (self.max_new_tokens >= 1, f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1"),
        (self.decode_chunk >= 1, f"rollout.decode_chunk={self.decode_chunk} must be >= 1"),
        (self.slots >= -1, f"rollout.slots={self.slots} must be >= -1"),
        (self.stream_ahead >= -1, f"rollout.stream_ahead={self.stream_ahead} must be >= -1"),
        (self.on_swap in ("recompute", "keep"), f"rollout.on_swap={self.on_swap!r} must be 'recompute' or 'keep'"),
        (self.temperature > 0, f"rollout.temperature={self.temperature} must be > 0 for RL sampling"),
        (self.top_k >= 0, f"rollout.top_k={self.top_k} must be >= 0"),
        (0 < self.top_p <= 1, f"rollout.top_p={self.top_p} must be in (0, 1]"),
        (not (self.top_k and self.top_p < 1), "rollout.top_k and rollout.top_p are exclusive; set one of them")):
      if not ok:
        raise ValueError(msg)
    return self
