"""The `teacher` config section: the frozen model that scores a distilling run's rollouts."""

from __future__ import annotations

import dataclasses
import os

from rlax.services import PLACEMENTS

DEFAULT = "default"  # the name of the teacher at teacher.hf_checkpoint


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
  """teacher.hf_checkpoint: an HF model directory (an rlax export is one) whose log-probs of every sampled token
  drive `algorithm.distill_coef`; "" = none. placement: the devices it runs on ("sampler": beside the sampler,
  between its batches; "own": topology.service_slices, see rlax.services). temperature: the teacher's softmax
  temperature. chunk: positions per log-softmax chunk. rows_per_pass: at most this many rows of a batch scored
  at once (0: all; long sequences need few: a row's attention alone is sequence^2 x heads).

  Several teachers: `routes` {value: HF directory} picks a row's teacher by its record's
  `metadata[route_field]` (rlax.teachers.routing); rows with another value (or none) go to `hf_checkpoint`, the
  default teacher. Each scores its rows in fixed-shape passes of `pass_rows` rows."""
  hf_checkpoint: str = ""
  placement: str = "sampler"
  temperature: float = 1.0
  chunk: int = 256
  rows_per_pass: int = 0
  route_field: str = ""
  routes: dict[str, str] = dataclasses.field(default_factory=dict, hash=False)

  def validate(self) -> "TeacherConfig":
    if self.placement not in PLACEMENTS:
      raise ValueError(f"teacher.placement={self.placement!r}: expected one of {list(PLACEMENTS)}")
    if self.temperature <= 0:
      raise ValueError(f"teacher.temperature={self.temperature} must be > 0")
    if self.chunk < 1 or self.rows_per_pass < 0:
      raise ValueError(f"teacher.chunk={self.chunk} must be >= 1 and teacher.rows_per_pass={self.rows_per_pass} "
                       ">= 0")
    if bool(self.route_field) != bool(self.routes) or (self.routes and not self.hf_checkpoint):
      raise ValueError(f"teacher.route_field={self.route_field!r} and teacher.routes={dict(self.routes)!r} go "
                       "together, beside teacher.hf_checkpoint (the default teacher)")
    if DEFAULT in self.routes or not all(isinstance(k, str) and k for k in self.routes):
      raise ValueError(f"teacher.routes={dict(self.routes)!r}: names are non-empty strings, and {DEFAULT!r} is the "
                       "default teacher's (teacher.hf_checkpoint)")
    for name, path in self.dirs().items():  # "" only for the default: no teacher
      if not isinstance(path, str) or ((path or name != DEFAULT) and not os.path.isfile(f"{path}/config.json")):
        field = "teacher.hf_checkpoint" if name == DEFAULT else f"teacher.routes.{name}"
        raise ValueError(f"{field}={path!r}: no config.json there (an HF model directory, e.g. a run's "
                         "<workdir>/export, is needed)")
    return self

  def dirs(self) -> dict[str, str]:
    """{teacher name: HF directory}: DEFAULT (hf_checkpoint) first, then `routes` by their values. Callers:
    rlax.builders.teacher, rlax.memory, launch.plan."""
    return {DEFAULT: self.hf_checkpoint, **self.routes}

  def absolute(self) -> "TeacherConfig":
    full = lambda p: p and os.path.abspath(os.path.expanduser(p))
    return dataclasses.replace(self, hf_checkpoint=full(self.hf_checkpoint),
                               routes={k: full(v) for k, v in self.routes.items()})
