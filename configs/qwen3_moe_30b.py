"""Qwen3-30B-A3B (48 layers, d 2048, 128 experts top-8, expert MLP 768) on 2 slices of v5p:4x4x8 (256 chips),
8k sequences, with rollout routing replay.

  python -m launch.plan --config=configs/qwen3_moe_30b.py
  python -m launch.plan --config=configs/qwen3_moe_30b.py:tiny   # the same structure on 8 local CPU devices

Slice 0 (128 chips) trains with data 4 x FSDP 8 x tensor 4: the experts split over 'fsdp' (expert parallelism
8, 16 experts a chip; rlax.models.expert_parallel), the expert MLP over 'tensor'. The all-gather dispatch moves
(EP - 1) x a chip's tokens each way per layer: at FSDP 32 (EP 32) that is 4.8 TB a chip per step, ~16 s of ICI
against a 2.7 s compute roofline; EP 8 moves 7/31 of it. Slice 1 (128 chips) samples with data 16 x fsdp 2 x
tensor 4: experts over 'fsdp' there too (EP 2), so a chip holds half of them.
"""

from configs import paper_qwq32b


def get_config(arg: str | None = None):
  c = paper_qwq32b.get_config()
  c.workdir = "runs/qwen3_moe_30b"
  c.model.preset = "qwen3_moe_30b"
  c.model.overrides = dict(scan_layers=True, remat=True)
  c.topology.trainer_mesh = dict(data=4, fsdp=-1, tensor=4)
  c.topology.sampler_mesh = dict(data=-1, fsdp=2, tensor=4)
  c.rollout.prompts_per_step = 32
  c.rollout.samples_per_prompt = 16
  c.rollout.max_prompt_len = 1024
  c.rollout.max_new_tokens = 7 * 1024
  c.optimizer.micro_batches = 16      # 32 rows per micro-batch: one sequence per row shard (data x FSDP)
  c.rollout.slots = 512
  c.plan = paper_qwq32b.plan_fields("v5p:4x4x8", 2)
  if arg == "tiny":
    shrink_moe(c)
  elif arg:
    raise ValueError(f"configs/qwen3_moe_30b.py: unknown argument {arg!r}; use 'tiny'")
  return c


def shrink_moe(c) -> None:
  """paper_qwq32b.shrink with 8 experts top-2: EP over the tiny trainer's fsdp and the sampler's."""
  paper_qwq32b.shrink(c)
  c.model.preset = "qwen3_moe_30b"
  c.model.overrides = dict(c.model.overrides, vocab_size=256, moe=dict(n_experts=8, top_k=2, expert_mlp_dim=32))
  c.topology.sampler_mesh = dict(data=-1, fsdp=2, tensor=1)
