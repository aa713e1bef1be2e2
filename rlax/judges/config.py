"""The `judge` config section: the frozen model that grades replies when `reward.name` is "judge"."""

from __future__ import annotations

import dataclasses
import os

from rlax.judges import verdicts
from rlax.services import PLACEMENTS


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
  """judge.hf_checkpoint: an HF model directory (an rlax export is one) that reads each reply and writes a verdict;
  "" = none. template: the judge's user message, with {rubric}, {question}, {reply} and {reference} filled in
  ("" = `verdicts.DEFAULT_TEMPLATE`; a path ending in .txt is read). verdict: "number" (the last number after
  "score", scaled by 1/`scale`), "label" (the last of `labels`' words) or "json:<field>" (that field of the last
  JSON object: a number, a boolean or a label). labels: "word=value,..." (case-insensitive). max_prompt_len /
  max_new_tokens: the judge's prompt (a longer reply is cut to fit) and verdict budgets. slots: replies judged at
  once (0: the rollouts of one step). timeout_s: a batch's deadline: replies not judged by then get reward 0,
  counted. log_samples: replies per batch written with their verdicts to <workdir>/logs/judge.jsonl. placement:
  as teacher.placement ("sampler" or "own", rlax.services)."""
  hf_checkpoint: str = ""
  placement: str = "sampler"
  rubric: str = "The reply answers the question correctly."
  template: str = ""
  verdict: str = "number"
  scale: float = 10.0
  labels: str = "yes=1,no=0"
  max_prompt_len: int = 512
  max_new_tokens: int = 32
  slots: int = 0
  timeout_s: float = 300.0
  log_samples: int = 2

  def validate(self) -> "JudgeConfig":
    for ok, msg in (
        (self.placement in PLACEMENTS, f"judge.placement={self.placement!r}: expected one of {list(PLACEMENTS)}"),
        (self.scale > 0, f"judge.scale={self.scale} must be > 0"),
        (self.max_prompt_len >= 16 and self.max_new_tokens >= 1,
         f"judge.max_prompt_len={self.max_prompt_len} must be >= 16 and judge.max_new_tokens="
         f"{self.max_new_tokens} >= 1"),
        (self.slots >= 0 and self.log_samples >= 0,
         f"judge.slots={self.slots} and judge.log_samples={self.log_samples} must be >= 0"),
        (self.timeout_s > 0, f"judge.timeout_s={self.timeout_s} must be > 0")):
      if not ok:
        raise ValueError(msg)
    verdicts.Parser(self.verdict, self.labels, self.scale)  # raises one line naming the field
    verdicts.check_template(self.template_text())
    if self.hf_checkpoint and not os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")):
      raise ValueError(f"judge.hf_checkpoint={self.hf_checkpoint!r}: no config.json there (an HF model directory "
                       "is needed)")
    return self

  def template_text(self) -> str:
    """The template itself: `template`, the file it names, or the default."""
    if not self.template:
      return verdicts.DEFAULT_TEMPLATE
    if self.template.endswith(".txt"):
      if not os.path.isfile(self.template):
        raise ValueError(f"judge.template={self.template!r}: no such file")
      with open(self.template, encoding="utf-8") as f:
        return f.read()
    return self.template

  def absolute(self) -> "JudgeConfig":
    expand = lambda p: p and os.path.abspath(os.path.expanduser(p))
    return dataclasses.replace(self, hf_checkpoint=expand(self.hf_checkpoint),
                               template=expand(self.template) if self.template.endswith(".txt") else self.template)
