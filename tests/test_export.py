"""rlax.export: HF directories that transformers reloads with the same logits, tokenizer and stop ids."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from configs import demo
from harness import hf_models
from rlax import checkpoint
from rlax import export
from rlax import models as M
from rlax.data.tokenizer import demo_tokenizer
from rlax.models import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["the cat sat on the mat", "what is two plus two?\nfour.", "<|im_start|>user\nhi<|im_end|>"]


def _params(cfg, seed=0):
  """Random rlax params with O(1) logits, built in numpy (no compiles)."""
  rng = np.random.default_rng(seed)

  def one(path, shape):
    x = 1.0 + 0.2 * rng.standard_normal(shape) if path[-1].key.endswith("norm") else 0.15 * rng.standard_normal(shape)
    return x.astype(np.float32)

  return jax.tree.map_with_path(one, M.param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))


def _tokens(vocab, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, size=(2, 13)).astype(np.int32)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)])
def test_hf_model_exports_with_its_tokenizer(arch, tie, tmp_path):
  src, out = tmp_path / "src", tmp_path / "out"
  model = hf_models.hf_model(arch, tie)
  model.save_pretrained(src)
  want = (hf_models.llama_tokenizer if arch == "llama" else hf_models.qwen_tokenizer)(src)
  cfg, params = hf.load_checkpoint(str(src))
  assert (cfg.arch, cfg.tie_embeddings, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads) == (arch, tie, 67, 3, 1)

  files = export.export_hf(params, cfg, str(out), tokenizer_dir=str(src))
  assert files == sorted(os.listdir(out)) and {"config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json", "generation_config.json"} <= set(files)
  assert not os.path.exists(f"{out}.tmp") and not os.path.exists(f"{out}.old")

  tokens = _tokens(67)
  ref, _ = M.forward(params, cfg, tokens)
  reloaded = hf_models.reload(out)
  assert type(reloaded) is type(model)
  hf_models.assert_close(ref, hf_models.logits(reloaded, tokens))
  hf_models.assert_close(ref, hf_models.logits(model, tokens))  # and the source model agrees: nothing was lost on the way
  assert np.abs(np.asarray(ref)).max() > 1.0  # O(1) logits: the tolerance means something

  ours, theirs = hf.load_tokenizer(str(src)), transformers.AutoTokenizer.from_pretrained(str(out))
  for text in TEXTS:
    assert theirs.encode(text) == ours.encode(text) == hf.load_tokenizer(str(out)).encode(text)
  assert (ours.encode("the cat")[0] == want["bos"]) == (arch == "llama")  # llama's post-processor adds bos
  with open(out / "generation_config.json") as f:
    gen = json.load(f)
  assert {k: gen[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
      "bos_token_id": want["bos"], "eos_token_id": want["eos"], "pad_token_id": want["pad"]}
  assert all(gen[k] == v for k, v in want["gen"].items() if k != "eos_token_id")  # sampling defaults kept
  assert reloaded.generation_config.eos_token_id == want["eos"]
  with open(out / "config.json") as f:
    assert json.load(f)["eos_token_id"] == want["eos"]
  if arch == "qwen2":
    messages = [{"role": "user", "content": "two plus two?"}]
    prompt = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ours.apply_chat_template(messages) == "<|im_start|>user\ntwo plus two?<|im_end|>\n" \
                                                           "<|im_start|>assistant\n"


def test_demo_tokenizer_export(tmp_path):
  cfg = M.ModelConfig(128, 24, 2, 3, 1, 8, 40, tie_embeddings=True)
  params = _params(cfg, 0)
  export.export_hf(params, cfg, str(tmp_path / "out"), tokenizer=demo_tokenizer())
  ours, theirs = demo_tokenizer(), transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  for text in ["12+30=42", "Sort: 3 1 2\nAnswer:", "ünïcode"]:  # the last one hits <unk>
    ids = theirs.encode(text)
    assert ids == ours.encode(text) and ids[0] == 1
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
  assert 3 in theirs.encode("ü")
  assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token_id) == (1, 2, 0, 3)
  again = hf.load_tokenizer(str(tmp_path / "out"))
  assert (again.bos_id, again.eos_ids, again.pad_id, again.chat_template) == (1, (2,), 0, None)
  with open(tmp_path / "out" / "generation_config.json") as f:
    assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
  tokens = _tokens(128)
  hf_models.assert_close(M.forward(params, cfg, tokens)[0], hf_models.logits(hf_models.reload(tmp_path / "out"), tokens))


def test_dtype_and_replacing_an_earlier_export(tmp_path, monkeypatch):
  cfg = M.ModelConfig(128, 24, 2, 3, 1, 8, 40)
  params = _params(cfg, 1)
  out = tmp_path / "out"
  export.export_hf(params, cfg, str(out), tokenizer=demo_tokenizer())
  (out / "leftover.txt").write_text("from the first export")
  files = export.export_hf(params, cfg.replace(tie_embeddings=True), str(out), tokenizer=demo_tokenizer(),
                           dtype="bfloat16")
  assert "leftover.txt" not in files and not (out / "leftover.txt").exists()
  with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
    assert "lm_head.weight" not in f.keys()
  assert hf_models.reload(out).config.tie_word_embeddings
  assert transformers.AutoModelForCausalLM.from_pretrained(str(out)).dtype == torch.bfloat16

  def crash(*a, **k):
    raise RuntimeError("disk full")

  monkeypatch.setattr(export.hf, "save_checkpoint", crash)
  with pytest.raises(RuntimeError, match="disk full"):
    export.export_hf(params, cfg, str(out), tokenizer=demo_tokenizer())
  assert sorted(os.listdir(tmp_path)) == ["out"]  # the earlier export is untouched, no .tmp is left
  assert hf.read_config(str(out)).tie_embeddings


def test_bad_arguments_are_one_clear_error(tmp_path):
  cfg = M.ModelConfig(128, 24, 1, 3, 1, 8, 40)
  params = _params(cfg, 0)
  with pytest.raises(ValueError, match="needs a tokenizer or a tokenizer_dir"):
    export.export_hf(params, cfg, str(tmp_path / "a"))
  with pytest.raises(ValueError, match="dtype='int8'"):
    export.export_hf(params, cfg, str(tmp_path / "a"), tokenizer=demo_tokenizer(), dtype="int8")
  with pytest.raises(ValueError, match="no tokenizer.json"):
    export.export_hf(params, cfg, str(tmp_path / "a"), tokenizer_dir=str(tmp_path))
  small = cfg.replace(vocab_size=67)
  with pytest.raises(ValueError, match="100 tokens but the model's vocab_size is 67"):
    export.export_hf(_params(small, 0), small, str(tmp_path / "a"), tokenizer=demo_tokenizer())
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me")
  with pytest.raises(ValueError, match="not an earlier export"):
    export.export_hf(params, cfg, str(tmp_path / "mine"), tokenizer=demo_tokenizer())
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
  assert sorted(os.listdir(tmp_path)) == ["mine"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The tiny demo config trained for 2 steps, a checkpoint at step 0 and after each: (workdir, final params)."""
  from rlax.runtime import Controller
  c = demo.get_config("tiny")
  c.workdir = str(tmp_path_factory.mktemp("run"))
  c.controller.steps = 2
  c.checkpoint.every_steps = 1
  # Varied rewards (the untrained policy scores 0 on the task) so that each step moves the params.
  ctl = Controller(c, progress=False, reward_fn=lambda text, record: (float(len(text) % 2), {}))
  ctl.run()
  return c.workdir, jax.device_get(ctl.final_state.params)


def test_export_checkpoint_matches_the_trained_params(run, tmp_path):
  workdir, final = run
  got = export.export_checkpoint(workdir, str(tmp_path / "hf"))
  assert got["step"] == 2 and got["export_dir"] == str(tmp_path / "hf")
  assert got["files"] == sorted(os.listdir(tmp_path / "hf"))
  cfg, params = hf.load_checkpoint(str(tmp_path / "hf"))
  assert (cfg.vocab_size, cfg.d_model, cfg.n_layers) == (128, 32, 1)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, final)
  tokens = _tokens(128, seed=2)
  hf_models.assert_close(M.forward(final, cfg, tokens)[0], hf_models.logits(hf_models.reload(tmp_path / "hf"), tokens))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  assert theirs.encode("3 1 2") == demo_tokenizer().encode("3 1 2")

  step, restored, meta = checkpoint.restore_params(workdir, 1)  # only the params, on one CPU device
  assert step == 1 and meta["step"] == 1 and set(restored) == set(final)
  assert {leaf.sharding for leaf in jax.tree.leaves(restored)} == {
      jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])}
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(final)))
  policy = checkpoint.load_policy(workdir)  # the newest, with the model config the run recorded
  assert policy.step == 2 and (policy.model.vocab_size, policy.model.d_model, policy.model.n_layers) == (128, 32, 1)
  assert not policy.lora.enabled and policy.hf_checkpoint == ""
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), policy.params, final)


def test_missing_checkpoints_are_one_clear_error(run, tmp_path):
  workdir, _ = run
  with pytest.raises(ValueError, match=r"has no checkpoint of step 7; its checkpoints are steps 0, 1, 2"):
    export.export_checkpoint(workdir, str(tmp_path / "hf"), step=7)
  with pytest.raises(ValueError, match=f"workdir {tmp_path} has no checkpoints"):
    export.export_checkpoint(str(tmp_path), str(tmp_path / "hf"))
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(ValueError, match="no finished checkpoint"):
    export.export_checkpoint(str(tmp_path), str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "launch.export", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)


def test_command_line(run, tmp_path):
  r = _cli("--help")
  assert r.returncode == 0, r.stderr[-2000:]
  assert all(f"--{flag}:" in r.stdout for flag in ("workdir", "out", "step", "dtype"))
  workdir, _ = run
  r = _cli(f"--workdir={workdir}", f"--out={tmp_path / 'hf'}", "--step=1", "--dtype=bfloat16")
  assert r.returncode == 0, r.stderr[-2000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["step"] == 1 and got["export_dir"] == str(tmp_path / "hf") and "model.safetensors" in got["files"]
  assert hf.read_config(str(tmp_path / "hf")).param_dtype == "bfloat16"
  r = _cli(f"--workdir={workdir}", f"--out={tmp_path / 'hf'}", "--step=9")
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      f"rlax: export: workdir {workdir} has no checkpoint of step 9; its checkpoints are steps 0, 1, 2"]
