"""A run whose reward is a judge, end to end: a tiny policy, a programmed judge (it says "four" to every reply,
so every reward is its verdict, 1) loaded beside the sampler, its counts in every metrics row, its samples in the
run's logs, and a config that names one without the other refused."""

import json

import pytest

from harness import hf_models
from harness import judges as judges_harness
from rlax import config as config_lib
from rlax.data.records import Record, write_jsonl
from rlax.runtime import Controller

PROMPTS = ["what is two plus two?", "solve twelve plus thirty", "the cat sat on the mat", "hi"]
TEMPLATE = judges_harness.TEMPLATE


def _config(tmp_path):
  return judges_harness.run_config(tmp_path)


def test_a_judged_run_rewards_every_reply_with_the_judges_verdict(tmp_path):
  hf_models.make_dir(tmp_path / "policy", "llama", tie=False, seed=0)
  judges_harness.programmed(tmp_path / "judge", "four", Record(id="x", prompt="q", answer=""), template=TEMPLATE)
  write_jsonl([Record(id=str(i), prompt=p, answer=None) for i, p in enumerate(PROMPTS)], str(tmp_path / "train.jsonl"))
  ctl = Controller(_config(tmp_path), progress=False)
  out = ctl.run()
  assert out["steps"] == 2 and out["pass1_before"] == 1.0 and out["pass1_after"] == 1.0
  for r in ctl.metrics.history:
    assert r["reward"] == 1.0 and r["reward/judge_failed"] == 0.0 and r["reward/judge_timeout"] == 0.0
    assert r["reward/judged_per_s"] > 0
  logged = [json.loads(line) for line in open(tmp_path / "run" / "logs" / "judge.jsonl")]
  assert logged and all(x["verdict"].strip() == "four" and x["reward"] == 1.0 for x in logged)


@pytest.mark.parametrize("reward, judge", [("judge", ""), ("arithmetic", "set")])
def test_a_judge_and_reward_judge_come_together(tmp_path, reward, judge):
  hf_models.make_dir(tmp_path / "policy", "llama", tie=False, seed=0)
  hf_models.make_dir(tmp_path / "judge", "qwen2", tie=False, seed=0)
  write_jsonl([Record(id=str(i), prompt=p, answer="") for i, p in enumerate(PROMPTS)], str(tmp_path / "train.jsonl"))
  c = _config(tmp_path)
  c.reward.name = reward
  if not judge:
    c.judge.hf_checkpoint = ""
  with pytest.raises(ValueError, match="reward.name='judge' needs a judge"):
    config_lib.load(c)
