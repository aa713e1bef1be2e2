"""Qwen3-235B-A22B (94 layers, d 4096, 128 experts top-8, expert MLP 1536) on 2 slices of v5p:8x8x8 (1024
chips, the paper's machine), 8k sequences, with rollout routing replay.

  python -m launch.plan --config=configs/qwen3_moe_235b.py
  python -m launch.plan --config=configs/qwen3_moe_235b.py:tiny   # the same structure on 8 local CPU devices

Slice 0 (512 chips) trains with data 8 x FSDP 8 x tensor 8: experts over 'fsdp' (expert parallelism 8, 16
experts a chip), the expert MLP over 'tensor'. EP 64 (FSDP 64) does not fit: the all-gather dispatch holds the
EP group's tokens x top-k rows on every chip (64 x 16k x 8 x 4096 bf16 = 69 GB a copy; the plan stops at 234 GiB
of temporaries), and at EP 8 16k sequences need 123 GiB a chip (102 of temporaries), so sequences are 8k.
Slice 1 (512 chips) samples with data 16 x fsdp 8 x tensor 4: EP 8, the weights 1/32 a chip (14.7 GB); tensor 4
because the model has 4 KV heads (on tensor 8 they would be replicated, and the admission's keys and values with
them: the plan stops at 200 GiB). The weight push is not planned: it does not fit (290 GiB of temporaries).
"""

from configs import paper_qwq32b, qwen3_moe_30b


def get_config(arg: str | None = None):
  c = paper_qwq32b.get_config()
  c.workdir = "runs/qwen3_moe_235b"
  c.model.preset = "qwen3_moe_235b"
  c.model.overrides = dict(scan_layers=True, remat=True)
  c.topology.trainer_mesh = dict(data=8, fsdp=-1, tensor=8)
  c.topology.sampler_mesh = dict(data=-1, fsdp=8, tensor=4)
  c.rollout.max_new_tokens = 7 * 1024
  c.rollout.slots = 512
  c.plan = paper_qwq32b.plan_fields("v5p:8x8x8", 2)
  if arg == "tiny":
    qwen3_moe_30b.shrink_moe(c)
  elif arg:
    raise ValueError(f"configs/qwen3_moe_235b.py: unknown argument {arg!r}; use 'tiny'")
  return c
