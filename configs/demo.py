"""The demo: a tiny model learns multi-digit addition with GRPO on 8 fake CPU devices.

  python -m launch.main                         # this config is the default
  python -m launch.main --config=configs/demo.py --config.controller.steps=20
  python -m launch.main --config=configs/demo.py:smoke     # 10 RL steps (CI runs this)
  python -m launch.main --config=configs/demo.py:tiny      # a 1-layer model, 4 steps (tests)
  python -m launch.main --config=configs/demo.py:tiny_moe  # the same with 4 routed experts, top-2 (Mixtral)

Trainer and sampler run on disjoint submeshes (2 slices of 2 devices each).
A short SFT warm start gives the policy a partial skill; RL then raises its
held-out pass@1. Everything it needs (task generator, tokenizer) ships with rlax.
"""

from configs import base


def get_config(arg: str | None = None):
  c = base.get_config()
  c.workdir = "runs/demo"
  c.model.preset = "w1"
  c.model.overrides = dict(vocab_size=128, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                           mlp_dim=512)
  c.init.sft_steps = 40
  c.init.sft_lr = 3e-3
  c.topology.slice_size = 2
  c.topology.trainer_slices = 2
  c.topology.sampler_slices = 2
  c.topology.trainer_mesh = dict(data=1, fsdp=-1, tensor=1)
  c.topology.sampler_mesh = dict(data=-1, fsdp=1, tensor=1)
  c.algorithm.name = "grpo"
  c.algorithm.kl_coef = 0.0
  c.optimizer.lr = 1e-4
  c.optimizer.clip_norm = 1.0
  c.rollout.prompts_per_step = 16
  c.rollout.samples_per_prompt = 8
  c.rollout.max_prompt_len = 16
  c.rollout.max_new_tokens = 8
  c.controller.steps = 600
  c.controller.max_staleness = 1
  c.data.task = "digit_sort"
  c.data.difficulty = 2
  c.data.prompt_style = "compact"
  c.data.n_train = 8192
  c.data.n_eval = 128
  c.reward.name = "digit_sort"
  c.eval.n_samples = 8
  c.checkpoint.every_steps = 20
  if arg in ("tiny", "tiny_moe"):  # seconds-long runs (tests): a 1-layer model, no warm start, 4 steps
    c.workdir = "runs/demo_tiny"
    c.model.overrides = dict(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                             mlp_dim=64)
    c.init.sft_steps = 0
    c.rollout.prompts_per_step, c.rollout.samples_per_prompt, c.rollout.max_new_tokens = 4, 4, 4
    c.controller.steps = 4
    c.data.n_train, c.data.n_eval = 256, 4
    c.eval.n_samples = 2
    c.checkpoint.every_steps = 2
    if arg == "tiny_moe":
      c.workdir = "runs/demo_tiny_moe"
      c.model.overrides = dict(c.model.overrides, arch="mixtral", mlp_dim=32,
                               moe=dict(n_experts=4, top_k=2, expert_mlp_dim=32))
  elif arg == "smoke":
    c.workdir = "runs/demo_smoke"
    c.init.sft_steps = 60
    c.controller.steps = 10
    c.data.n_eval = 32
  elif arg:
    raise ValueError(f"configs/demo.py: unknown argument {arg!r}; use 'smoke', 'tiny' or 'tiny_moe'")
  return c
