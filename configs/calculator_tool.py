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

from configs import smollm2


def get_config(arg: str | None = None):
  c = smollm2.get_config()  # the same model, devices, algorithm and optimizer as the one-shot example
  c.workdir = "runs/calculator_tool"
  c.rollout.update(max_prompt_len=256, max_new_tokens=96)
  c.controller.steps = 20  # ~75 s a step on 2 cores: 25 minutes
  # Episodes are up to 352 tokens: two packed rows of 768 a micro-batch keep the trainer near 8 GiB (24 GiB host).
  c.optimizer.micro_batch_tokens = 1536
  c.data.update(task="multiplication", difficulty=2, n_train=4096, n_eval=64, system_prompt="")  # the env prompts
  c.reward.update(name="arithmetic", answer="last_number")
  c.env.update(name="calculator", max_turns=3, max_tool_calls=2, turn_tokens=32, examples=1)
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
