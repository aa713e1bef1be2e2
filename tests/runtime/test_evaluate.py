"""launch.evaluate's numbers are the runtime's: the same model, data, samples and seed give the held-out
metrics the runtime reports before training (an HF directory) and after it (the run's checkpoint)."""

import os
import subprocess
import sys


from configs import base
from harness import hf_models
from rlax import config as config_lib
from rlax.data.records import Record, write_jsonl
from rlax.runtime import Controller
from rlax.evaluation import evaluate_model

PROMPTS = ["what is two plus two?", "solve twelve plus thirty", "the cat sat on the mat", "hi", "what is two?",
           "solve the cat", "two plus the mat", "sat on two"]
REWARD = "def varies(text, record):\n  return float(len(text) % 3 == 0), {}\n"


def _config(workdir, src, data):
  c = base.get_config()
  c.workdir = str(workdir)
  c.model.hf_checkpoint = str(src)
  c.topology.update(slice_size=2, trainer_slices=2, sampler_slices=2)
  c.rollout.update(prompts_per_step=2, samples_per_prompt=2, max_prompt_len=32, max_new_tokens=6)
  c.controller.update(steps=1, max_staleness=0)
  c.optimizer.lr = 1e-2
  c.data.update(train_files=str(data), n_eval=4)
  c.eval.update(n_samples=4, greedy=True)
  c.reward.name = "eval_rewards:varies"  # a user's reward by import path
  c.checkpoint.every_steps = 1
  return c


def test_evaluate_equals_the_runtime_before_and_after(tmp_path, monkeypatch):
  (tmp_path / "eval_rewards.py").write_text(REWARD)
  monkeypatch.syspath_prepend(str(tmp_path))
  src = tmp_path / "src"
  hf_models.make_dir(src, "llama", True)
  write_jsonl([Record(id=str(i), prompt=p, answer="four", source=f"s{i % 2}") for i, p in enumerate(PROMPTS)],
              str(tmp_path / "train.jsonl"))
  ctl = Controller(_config(tmp_path / "run", src, tmp_path / "train.jsonl"), progress=False)
  seen, evaluate = {}, ctl.evaluate
  ctl.evaluate = lambda tag: seen.setdefault(tag, evaluate(tag))
  ctl.run()
  before = evaluate_model(_config(tmp_path / "x", src, tmp_path / "train.jsonl"))
  after = evaluate_model(_config(tmp_path / "y", src, tmp_path / "train.jsonl"), checkpoint=str(tmp_path / "run"))
  for got, want in ((before, seen["before"]), (after, seen["after"])):
    assert {k: got[k] for k in want} == want
    assert {"pass@1", "pass@4", "greedy_accuracy", "mean_length", "truncation_rate", "pass@1/s0"} <= set(got)
  assert after["model"].endswith("run@1") and before["model"] == str(src)
  assert 0 < before["mean_reward"] < 1 and 0 <= before["truncation_rate"] <= 1 and before["mean_length"] > 0


def test_evaluate_takes_a_typed_run_config(tmp_path, monkeypatch):
  """A RunConfig (as `config.load` returns it) evaluates as its ConfigDict does, --model replacing its model."""
  (tmp_path / "eval_rewards.py").write_text(REWARD)
  monkeypatch.syspath_prepend(str(tmp_path))
  src = tmp_path / "src"
  hf_models.make_dir(src, "llama", True)
  write_jsonl([Record(id=str(i), prompt=p, answer="four", source=f"s{i % 2}") for i, p in enumerate(PROMPTS)],
              str(tmp_path / "train.jsonl"))
  cd = _config(tmp_path / "x", src, tmp_path / "train.jsonl")
  want = evaluate_model(cd, n_samples=2, n_prompts=3, greedy=False)
  assert cd.workdir == str(tmp_path / "x") and cd.eval.n_samples == 4  # the caller's config stays as given
  cd.model.hf_checkpoint = ""  # a random-init preset, replaced by --model
  run = config_lib.load(cd)
  got = evaluate_model(run, model=str(src), n_samples=2, n_prompts=3, greedy=False)
  assert got == want and got["model"] == str(src) and got["n_samples"] == 2 and "pass@2" in got
  assert run.hf_checkpoint == "" and run.eval.n_samples == 4


def test_evaluate_command_is_one_error_line_on_bad_input(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-m", "launch.evaluate", "--model=a", "--checkpoint=b"], capture_output=True,
                       text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "rlax: evaluate: give --model (an HF directory) or --checkpoint (a run's workdir), not both")
