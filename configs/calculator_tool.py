"""SmolLM2-135M-Instruct learns to use a calculator tool: multi-turn episodes with GRPO.

  python -m launch.main --config=configs/calculator_tool.py
  python -m launch.main --config=configs/calculator_tool.py:control   # the tool answers "unavailable"
  python -m launch.main --config=configs/calculator_tool.py:smoke     # 2 steps: does it all run?

Problems: a * b with two-digit operands (12..99). The conversation: a system prompt describing the
calculator and its call format (`<calc>23*47</calc>`: SmolLM2's template has no tool block), `env.examples`
worked examples (question, call, tool turn, final answer), then the problem. Each policy turn ends with
<|im_end|>; a turn with a call is answered by a `tool` turn holding the result, a turn without one is the
final answer, rewarded 1 when its last number is a * b (the tool's output is never read by the reward).
Held-out pass@1 is measured the same way, through the environment.
"""

import os

from configs import base


def get_config(arg: str | None = None):
  c = base.get_config()
  c.workdir = "runs/calculator_tool"
  c.model.hf_checkpoint = os.path.expanduser("~/.cache/smollm2-135m-instruct")
  c.model.overrides = dict(dtype="float32")
  c.topology.update(slice_size=1, trainer_slices=1, sampler_slices=1,
                    trainer_mesh=dict(data=1, fsdp=-1, tensor=1), sampler_mesh=dict(data=-1, fsdp=1, tensor=1))
  c.algorithm.update(name="grpo", kl_coef=0.0)
  c.optimizer.update(lr=2e-5, warmup_steps=0, clip_norm=1.0, micro_batch_tokens=4096)
  c.rollout.update(prompts_per_step=8, samples_per_prompt=8, max_prompt_len=256, max_new_tokens=96,
                   temperature=1.0)
  c.controller.update(steps=30, max_staleness=1, queue_size=1)
  c.data.update(task="multiplication", difficulty=2, n_train=4096, n_eval=64)
  c.reward.update(name="arithmetic", answer="last_number")
  c.env.update(name="calculator", max_turns=3, max_tool_calls=2, turn_tokens=32, examples=2)
  c.eval.update(n_samples=8, temperature=1.0)
  c.checkpoint.update(every_steps=10)
  if arg == "control":
    c.workdir = "runs/calculator_tool_control"
    c.env.tools_available = False
  elif arg == "smoke":
    c.workdir = "runs/calculator_tool_smoke"
    c.controller.steps = 2
    c.data.n_eval = 8
    c.eval.n_samples = 2
  elif arg:
    raise ValueError(f"configs/calculator_tool.py: unknown argument {arg!r}; use 'control' or 'smoke'")
  return c
