"""Algorithm presets on the base config: `get_config("<name>")`.

  python -m launch.main --config=configs/algorithm.py:dapo
  python -m launch.main --config=configs/algorithm.py:gspo --config.rollout.samples_per_prompt=16

The algorithm's own defaults (clip ranges, aggregation, estimator) live in the
registry (`rlax.algorithms`); the preset only names it and sets the runtime knobs
its paper used. Every preset here trains end to end (PPO needs a value model, not trained yet).
"""

from configs import base

_RUNTIME = {
    "grpo": dict(kl_coef=0.04),
    "dr_grpo": dict(kl_coef=0.0),
    "dapo": dict(kl_coef=0.0),
    "rloo": dict(kl_coef=0.0),
    "reinforce_pp": dict(kl_coef=0.0),
    "gspo": dict(kl_coef=0.0),
    "cispo": dict(kl_coef=0.0),
}


def get_config(arg: str = "grpo"):
  if arg not in _RUNTIME:
    raise ValueError(f"unknown algorithm preset {arg!r}; known: {', '.join(sorted(_RUNTIME))}")
  c = base.get_config()
  c.algorithm.name = arg
  c.algorithm.update(_RUNTIME[arg])
  if arg == "dapo":
    c.controller.dynamic_sampling = True
  c.workdir = f"runs/{arg}"
  return c
