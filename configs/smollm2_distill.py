"""On-policy distillation of SmolLM2-135M-Instruct from a teacher: the policy that configs/smollm2.py trains.

  python -m launch.main --config=configs/smollm2.py            # the teacher: 20 GRPO steps, exported to runs/smollm2/export
  python -m launch.main --config=configs/smollm2_distill.py    # the untrained base learns from it, 6 steps
  python -m launch.main --config=configs/smollm2_distill.py --config.teacher.hf_checkpoint=/path/to/any/teacher

The student samples as in configs/smollm2.py; the teacher (rlax.teachers, on the sampler's device, in the
rollout path) scores every sampled token, and the per-token reverse KL to it is the advantage
(`algorithm.name=distill`: no task reward; `--config.algorithm.overrides.reward_coef=1` mixes GRPO's back in).
Same prompts, held-out evaluation and budget per step as the RL run, a third of its steps.
"""

import os

from configs import smollm2


def get_config(arg: str | None = None):
  c = smollm2.get_config()
  c.workdir = "runs/smollm2_distill"
  c.algorithm.update(name="distill")
  c.teacher.hf_checkpoint = os.path.abspath("runs/smollm2/export")
  c.optimizer.lr = 3e-5
  c.controller.steps = 6
  if arg == "smoke":
    c.workdir = "runs/smollm2_distill_smoke"
    c.controller.steps = 2
    c.data.n_eval = 8
    c.eval.n_samples = 2
  elif arg:
    raise ValueError(f"configs/smollm2_distill.py: unknown argument {arg!r}; use 'smoke'")
  return c
