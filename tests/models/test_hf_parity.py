"""rlax ⇄ transformers: logits parity on load, export that transformers reloads, sharded loading."""

import glob
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P

from rlax import models as M
from rlax.models import hf
import hf_testutil as U

TOL = 1e-4


@pytest.mark.parametrize("case", sorted(U.CASES))
def test_load_matches_transformers_logits(case, tmp_path):
  model = U.make_hf_model(case)
  sharded = case.endswith("tied")  # half the cases go through an index json and several files
  model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json") == sharded
  cfg, params = hf.load_checkpoint(str(tmp_path))
  arch, extra = U.CASES[case]
  assert (cfg.arch, cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm) == (
      arch, extra["tie_word_embeddings"], arch == "qwen2", arch == "qwen3")
  assert ("lm_head" in params) != cfg.tie_embeddings
  tokens = U.random_tokens()
  ref = U.hf_logits(model, tokens)
  out, _ = M.forward(params, cfg, tokens)
  assert np.abs(np.asarray(out) - ref).max() <= TOL
  assert np.abs(ref).max() > 1.0  # logits are O(1): the tolerance is meaningful


def test_llama3_rope_scaling_is_exercised(tmp_path):
  """Without the llama3 scaling the same weights disagree with transformers: the case is not vacuous."""
  model = U.make_hf_model("llama_untied_llama3rope")
  model.save_pretrained(tmp_path)
  cfg, params = hf.load_checkpoint(str(tmp_path))
  assert cfg.rope_scaling == M.RopeScaling(8.0, 1.0, 4.0, 32)
  ref = U.hf_logits(model, U.random_tokens())
  out, _ = M.forward(params, cfg.replace(rope_scaling=None), U.random_tokens())
  assert np.abs(np.asarray(out) - ref).max() > 1e-2


EXPORT_CFGS = {
    "llama": M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="llama", rope_scaling=M.RopeScaling(8.0, 1.0, 4.0, 32),
                           rope_theta=5e5),
    "qwen2": M.ModelConfig(96, 32, 2, 4, 2, 8, 64, arch="qwen2", qkv_bias=True, tie_embeddings=True,
                           rope_theta=1e6, norm_eps=1e-6),
    "qwen3": M.ModelConfig(96, 32, 2, 4, 1, 16, 48, arch="qwen3", qk_norm=True),
}


@pytest.mark.parametrize("arch", sorted(EXPORT_CFGS))
def test_export_reloads_in_transformers(arch, tmp_path):
  cfg = EXPORT_CFGS[arch]
  params = U.scaled_params(cfg, seed=3)
  written = hf.save_checkpoint(params, cfg, str(tmp_path), max_shard_bytes=20_000)
  files = sorted(glob.glob(str(tmp_path / "*.safetensors")))
  assert len(files) > 1 and "model.safetensors.index.json" in written
  assert all(os.path.getsize(f) < 20_000 + 4096 for f in files)  # + header
  with open(tmp_path / "config.json") as f:
    hf_cfg = json.load(f)
  assert hf_cfg["model_type"] == arch and hf_cfg["architectures"] == [f"{arch.capitalize()}ForCausalLM"]
  assert hf_cfg["torch_dtype"] == "float32"

  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").float()
  assert type(model).__name__ == hf_cfg["architectures"][0]
  tokens = U.random_tokens(seed=1)
  out, _ = M.forward(params, cfg, tokens)
  assert np.abs(np.asarray(out) - U.hf_logits(model, tokens)).max() <= TOL

  cfg2, params2 = hf.load_checkpoint(str(tmp_path))
  assert cfg2 == cfg
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_export_bf16_keeps_dtype(tmp_path):
  cfg = EXPORT_CFGS["qwen2"].replace(param_dtype="bfloat16", dtype="bfloat16")
  params = U.scaled_params(cfg)
  hf.save_checkpoint(params, cfg, str(tmp_path))
  assert os.path.exists(tmp_path / "model.safetensors")
  assert not os.path.exists(tmp_path / "model.safetensors.index.json")
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  assert model.dtype == torch.bfloat16
  cfg2, params2 = hf.load_checkpoint(str(tmp_path))
  assert cfg2.param_dtype == cfg2.dtype == "bfloat16"
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_save_replaces_a_previous_sharded_save(tmp_path):
  cfg = EXPORT_CFGS["llama"]
  hf.save_checkpoint(U.scaled_params(cfg, seed=1), cfg, str(tmp_path), max_shard_bytes=20_000)
  params = U.scaled_params(cfg, seed=2)
  hf.save_checkpoint(params, cfg, str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  _, params2 = hf.load_checkpoint(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(params2["layers"]["q"]), np.asarray(params["layers"]["q"]))


class _CountingFile:
  """safe_open stand-in that records the size of every slice read, per tensor name."""

  def __init__(self, real, reads):
    self.real, self.reads = real, reads

  def __enter__(self):
    self.real.__enter__()
    return self

  def __exit__(self, *exc):
    return self.real.__exit__(*exc)

  def keys(self):
    return self.real.keys()

  def get_slice(self, name):
    sl, reads = self.real.get_slice(name), self.reads

    class Slice:
      get_shape = sl.get_shape

      def __getitem__(self, idx):
        out = sl[idx]
        reads.setdefault(name, []).append(out.size)
        return out

    return Slice()


def test_load_onto_mesh_is_sharded_and_equal(tmp_path, monkeypatch):
  model = U.make_hf_model("qwen2_untied")
  model.save_pretrained(tmp_path, max_shard_size="20KB")
  cfg, plain = hf.load_checkpoint(str(tmp_path))
  mesh = M.make_mesh(jax.devices(), fsdp=4, tensor=2)
  reads = {}
  real_open = hf.safe_open
  monkeypatch.setattr(hf, "safe_open", lambda *a, **kw: _CountingFile(real_open(*a, **kw), reads))
  _, sharded = hf.load_checkpoint(str(tmp_path), mesh=mesh)
  monkeypatch.undo()
  # Each device read only its own block: 8 disjoint reads of 1/8 of q_proj (2 heads × D/4 columns).
  q_reads = reads["model.layers.1.self_attn.q_proj.weight"]
  assert sorted(q_reads) == [32 * 32 // 8] * 8
  assert sorted(reads["model.embed_tokens.weight"]) == [96 * 32 // 8] * 8
  want = M.param_shardings(cfg, mesh)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), plain, sharded)
  jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim) or pytest.fail(f"{a.sharding} != {s}"),
               sharded, want)
  q = sharded["layers"]["q"]  # [L, D, H, Dh] = [2, 32, 4, 8] over fsdp=4 (D), tensor=2 (H)
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)
  assert len(q.addressable_shards) == 8
  assert {s.data.shape for s in q.addressable_shards} == {(2, 8, 2, 8)}
  assert sharded["embed"].addressable_shards[0].data.shape == (48, 8)  # [V/tensor, D/fsdp]
  assert sharded["lm_head"].addressable_shards[0].data.shape == (8, 48)
  tokens = U.random_tokens(batch=4)
  with jax.set_mesh(mesh):
    out, _ = jax.jit(lambda p, t: M.forward(p, cfg, t))(sharded, tokens)
  assert np.abs(np.asarray(out) - U.hf_logits(model, tokens)).max() <= TOL
  # Export gathers from the sharded arrays; a reload is bit-identical.
  hf.save_checkpoint(sharded, cfg, str(tmp_path / "export"), extra_config={"eos_token_id": 7})
  with open(tmp_path / "export" / "config.json") as f:
    assert json.load(f)["eos_token_id"] == 7
  _, again = hf.load_checkpoint(str(tmp_path / "export"))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), plain, again)


def test_bf16_load_runs_close_to_f32(tmp_path):
  model = U.make_hf_model("qwen3_untied")
  model.save_pretrained(tmp_path)
  cfg, params = hf.load_checkpoint(str(tmp_path), dtype="bfloat16")
  assert cfg.dtype == cfg.param_dtype == "bfloat16"
  assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(params))
  tokens = U.random_tokens()
  out, _ = jax.jit(lambda p, t: M.forward(p, cfg, t))(params, tokens)
  out = np.asarray(out)
  ref = U.hf_logits(model, tokens)
  assert out.dtype == np.float32 and np.isfinite(out).all()
  assert np.abs(out - ref).max() < 0.15
  assert (out.argmax(-1) == ref.argmax(-1)).mean() > 0.9
