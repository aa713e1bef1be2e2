"""QwQ-32B on a v5p-128 (64 chips, Google's name counts TensorCores): 2 slices of v5p:2x4x4, 8k sequences.

  python -m launch.plan --config=configs/v5p_128.py

Slice 0 (32 chips) trains with FSDP 8 x tensor 4; slice 1 (32 chips) samples with tensor 8 x data 4.
"""

from configs import paper_qwq32b


def get_config(arg: str | None = None):
  c = paper_qwq32b.get_config()
  c.workdir = "runs/v5p_128"
  c.topology.trainer_mesh = dict(data=1, fsdp=-1, tensor=4)
  c.topology.sampler_mesh = dict(data=-1, fsdp=1, tensor=8)
  c.rollout.prompts_per_step = 16
  c.rollout.samples_per_prompt = 16
  c.rollout.max_prompt_len = 1024
  c.rollout.max_new_tokens = 7 * 1024
  c.optimizer.micro_batches = 32      # 8 rows per micro-batch: one sequence per FSDP shard
  c.rollout.slots = 256
  c.plan = paper_qwq32b.plan_fields("v5p:2x4x4", 2)
  if arg == "tiny":
    paper_qwq32b.shrink(c)
  elif arg:
    raise ValueError(f"configs/v5p_128.py: unknown argument {arg!r}; use 'tiny'")
  return c
