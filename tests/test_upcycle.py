"""launch.upcycle: a dense HF directory in, a Mixtral directory out that transformers loads with the dense
model's logits, its tokenizer alongside; bad input is one line."""

import json
import os
import subprocess
import sys

import numpy as np

from harness import hf_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  return subprocess.run([sys.executable, "-m", "launch.upcycle", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_upcycled_directory_loads_in_transformers_with_the_dense_logits(tmp_path):
  src, out = tmp_path / "dense", tmp_path / "moe"
  hf_models.make_dir(src, "llama", tie=False)
  p = _run(str(src), f"--out={out}", "--experts=3", "--top_k=2", "--router_std=1.0")
  assert p.returncode == 0, p.stderr[-2000:]
  line = json.loads(p.stdout.strip().splitlines()[-1])
  assert (line["arch"], line["n_experts"], line["top_k"]) == ("mixtral", 3, 2)
  assert os.path.isfile(out / "tokenizer.json")
  tokens = np.random.default_rng(0).integers(0, 67, (2, 12))
  dense, moe = hf_models.reload(src), hf_models.reload(out)
  assert type(moe).__name__ == "MixtralForCausalLM"
  hf_models.assert_close(hf_models.logits(moe, tokens), hf_models.logits(dense, tokens))
  bad = _run(str(src), f"--out={tmp_path / 'bad'}", "--top_k=1")
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
      "rlax: upcycle: upcycle: top_k=1 must be >= 2 for the router to learn")
