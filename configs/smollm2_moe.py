"""SmolLM2-135M-Instruct sparse-upcycled into a mixture of experts (4 experts, top-2: 373M parameters, 135M
active), post-trained with GRPO and rollout routing replay on the README's SmolLM2 task (configs/smollm2.py).

  python -m launch.fetch_model smollm2 --out=~/.cache/smollm2-135m-instruct
  python -m launch.upcycle ~/.cache/smollm2-135m-instruct --experts=4 --top_k=2 --out=~/.cache/smollm2-moe-4x2
  python -m launch.main --config=configs/smollm2_moe.py
  python -m launch.main --config=configs/smollm2_moe.py:no_replay   # each forward routes by its own router
  python -m launch.main --config=configs/smollm2_moe.py:smoke       # 2 RL steps: does it all run?

At step 0 the upcycled model computes the dense model's logits; RL makes the experts differ. The sampler
records every token's experts and the trainer's forwards replay them (model.moe.routing_replay="rollout"),
so both compute each token through the same experts. Four experts, not eight, so the policy, its Adam state
and the sampler's copy fit this 24 GiB machine.
"""

import os

from configs import smollm2


def get_config(arg: str | None = None):
  c = smollm2.get_config("smoke" if arg == "smoke" else None)
  c.workdir = "runs/smollm2_moe" + {"smoke": "_smoke", "no_replay": "_no_replay"}.get(arg or "", "")
  c.model.hf_checkpoint = os.path.expanduser("~/.cache/smollm2-moe-4x2")
  # Layers scanned and rematerialized: without remat the step keeps every layer's expert blocks for the backward
  # (rlax.models.moe.block_weight_bytes) and the run needs ~21 GiB; with it ~15.
  c.model.overrides = dict(dtype="float32", remat=True, scan_layers=True,
                           moe=dict(routing_replay="none" if arg == "no_replay" else "rollout"))
  if arg not in (None, "", "smoke", "no_replay"):
    raise ValueError(f"configs/smollm2_moe.py: unknown argument {arg!r}; use 'smoke' or 'no_replay'")
  return c
