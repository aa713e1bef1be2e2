"""On-policy distillation at scale: a QwQ-32B teacher on slices of its own beside a Qwen2.5-7B student.

  python -m launch.plan --config=configs/paper_distill.py            # AOT plan, no TPU needed (tpu extra)

Three slices of v5p-128 (4x4x4, 64 chips each): slice 0 trains the student, slice 1 samples from it, slice 2
holds the teacher (`teacher.placement="own"`, `topology.service_slices=1`), which scores each step's rows while
the sampler decodes the next. The rollout is the paper config's (64 prompts x 16 samples, 1k + 15k tokens).
The teacher's weights are read at run time from `teacher.hf_checkpoint` (the QwQ-32B checkpoint); the plan
needs its config.json only, shipped in configs/assets/qwq32b.
"""

import os

from configs import paper_qwq32b


def get_config(arg: str | None = None):
  if arg:
    raise ValueError(f"configs/paper_distill.py: unknown argument {arg!r}")
  c = paper_qwq32b.get_config()
  c.workdir = "runs/paper_distill"
  c.model.preset = "qwen2.5-7b"
  c.algorithm.name = "distill"
  c.teacher.hf_checkpoint = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "qwq32b")
  c.teacher.placement = "own"
  c.teacher.rows_per_pass = 64     # 8 of a chip's 128 rows at a time: a row's attention is 16k^2 x 5 heads
  c.topology.trainer_slices, c.topology.sampler_slices, c.topology.service_slices = 1, 1, 1
  c.topology.service_mesh = dict(data=-1, fsdp=1, tensor=8)
  c.plan = paper_qwq32b.plan_fields("v5p:4x4x4", 3)
  return c
