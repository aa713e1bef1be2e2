"""Algorithm presets on the base config: `get_config("<name>")`.

  python -m launch.main --config=configs/algorithm.py:dapo
  python -m launch.main --config=configs/algorithm.py:gspo --config.rollout.samples_per_prompt=16

The algorithm's own defaults (clip ranges, aggregation, estimator) live in the
registry (`rlax.algorithms`); the preset only names it and sets the runtime knobs
its paper used. Every preset here trains end to end. `ppo` trains a value model next to the policy and
runs on the demo's task and model (configs/demo.py), where it learns in minutes:

  python -m launch.main --config=configs/algorithm.py:ppo
  python -m launch.main --config=configs/algorithm.py:ppo --config.algorithm.overrides.critic_lr=3e-4
"""

from configs import base
from configs import demo

_RUNTIME = {
    "grpo": dict(kl_coef=0.04),
    "dr_grpo": dict(kl_coef=0.0),
    "dapo": dict(kl_coef=0.0),
    "rloo": dict(kl_coef=0.0),
    "reinforce_pp": dict(kl_coef=0.0),
    "reinforce_pp_baseline": dict(kl_coef=0.0),
    # PPO with a critic: GAE(1, 0.95) on the final reward, the critic warmed up before the policy moves.
    "ppo": dict(kl_coef=0.0, overrides=dict(critic_lr=1e-3, value_warmup_steps=5)),
    "gspo": dict(kl_coef=0.0),
    "cispo": dict(kl_coef=0.0),
}


def get_config(arg: str = "grpo"):
  if arg not in _RUNTIME:
    raise ValueError(f"unknown algorithm preset {arg!r}; known: {', '.join(sorted(_RUNTIME))}")
  c = demo.get_config() if arg == "ppo" else base.get_config()
  c.algorithm.name = arg
  c.algorithm.update(_RUNTIME[arg])
  if arg == "dapo":
    c.controller.dynamic_sampling = True
  c.workdir = f"runs/{arg}"
  return c
