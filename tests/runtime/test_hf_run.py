"""A tiny random HF Llama / Qwen2 directory through the runtime: loaded, sampled with its own stop tokens and
prompt format, rewarded, trained, checkpointed, resumed, exported and reloaded by transformers."""

import jax
import numpy as np
import pytest

from configs import base
from harness import hf_models
from rlax import models
from rlax.models import hf
from rlax.data.records import Record, write_jsonl
from rlax.runtime import Controller

PROMPTS = ["what is two plus two?", "solve twelve plus thirty", "the cat sat on the mat", "hi", "what is two?",
           "solve the cat", "two plus the mat", "sat on two"]


def _config(workdir, src, data, **model_over):
  c = base.get_config()
  c.workdir = str(workdir)
  c.model.hf_checkpoint = str(src)
  c.model.overrides = dict(model_over)
  c.topology.update(slice_size=2, trainer_slices=2, sampler_slices=2)
  c.rollout.update(prompts_per_step=2, samples_per_prompt=2, max_prompt_len=32, max_new_tokens=6)
  c.controller.update(steps=3, max_staleness=1)
  c.optimizer.lr = 1e-2
  c.data.update(train_files=str(data), n_eval=2)
  c.eval.n_samples = 2
  c.checkpoint.every_steps = 1
  return c


def _reward(text, record):
  return float(len(text) % 3 == 0), {}  # varies across samples, so the policy really moves


@pytest.mark.parametrize("arch,tie,over", [("llama", True, {}), ("qwen2", False, {"dtype": "float32"})])
def test_hf_directory_trains_resumes_and_exports(arch, tie, over, tmp_path):
  src = tmp_path / "src"
  want = hf_models.make_dir(src, arch, tie)
  write_jsonl([Record(id=str(i), prompt=p, answer="four", source=f"s{i % 2}") for i, p in enumerate(PROMPTS)],
              str(tmp_path / "train.jsonl"))
  cfg = lambda: _config(tmp_path / "run", src, tmp_path / "train.jsonl", **over)

  def stop_after_first(ctl, step, row):
    if step == 0:
      ctl.request_stop()

  first = Controller(cfg(), progress=False, reward_fn=_reward, callbacks=[stop_after_first])
  run = first.run_cfg
  assert run.model.vocab_size == 67 and run.model.arch == arch and run.model.tie_embeddings == tie
  assert run.model.param_dtype == "float32" and run.model.dtype == over.get("dtype", "bfloat16")
  eos = want["eos"] if isinstance(want["eos"], list) else [want["eos"]]
  assert list(first.sampler.eos_ids) == eos and first.sampler.pad_id == want["pad"]
  prompt = first.render.text(first.eval_records[0])
  assert prompt.startswith("<|im_start|>user\n") if arch == "qwen2" else prompt == first.eval_records[0].prompt
  ids = first.render.encode(first.eval_records[0])
  assert (ids[0] == want["bos"]) == (arch == "llama")  # Llama's post-processor adds BOS; ChatML has none
  out = first.run()
  assert out["preempted"] and out["steps"] == 1
  row = first.metrics.history[0]
  assert {"response_len_p95", "truncation_rate"} <= set(row)
  sources = {k.split("/", 1)[1] for k in row if k.startswith("reward/")}
  assert sources and sources <= {"s0", "s1"} and all(f"pass_rate/{s}" in row for s in sources)

  second = Controller(cfg(), progress=False, reward_fn=_reward)
  out = second.run()
  assert out["steps"] == 3 and not out["preempted"] and [r["step"] for r in second.metrics.history] == [0, 1, 2]
  initial = hf.load_checkpoint(str(src))[1]
  final = second.final_state.params
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(final)))

  tokens = np.random.default_rng(0).integers(0, 67, size=(2, 11)).astype(np.int32)
  f32 = run.model.replace(dtype="float32")
  hf_models.assert_close(models.forward(final, f32, tokens)[0],
                         hf_models.logits(hf_models.reload(out["export_dir"]), tokens))
