"""QwQ-32B on a v5p-512 (256 chips, Google's name counts TensorCores): 2 slices of v5p:4x4x8, 16k sequences.

  python -m launch.plan --config=configs/v5p_512.py

Slice 0 (128 chips) trains with FSDP 16 x tensor 8; slice 1 (128 chips) samples with tensor 8 x data 16.
"""

from configs import paper_qwq32b


def get_config(arg: str | None = None):
  c = paper_qwq32b.get_config()
  c.workdir = "runs/v5p_512"
  c.topology.trainer_mesh = dict(data=1, fsdp=-1, tensor=8)
  c.topology.sampler_mesh = dict(data=-1, fsdp=1, tensor=8)
  c.rollout.prompts_per_step = 32
  c.rollout.samples_per_prompt = 16
  c.optimizer.micro_batches = 32      # 16 rows per micro-batch: one sequence per FSDP shard
  c.rollout.slots = 512
  c.plan = paper_qwq32b.plan_fields("v5p:4x4x8", 2)
  if arg == "tiny":
    paper_qwq32b.shrink(c)
  elif arg:
    raise ValueError(f"configs/v5p_512.py: unknown argument {arg!r}; use 'tiny'")
  return c
