"""HF config mapping, the tensor layout maths, and the errors bad checkpoints give."""

import json
import os
import re

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from rlax import models as M
from rlax.models import hf
from rlax.models.hf import _Layout, _layouts
import hf_testutil as U

CFG = M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="qwen2", qkv_bias=True)


def _saved(tmp_path, cfg=CFG):
  hf.save_checkpoint(U.scaled_params(cfg), cfg, str(tmp_path))
  return str(tmp_path / "model.safetensors")


def _edit_tensors(file, fn):
  tensors = load_file(file)
  fn(tensors)
  save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor(tmp_path):
  _edit_tensors(_saved(tmp_path), lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
  with pytest.raises(ValueError, match=re.escape(
      "missing tensor 'model.layers.1.self_attn.k_proj.bias' (expected shape (16,))")):
    hf.load_checkpoint(str(tmp_path))


def test_misshapen_tensor(tmp_path):
  def fn(t):
    t["model.layers.0.mlp.down_proj.weight"] = np.zeros((64, 32), np.float32)  # transposed
  _edit_tensors(_saved(tmp_path), fn)
  with pytest.raises(ValueError, match=re.escape(
      "tensor 'model.layers.0.mlp.down_proj.weight' has shape (64, 32), expected (32, 64)")):
    hf.load_checkpoint(str(tmp_path))


def test_unexpected_tensor(tmp_path):
  def fn(t):
    t["model.layers.2.input_layernorm.weight"] = np.ones((32,), np.float32)
  _edit_tensors(_saved(tmp_path), fn)
  with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.input_layernorm.weight'"):
    hf.load_checkpoint(str(tmp_path))


def test_several_problems_are_counted(tmp_path):
  def fn(t):
    t.pop("model.norm.weight")
    t.pop("lm_head.weight")
  _edit_tensors(_saved(tmp_path), fn)
  with pytest.raises(ValueError, match=r"missing tensor .* \(and 1 more problems\)"):
    hf.load_checkpoint(str(tmp_path))


def test_tied_checkpoint_may_carry_lm_head_and_rotary_buffers(tmp_path):
  cfg = CFG.replace(tie_embeddings=True)

  def fn(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones((4,), np.float32)
  _edit_tensors(_saved(tmp_path, cfg), fn)
  cfg2, params = hf.load_checkpoint(str(tmp_path))
  assert cfg2.tie_embeddings and "lm_head" not in params


def test_index_naming_a_missing_file(tmp_path):
  hf.save_checkpoint(U.scaled_params(CFG), CFG, str(tmp_path), max_shard_bytes=20_000)
  with open(tmp_path / "model.safetensors.index.json") as f:
    second = sorted(set(json.load(f)["weight_map"].values()))[1]
  os.remove(tmp_path / second)
  with pytest.raises(ValueError, match=f"{second}, which does not exist"):
    hf.load_checkpoint(str(tmp_path))


def test_missing_config_and_missing_weights(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json in"):
    hf.load_checkpoint(str(tmp_path))
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf.config_to_hf(CFG), f)
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors files in"):
    hf.load_checkpoint(str(tmp_path))


def _hf(**kw):
  base = dict(model_type="llama", vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64)
  return {**base, **kw}


@pytest.mark.parametrize("bad, message", [
    (dict(model_type="mistral"), "unsupported model_type 'mistral'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_type 'yarn'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "unsupported rope_type 'linear'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing field 'low_freq_factor'"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4096), "use_sliding_window=True"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types="),
    (dict(quantization_config={"quant_method": "fp8"}), "quantized"),
])
def test_unsupported_configs(bad, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    hf.config_from_hf(_hf(**bad))


def test_unknown_model_type_in_checkpoint(tmp_path):
  _saved(tmp_path)
  with open(tmp_path / "config.json") as f:
    c = json.load(f)
  with open(tmp_path / "config.json", "w") as f:
    json.dump({**c, "model_type": "gemma3"}, f)
  with pytest.raises(ValueError, match="unsupported model_type 'gemma3'"):
    hf.load_checkpoint(str(tmp_path))


def test_legacy_config_layout():
  """transformers<5 config.json: rope_theta and rope_scaling at top level, torch_dtype."""
  cfg = hf.config_from_hf(_hf(rope_theta=5e5, torch_dtype="bfloat16", num_key_value_heads=2, rms_norm_eps=1e-5,
                              tie_word_embeddings=True, max_position_embeddings=131072,
                              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
  assert cfg == M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="llama", rope_theta=5e5, norm_eps=1e-5,
                              rope_scaling=M.RopeScaling(32.0, 1.0, 4.0, 8192), tie_embeddings=True,
                              param_dtype="bfloat16", dtype="bfloat16", max_position=131072)
  assert hf.config_from_hf(_hf(torch_dtype="float8_e4m3fn")).param_dtype == "float32"
  assert hf.config_from_hf(_hf(torch_dtype="bfloat16"), dtype="float32").dtype == "float32"


def test_transformers5_config_layout_roundtrips():
  c = transformers.Qwen3Config(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=24, intermediate_size=64, rope_theta=1e6)
  cfg = hf.config_from_hf(c.to_dict())
  assert (cfg.arch, cfg.head_dim, cfg.rope_theta, cfg.qk_norm, cfg.qkv_bias, cfg.n_layers) == (
      "qwen3", 24, 1e6, True, False, 3)
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg


def test_export_refuses_configs_without_hf_equivalent(tmp_path):
  bad = M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="llama", qkv_bias=True)
  with pytest.raises(ValueError, match="arch='llama' with qkv_bias=True"):
    hf.save_checkpoint(U.scaled_params(bad), bad, str(tmp_path))
  params = U.scaled_params(CFG)
  params["layers"]["q"] = params["layers"]["q"][:, :, :2]
  with pytest.raises(ValueError, match=re.escape("params['layers']['q'] has shape (2, 32, 2, 8), expected")):
    hf.save_checkpoint(params, CFG, str(tmp_path))


@pytest.mark.parametrize("leaf", ["q", "o", "down", "q_bias"])
def test_layout_reads_exactly_the_requested_block(leaf):
  """Any block of the rlax array read through HF slices equals the same block of the full transform."""
  lay: _Layout = _layouts(CFG.replace(n_heads=6, n_kv_heads=2, head_dim=4))["layers"][leaf]
  rng = np.random.default_rng(0)
  w = rng.normal(size=lay.hf_shape)
  full = lay.to_rlax(lambda sl: w[sl], tuple(slice(None) for _ in lay.split))
  reads = []

  def read(sl):
    reads.append(w[sl].size)
    return w[sl]

  for _ in range(20):
    idx = []
    for n in full.shape:
      a = int(rng.integers(0, n))
      idx.append(slice(a, int(rng.integers(a + 1, n + 1))))
    np.testing.assert_array_equal(lay.to_rlax(read, tuple(idx)), full[tuple(idx)])
  assert min(reads) < w.size  # partial blocks read partial tensors
  np.testing.assert_array_equal(lay.to_hf(full), w)
