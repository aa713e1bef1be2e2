"""The paper's setting: QwQ-32B (Qwen2.5-32B architecture) on 1024 TPU v5p chips = 2 slices of v5p-1024 (8x8x8).

  python -m launch.plan --config=configs/paper_qwq32b.py            # AOT plan, no TPU needed (tpu extra)
  python -m launch.tpu --config=configs/paper_qwq32b.py             # commands to start it on TPU slices

Slice 0 (512 chips) trains, slice 1 (512 chips) samples; weights cross the slices over DCN through
`rlax.multihost.CrossMeshPush` (or device_put under Pathways). Responses are long (up to 15k new tokens
after a 1k prompt: 16k-token sequences). `c.plan` holds the plan-only fields: target topology and the
chip's published figures. `get_config("32k")` doubles the response length (32k sequences);
`get_config("tiny")` keeps the structure but shrinks model and topology to 8 local devices (tests, CPU).
"""

import dataclasses

import ml_collections

from configs import base
from rlax.planning_config import PlanConfig


def plan_fields(topology: str, num_slices: int) -> ml_collections.ConfigDict:
  """The plan section (rlax.planning_config.PlanConfig: v5p's per-chip figures) for `topology` x `num_slices`.
  programs, e.g. "sampler_decode": compile only these (rlax.planning.PROGRAMS)."""
  return ml_collections.ConfigDict({**dataclasses.asdict(PlanConfig()), "topology": topology,
                                    "num_slices": num_slices})


def get_config(arg: str | None = None):
  c = base.get_config()
  c.workdir = "runs/paper_qwq32b"
  c.model.preset = "qwq32b"       # 64 layers, d 5120, 40q/8kv heads, MLP 27648, vocab 152064, bf16
  c.model.overrides = dict(scan_layers=True, remat=True)
  c.topology.slice_size = None    # TPU: slices from device.slice_index
  c.topology.trainer_slices = 1
  c.topology.sampler_slices = 1
  c.topology.trainer_mesh = dict(data=1, fsdp=-1, tensor=8)
  c.topology.sampler_mesh = dict(data=-1, fsdp=1, tensor=8)
  c.algorithm.name = "grpo"
  c.optimizer.lr = 1e-6
  c.rollout.prompts_per_step = 64
  c.rollout.samples_per_prompt = 16
  c.rollout.max_prompt_len = 1024
  c.rollout.max_new_tokens = 15 * 1024
  c.rollout.decode_chunk = 256
  c.rollout.slots = 1024           # the sampler's decode slots: a whole batch of rows at once
  # Rows keep their keys and values across a weight swap (tokens after it attend to the older weights' cache):
  # a recompute over every slot's whole 16k context needs 531 GiB of temporaries a chip (launch.plan, 2026-12-05).
  c.rollout.on_swap = "keep"
  c.optimizer.micro_batches = 16   # 64 rows per micro-batch: one sequence per FSDP shard
  c.plan = plan_fields("v5p:8x8x8", 2)
  if arg == "32k":
    c.rollout.max_new_tokens = 31 * 1024
  elif arg == "tiny":
    shrink(c)
  elif arg:
    raise ValueError(f"configs/paper_qwq32b.py: unknown argument {arg!r}; use '32k' or 'tiny'")
  return c


def shrink(c) -> None:
  """Same structure on 8 local devices: a 2-layer model, 2 simulated slices of 4, short sequences."""
  c.model.preset = "w1"
  c.model.overrides = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                           mlp_dim=128, scan_layers=True, remat=True)
  c.topology.slice_size = 4
  c.topology.trainer_mesh = dict(data=1, fsdp=-1, tensor=2)
  c.topology.sampler_mesh = dict(data=-1, fsdp=1, tensor=2)
  c.rollout.prompts_per_step, c.rollout.samples_per_prompt = 4, 4
  c.rollout.max_prompt_len, c.rollout.max_new_tokens, c.rollout.decode_chunk = 16, 16, 16
  c.optimizer.micro_batches = 2
  c.rollout.slots = 8
  c.plan.topology, c.plan.num_slices = "local", 2
