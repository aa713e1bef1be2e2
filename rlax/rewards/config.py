"""The `reward` config section: which reward grades completions, and the limits of each grading process."""

from __future__ import annotations

import dataclasses

from rlax.rewards import sandbox
from rlax.rewards.text import ANSWER_MODES


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """The reward by name; `answer`: how a final answer is found in free text; `format_weight`: bonus for
  stating it in that format."""
  name: str = "arithmetic"
  answer: str = "auto"            # "auto", "boxed", "last_number" or "answer_tag"
  format_weight: float = 0.0
  workers: int = 4
  timeout_s: float = 5.0
  memory_mb: int = 4096           # address space a grading process may grow by
  max_chars: int = 1 << 20        # longer completions get reward 0 without being graded
  sandbox: str = "auto"           # policy-written code: "auto" (the jail, refused without one), "unsafe" (opt-in)

  def validate(self) -> "RewardConfig":
    # Whether `name` is a reward (and takes `answer`) is checked where it is built (rlax.rewards.registry).
    modes = ", ".join(map(repr, ANSWER_MODES[:-1])) + f" or {ANSWER_MODES[-1]!r}"
    for ok, msg in (
        (self.workers >= 1, f"reward.workers={self.workers} must be >= 1"),
        (self.timeout_s > 0, f"reward.timeout_s={self.timeout_s} must be > 0"),
        (self.memory_mb >= 1 and self.max_chars >= 1,
         f"reward.memory_mb={self.memory_mb} and reward.max_chars={self.max_chars} must be >= 1"),
        (not sandbox.mode_error(self.sandbox), sandbox.mode_error(self.sandbox)),
        (self.answer in ANSWER_MODES, f"reward.answer={self.answer!r}: use {modes}"),
        (self.format_weight >= 0, f"reward.format_weight={self.format_weight} must be >= 0")):
      if not ok:
        raise ValueError(msg)
    return self
