"""Hugging Face `config.json` ⇄ ModelConfig for Llama 3, Qwen2/2.5, Qwen3, Qwen2-MoE, Qwen3-MoE and Mixtral.

Reads both the transformers<5 layout (`rope_theta` + `rope_scaling` at top level,
`torch_dtype`) and the transformers 5 layout (`rope_parameters` holding theta,
`dtype`); writes the older layout, which both generations of transformers (and
vLLM) read. Anything the rlax transformer does not compute (sliding windows,
other RoPE types, biases outside q/k/v, non-SiLU MLPs, quantization) is refused
with a ValueError naming the field, rather than loaded into a wrong model.
"""

from __future__ import annotations

from typing import Any, Optional

from rlax.models.config import ModelConfig, MoEConfig, RopeScaling

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}
# (qkv_bias, qk_norm) each HF class computes
_ATTENTION = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True), "mixtral": (False, False),
              "qwen2_moe": (True, False), "qwen3_moe": (False, True)}
_DTYPES = ("float32", "bfloat16", "float16")


def _rope(d: dict) -> tuple[float, Optional[RopeScaling]]:
  """(rope_theta, RopeScaling|None) from either config layout."""
  rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
  if any(isinstance(v, dict) for v in rp.values()):
    raise ValueError(f"per-layer-type rope parameters are not supported: {sorted(rp)}")
  theta = float(rp.get("rope_theta", d.get("rope_theta", 10_000.0)))
  rope_type = rp.get("rope_type", rp.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: 'default', 'llama3')")
  try:
    scaling = RopeScaling(factor=float(rp["factor"]), low_freq_factor=float(rp["low_freq_factor"]),
                          high_freq_factor=float(rp["high_freq_factor"]),
                          original_max_position=int(rp["original_max_position_embeddings"]))
  except KeyError as e:
    raise ValueError(f"llama3 rope scaling is missing field {e.args[0]!r}") from None
  return theta, scaling


def _refuse(d: dict, field: str, ok, what: str):
  if field in d and d[field] is not None and not ok(d[field]):
    raise ValueError(f"unsupported {what}: {field}={d[field]!r}")


def _moe(hf: dict[str, Any]) -> Optional[MoEConfig]:
  """The routed experts of a MoE config.json (every layer sparse), None for a dense model type."""
  t = hf["model_type"]
  if t not in ("mixtral", "qwen2_moe", "qwen3_moe"):
    return None
  n_layers = int(hf["num_hidden_layers"])
  step, dense = int(hf.get("decoder_sparse_step") or 1), list(hf.get("mlp_only_layers") or [])
  if dense or any((i + 1) % step for i in range(n_layers)):
    raise ValueError(f"unsupported layer mix: mlp_only_layers={dense}, decoder_sparse_step={step} (rlax stacks "
                     "layers of one kind; every layer must be sparse)")
  for key in ("num_experts_per_tok",) + (() if t == "mixtral" else ("moe_intermediate_size",)):
    if key not in hf:
      raise ValueError(f"HF config for {t!r} is missing {key!r}")
  n_experts = hf.get("num_local_experts") if t == "mixtral" else hf.get("num_experts", hf.get("num_local_experts"))
  if n_experts is None:
    raise ValueError(f"HF config for {t!r} is missing {'num_local_experts' if t == 'mixtral' else 'num_experts'!r}")
  return MoEConfig(n_experts=int(n_experts), top_k=int(hf["num_experts_per_tok"]),
                   expert_mlp_dim=int(hf["intermediate_size"] if t == "mixtral" else hf["moe_intermediate_size"]),
                   norm_topk_prob=True if t == "mixtral" else bool(hf.get("norm_topk_prob", False)),
                   # transformers' Qwen2MoeConfig default when the file omits it
                   shared_mlp_dim=int(hf.get("shared_expert_intermediate_size", 5632)) if t == "qwen2_moe" else 0)


def config_from_hf(hf: dict[str, Any], dtype: Optional[str] = None) -> ModelConfig:
  """ModelConfig from a parsed HF `config.json` dict (model_type llama, qwen2 or qwen3).

  `dtype` (float32/bfloat16/float16) sets both parameter and compute dtype; by
  default the checkpoint's own dtype is kept when it is one of those, else f32.
  """
  model_type = hf.get("model_type")
  if model_type not in _ARCHITECTURES:
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_ARCHITECTURES)}")
  _refuse(hf, "hidden_act", lambda v: v == "silu", "activation")
  _refuse(hf, "mlp_bias", lambda v: not v, "feature")
  _refuse(hf, "use_sliding_window", lambda v: not v, "feature (sliding-window attention)")
  _refuse(hf, "layer_types", lambda v: all(t == "full_attention" for t in v), "layer types")
  _refuse(hf, "quantization_config", lambda v: not v, "feature (quantized checkpoint)")
  if model_type == "mixtral":  # Mixtral slides whenever the window is set (no use_sliding_window switch)
    _refuse(hf, "sliding_window", lambda v: not v, "feature (sliding-window attention)")
  if model_type == "qwen2_moe":
    _refuse(hf, "qkv_bias", bool, "feature (Qwen2-MoE without q/k/v biases)")
  # Llama's and Qwen3's attention_bias also adds an o_proj bias, which rlax has no slot for.
  _refuse(hf, "attention_bias", lambda v: not v, "feature (attention_bias with o_proj bias)")
  for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
    if key not in hf:
      raise ValueError(f"HF config for {model_type!r} is missing {key!r}")
  theta, scaling = _rope(hf)
  n_heads = int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // n_heads
  if dtype is None:
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = dtype if dtype in _DTYPES else "float32"
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
      n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
      n_kv_heads=int(hf.get("num_key_value_heads") or n_heads), head_dim=int(head_dim),
      mlp_dim=int(hf["intermediate_size"]), arch=model_type, rope_theta=theta, rope_scaling=scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=_ATTENTION[model_type][0],
      qk_norm=_ATTENTION[model_type][1], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      param_dtype=str(dtype), dtype=str(dtype),
      max_position=int(hf.get("max_position_embeddings", 8192)), moe=_moe(hf))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """HF `config.json` dict for `cfg`; the arch's HF class must compute what cfg computes."""
  want = _ATTENTION[cfg.arch]
  if (cfg.qkv_bias, cfg.qk_norm) != want:
    raise ValueError(f"arch={cfg.arch!r} with qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm} has no HF "
                     f"equivalent (HF {_ARCHITECTURES[cfg.arch]} has qkv_bias={want[0]}, qk_norm={want[1]})")
  rs = cfg.rope_scaling
  out = {
      "architectures": [_ARCHITECTURES[cfg.arch]],
      "model_type": cfg.arch,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None if rs is None else {
          "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
          "high_freq_factor": rs.high_freq_factor, "original_max_position_embeddings": rs.original_max_position},
      "tie_word_embeddings": cfg.tie_embeddings,
      "torch_dtype": cfg.param_dtype,
      "use_cache": True,
  }
  if cfg.arch not in ("qwen2", "qwen2_moe"):
    out["attention_bias"] = False
  if cfg.arch == "llama":
    out["mlp_bias"] = False
  elif cfg.arch != "mixtral":
    out["use_sliding_window"] = False
  m = cfg.moe
  if m is not None:
    out.update(num_experts_per_tok=m.top_k, output_router_logits=False)
    if cfg.arch == "mixtral":
      if not m.norm_topk_prob or m.shared_mlp_dim or m.expert_mlp_dim != cfg.mlp_dim:
        raise ValueError("Mixtral renormalizes its top-k, has no shared expert, and its experts are "
                         "intermediate_size wide: this moe config has no HF equivalent")
      out.update(num_local_experts=m.n_experts, router_jitter_noise=0.0, sliding_window=None)
    else:
      if bool(m.shared_mlp_dim) != (cfg.arch == "qwen2_moe"):
        raise ValueError(f"arch={cfg.arch!r} with shared_mlp_dim={m.shared_mlp_dim}: Qwen2-MoE has a shared "
                         "expert, Qwen3-MoE has none")
      out.update(num_experts=m.n_experts, moe_intermediate_size=m.expert_mlp_dim, norm_topk_prob=m.norm_topk_prob,
                 decoder_sparse_step=1, mlp_only_layers=[])
      if cfg.arch == "qwen2_moe":
        out.update(shared_expert_intermediate_size=m.shared_mlp_dim, qkv_bias=True)
  return out
