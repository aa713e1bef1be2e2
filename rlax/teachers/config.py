"""The `teacher` config section: the frozen model that scores a distilling run's rollouts."""

from __future__ import annotations

import dataclasses
import os

from rlax.services import PLACEMENTS


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
  """teacher.hf_checkpoint: an HF model directory (an rlax export is one) whose log-probs of every sampled token
  drive `algorithm.distill_coef`; "" = none. placement: the devices it runs on ("sampler": beside the sampler,
  between its batches; "own": topology.service_slices, see rlax.services). temperature: the teacher's softmax
  temperature. chunk: positions per log-softmax chunk. rows_per_pass: at most this many rows of a batch scored
  at once (0: all; long sequences need few: a row's attention alone is sequence^2 x heads)."""
  hf_checkpoint: str = ""
  placement: str = "sampler"
  temperature: float = 1.0
  chunk: int = 256
  rows_per_pass: int = 0

  def validate(self) -> "TeacherConfig":
    if self.placement not in PLACEMENTS:
      raise ValueError(f"teacher.placement={self.placement!r}: expected one of {list(PLACEMENTS)}")
    if self.temperature <= 0:
      raise ValueError(f"teacher.temperature={self.temperature} must be > 0")
    if self.chunk < 1 or self.rows_per_pass < 0:
      raise ValueError(f"teacher.chunk={self.chunk} must be >= 1 and teacher.rows_per_pass={self.rows_per_pass} "
                       ">= 0")
    if self.hf_checkpoint and not os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")):
      raise ValueError(f"teacher.hf_checkpoint={self.hf_checkpoint!r}: no config.json there (an HF model "
                       "directory, e.g. a run's <workdir>/export, is needed)")
    return self

  def absolute(self) -> "TeacherConfig":
    path = self.hf_checkpoint and os.path.abspath(os.path.expanduser(self.hf_checkpoint))
    return dataclasses.replace(self, hf_checkpoint=path)
