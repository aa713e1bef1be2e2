"""Tiny random Hugging Face models (torch, CPU, f32) and rlax params for the model tests."""

import jax
import numpy as np
import torch
import transformers

_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256)
# Small original context so that positions < 32 hit all three llama3 frequency bands.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

CASES = {
    "llama_untied_llama3rope": ("llama", dict(tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True, rope_theta=500.0)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_untied": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3_untied": ("qwen3", dict(tie_word_embeddings=False, head_dim=16)),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True, head_dim=16)),
}
_CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}


def make_hf_model(case: str, seed: int = 0):
  """A random-init HF causal LM with O(1) logits: weights ~N(0, 0.15²), norms ~1±0.2, biases nonzero."""
  arch, extra = CASES[case]
  config_cls, model_cls = _CLASSES[arch]
  config = config_cls(**_BASE, **extra, attn_implementation="eager")
  torch.manual_seed(seed)
  model = model_cls(config).to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return model


def hf_logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def random_tokens(batch=2, length=24, seed=0, vocab=96) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, size=(batch, length)).astype(np.int32)


def scaled_params(cfg, seed=0):
  """Random rlax params with O(1) logits, built in numpy (no compiles).

  Weights ~N(0, 0.15²), norms 1±0.2, biases ~N(0, 0.2²).
  """
  from rlax import models as M
  rng = np.random.default_rng(seed)

  def one(path, shape):
    name = path[-1].key
    if name.endswith("norm"):
      x = 1.0 + 0.2 * rng.standard_normal(shape)
    else:
      x = (0.2 if name.endswith("bias") else 0.15) * rng.standard_normal(shape)
    return jax.numpy.asarray(x, cfg.param_dtype)

  return jax.tree.map_with_path(one, M.param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
