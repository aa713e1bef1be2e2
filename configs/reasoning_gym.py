"""Post-train SmolLM2-135M-Instruct on a reasoning-gym task, graded by the dataset's own scorer.

  python -m launch.fetch_model smollm2 --out=~/.cache/smollm2-135m-instruct      # the model, once
  python -m launch.main --config=configs/reasoning_gym.py
  python -m launch.main --config=configs/reasoning_gym.py:smoke                    # 2 steps: does it all run?
  python -m launch.main --config=configs/reasoning_gym.py \\
      --config.data.task=reasoning_gym:leg_counting --config.data.task_options='{"max_animals": 3}'

`data.task=reasoning_gym:<dataset>` draws procedural problems from the reasoning-gym package (options: the
dataset's config, as JSON in `data.task_options`); several mix by weight
(`reasoning_gym:chain_sum=2,reasoning_gym:leg_counting=1`). The reward is the `<answer>` tag's content (or
the last number) scored by the dataset's `score_answer`, in the verifier processes.
"""

from configs import smollm2

TASK = "reasoning_gym:chain_sum"
OPTIONS = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'


def get_config(arg: str | None = None):
  c = smollm2.get_config()
  c.workdir = "runs/reasoning_gym"
  c.rollout.update(max_prompt_len=64, max_new_tokens=64)
  c.optimizer.micro_batch_tokens = 2048  # 4096 peaked past this 24 GB host once a longer batch compiled
  c.data.update(task=TASK, task_options=OPTIONS, n_train=2048, n_eval=64, system_prompt="")
  c.reward.update(name="reasoning_gym", answer="auto")
  c.controller.steps = 20
  c.eval.update(n_samples=8, greedy=True)
  if arg == "smoke":
    c.workdir = "runs/reasoning_gym_smoke"
    c.controller.steps = 2
    c.data.n_eval = 8
    c.eval.n_samples = 2
  elif arg:
    raise ValueError(f"configs/reasoning_gym.py: unknown argument {arg!r}; use 'smoke'")
  return c
