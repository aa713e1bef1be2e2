"""A corrupt checkpoint file gives one error naming the file."""

import json
import os
import re

import pytest

from rlax import models as M
from rlax.models import hf
import hf_testutil as U

CFG = M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="qwen2", qkv_bias=True)


@pytest.fixture
def ckpt(tmp_path):
  hf.save_checkpoint(U.scaled_params(CFG), CFG, str(tmp_path))
  return tmp_path


@pytest.mark.parametrize("keep", [0.5, 20, 4])
def test_truncated_safetensors_is_named(ckpt, keep):
  f = ckpt / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
  with pytest.raises(ValueError, match=re.escape(f"{f}: not a readable safetensors file (")):
    hf.load_checkpoint(str(ckpt))


@pytest.mark.parametrize("text, match", [
    ('{"model_type": "qwen2", ', "not valid JSON"),
    ("[1]", "expected a JSON object, got list"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_invalid_config_json_is_named(ckpt, text, match):
  cfg = ckpt / "config.json"
  cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(ValueError, match=re.escape(f"{cfg}: {match}")):
    hf.load_checkpoint(str(ckpt))


def test_bad_config_field_is_named(ckpt):
  cfg = ckpt / "config.json"
  d = json.loads(cfg.read_text())
  d["hidden_size"] = "wide"
  cfg.write_text(json.dumps(d))
  with pytest.raises(ValueError, match=re.escape(f"{cfg}: invalid literal for int()")):
    hf.read_config(str(ckpt))


def test_bad_index_is_named(ckpt):
  index = ckpt / "model.safetensors.index.json"
  index.write_text("{}")
  with pytest.raises(ValueError, match=re.escape(f"{index}: has no 'weight_map' object")):
    hf.load_checkpoint(str(ckpt))
  assert os.path.exists(ckpt / "model.safetensors")
