"""GRPO on SmolLM2-135M-Instruct with a generative judge as the reward: a model reads each reply against a rubric.

  python -m launch.fetch_model smollm2 --out=~/.cache/smollm2-135m-instruct   # policy and judge, once
  python -m launch.main --config=configs/smollm2_judge.py
  python -m launch.main --config=configs/smollm2_judge.py --config.judge.hf_checkpoint=/path/to/a/bigger/judge
  python -m launch.main --config=configs/smollm2_judge.py:smoke    # 1 step, 8 eval prompts

The prompts and policy of configs/smollm2.py; the reward is the judge's (`reward.name=judge`, rlax.judges): the
judge (here SmolLM2-135M-Instruct itself; any HF chat model works, with its own tokenizer) sits beside the
sampler, reads the rubric, the question, the reference and the reply (plain text, cut to fit), and answers
yes or no, greedily, through rlax's engine, every step's replies in one batch. Its failures, timeouts and
throughput are in every metrics row (`reward/judge_*`, `reward/judged_per_s`); a sample of its verdicts is in
<workdir>/logs/judge.jsonl. A 135M judge is a weak grader: this config shows the machinery, not a recipe.
"""

import os

from configs import smollm2

TEMPLATE = """Question: {question}
Reference answer: {reference}
Reply: {reply}

{rubric} Answer with one word: yes or no."""


def get_config(arg: str | None = None):
  c = smollm2.get_config()
  c.workdir = "runs/smollm2_judge"
  c.controller.steps = 4
  c.data.n_eval = 32  # the judge reads every held-out reply too: 32 x 4 of them, not 128 x 8
  c.eval.n_samples = 4
  c.reward.name = "judge"
  c.judge.update(hf_checkpoint=os.path.expanduser("~/.cache/smollm2-135m-instruct"), template=TEMPLATE,
                 rubric="Is the reply's number equal to the reference answer?", verdict="label", labels="yes=1,no=0",
                 max_prompt_len=160, max_new_tokens=8)
  if arg == "smoke":
    c.workdir = "runs/smollm2_judge_smoke"
    c.controller.steps = 1
    c.data.n_eval = 8
    c.eval.n_samples = 2
  elif arg:
    raise ValueError(f"configs/smollm2_judge.py: unknown argument {arg!r}; use 'smoke'")
  return c
