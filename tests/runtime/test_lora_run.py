"""A LoRA run end to end on a tiny HF directory: adapters train while the base stays frozen, a push carries
the adapters only, a preempted run resumes to the uninterrupted run's adapters bitwise (deterministic mode),
and its checkpoint exports as a PEFT directory and as a merged HF directory that transformers loads."""

import json
import os

import jax
import numpy as np

from configs import base
from harness import hf_models
from rlax import export
from rlax import models
from rlax.data.records import Record, write_jsonl
from rlax.models import hf
from rlax.models import lora as L
from rlax.runtime import Controller

PROMPTS = ["what is two plus two?", "solve twelve plus thirty", "the cat sat on the mat", "hi", "what is two?",
           "solve the cat", "two plus the mat", "sat on two"]


def _reward(text, record):
  return float(len(text) % 3 == 0), {}


def _config(workdir, src, data):
  c = base.get_config()
  c.workdir = str(workdir)
  c.deterministic = True
  c.model.hf_checkpoint = str(src)
  c.model.overrides = dict(dtype="float32")
  c.model.lora.update(rank=4, alpha=8.0, targets="all")
  c.topology.update(slice_size=2, trainer_slices=2, sampler_slices=2)
  c.rollout.update(prompts_per_step=2, samples_per_prompt=2, max_prompt_len=32, max_new_tokens=6)
  c.controller.update(steps=3, max_staleness=1)
  c.optimizer.lr = 5e-2
  c.data.update(train_files=str(data), n_eval=2)
  c.eval.n_samples = 2
  c.checkpoint.every_steps = 1
  return c


def test_lora_run_resumes_bitwise_and_exports(tmp_path):
  src = tmp_path / "src"
  hf_models.make_dir(src, "llama", True)
  write_jsonl([Record(id=str(i), prompt=p, answer="four") for i, p in enumerate(PROMPTS)], str(tmp_path / "d.jsonl"))
  whole = Controller(_config(tmp_path / "whole", src, tmp_path / "d.jsonl"), progress=False, reward_fn=_reward)
  want = whole.run()
  base_now = jax.tree.map(np.asarray, whole.trainer.base)
  initial = hf.load_checkpoint(str(src))[1]
  jax.tree.map(np.testing.assert_array_equal, base_now, jax.tree.map(np.asarray, initial))  # the base is frozen
  adapters = whole.final_state.params
  assert jax.tree.structure(adapters) == jax.tree.structure(L.abstract(whole.run_cfg.model, whole.run_cfg.lora))
  assert any(np.abs(np.asarray(x["b"])).max() > 0 for x in adapters["layers"].values())

  def stop_after_first(ctl, step, row):
    if step == 0:
      ctl.request_stop()

  cut = _config(tmp_path / "cut", src, tmp_path / "d.jsonl")
  first = Controller(cut, progress=False, reward_fn=_reward, callbacks=[stop_after_first]).run()
  assert first["preempted"]
  again = Controller(cut, progress=False, reward_fn=_reward).run()
  assert again["steps"] == 3 and again["params_sha256"] == want["params_sha256"]

  # Slice faults: a sampler slice, then a trainer slice, lost mid-run. The rebuilt sampler gets the base again;
  # the rebuilt trainer reads the base onto its new mesh and restores the adapters from the checkpoint.
  faulted = _config(tmp_path / "faults", src, tmp_path / "d.jsonl")
  faulted.faults.update(lose_slice_at="3:1,0:2")
  ctl = Controller(faulted, progress=False, reward_fn=_reward)
  out = ctl.run()
  rec = [e for e in ctl.faults.events if e["event"] == "recovered"]
  assert [(e["lost"], e["steps_lost"]) for e in rec] == [([3], 0), ([0], 1)], rec
  assert out["steps"] == 3 and out["params_sha256"] == want["params_sha256"]
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, ctl.trainer.base), base_now)

  # The checkpoint holds the adapters (and their moments) only; it exports both ways.
  peft_dir = export.export_checkpoint(str(tmp_path / "whole"), str(tmp_path / "peft"), lora="adapter")
  assert peft_dir["files"] == ["adapter_config.json", "adapter_model.safetensors"]
  conf = json.load(open(os.path.join(tmp_path / "peft", "adapter_config.json")))
  assert conf["r"] == 4 and conf["lora_alpha"] == 8.0 and conf["base_model_name_or_path"] == str(src)
  merged = export.export_checkpoint(str(tmp_path / "whole"), str(tmp_path / "merged"))
  tokens = np.random.default_rng(0).integers(0, 67, size=(2, 11)).astype(np.int32)
  f32 = whole.run_cfg.model.replace(dtype="float32")
  host = lambda t: jax.tree.map(np.asarray, t)
  ours = models.forward(L.merge(host(initial), host(adapters), whole.run_cfg.lora), f32, tokens)[0]
  hf_models.assert_close(ours, hf_models.logits(hf_models.reload(merged["export_dir"]), tokens))
  hf_models.assert_close(ours, hf_models.logits(hf_models.reload(want["export_dir"]), tokens))  # the run's own export
