"""Model configuration for the decoder-only transformer family (Llama 3, Qwen2/2.5, Qwen3, and their
mixture-of-experts relatives Qwen2-MoE, Qwen3-MoE and Mixtral)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

ARCHS = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 style frequency-dependent RoPE scaling (HF `rope_type="llama3"`)."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Routed experts in every layer's MLP (rlax.models.moe): a softmax router sends each token to `top_k` of
  `n_experts` SwiGLU experts of width `expert_mlp_dim`, weighted by their probabilities (renormalized over the
  k when `norm_topk_prob`: Qwen3-MoE, Mixtral). `shared_mlp_dim` > 0: Qwen2-MoE's shared expert, gated per token
  by a sigmoid. `routing_replay`: "rollout" (the sampler records every token's experts and the trainer's passes
  route it to them: rlax.models.moe.replayed_routes) or "none" (each forward routes by its own router).
  `load_balance_coef`, `router_z_coef`: the RL loss's auxiliary terms (rlax.models.moe.router_stats), 0 by
  default (the reward shapes the routing); both statistics are logged either way. The SFT loss has none."""
  n_experts: int
  top_k: int
  expert_mlp_dim: int
  norm_topk_prob: bool = True
  shared_mlp_dim: int = 0
  routing_replay: str = "rollout"
  load_balance_coef: float = 0.0
  router_z_coef: float = 0.0

  def __post_init__(self):
    for name in ("n_experts", "top_k", "expert_mlp_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"MoEConfig.{name} must be positive, got {getattr(self, name)}")
    if self.top_k > self.n_experts:
      raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds n_experts={self.n_experts}")
    for name in ("load_balance_coef", "router_z_coef"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"MoEConfig.{name} must be >= 0, got {getattr(self, name)}")
    if self.shared_mlp_dim < 0:
      raise ValueError(f"MoEConfig.shared_mlp_dim={self.shared_mlp_dim} must be >= 0")
    if self.routing_replay not in ("rollout", "none"):
      raise ValueError(f"MoEConfig.routing_replay={self.routing_replay!r}: use 'rollout' or 'none'")
    if self.routing_replay == "rollout" and self.n_experts > 255:  # rlax.models.moe.ROUTE_DTYPE
      raise ValueError(f"MoEConfig.routing_replay='rollout' stores expert ids as uint8: n_experts={self.n_experts} "
                       f"must be <= 255 (or set routing_replay='none')")


# How a model computes and how a MoE layer trains, not what a checkpoint holds: a run may set these over a
# checkpoint's config (rlax.models.hf.load_checkpoint; rlax.evaluation keeps NUMERICS when --model replaces it).
NUMERICS = ("param_dtype", "dtype", "remat", "scan_layers")
MOE_TRAINING = ("routing_replay", "load_balance_coef", "router_z_coef")


def checkpoint_fields(cfg: "ModelConfig") -> dict:
  """The fields of `cfg` that a checkpoint fixes (architecture and shapes): all but how it computes (dtypes,
  remat, scan) and how its experts train (MOE_TRAINING). rlax.models.hf.load_checkpoint's check of a run's
  config against config.json."""
  out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in NUMERICS}
  if cfg.moe is not None:
    out["moe"] = {f.name: getattr(cfg.moe, f.name) for f in dataclasses.fields(cfg.moe) if f.name not in MOE_TRAINING}
  return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of one transformer.

  `arch` only selects defaults that differ between families; the switches that
  matter numerically are explicit: `qkv_bias` (Qwen2), `qk_norm` (Qwen3),
  `rope_scaling` (Llama 3.1+), `tie_embeddings`, `moe` (routed experts in every layer; `mlp_dim` is then
  the HF `intermediate_size`, which no layer of an all-MoE stack uses).
  """
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  arch: str = "llama"
  rope_theta: float = 10_000.0
  rope_scaling: Optional[RopeScaling] = None
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: bool = False
  scan_layers: bool = False
  max_position: int = 8192
  moe: Optional[MoEConfig] = None

  def __post_init__(self):
    if self.arch not in ARCHS:
      raise ValueError(f"unsupported architecture {self.arch!r}; expected one of {ARCHS}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: use float32, bfloat16 or float16")
    if (self.moe is not None) != (self.arch in ("mixtral", "qwen2_moe", "qwen3_moe")):
      raise ValueError(f"ModelConfig.arch={self.arch!r} {'needs' if self.moe is None else 'has no'} a moe section")

  @property
  def active_mlp_dim(self) -> int:
    """The MLP width one token computes through (for MoE its top-k experts and the shared one)."""
    m = self.moe
    return self.mlp_dim if m is None else m.top_k * m.expert_mlp_dim + m.shared_mlp_dim

  def layer_matmul_weights(self) -> int:
    """Weights one layer multiplies each token by (q, k, v, o, the MLP it runs through, a MoE's router): the
    FLOP counts of the packer (rlax.rollout.packing.row_cost) and the planner (rlax.planning_programs)."""
    d = self.d_model
    router = 0 if self.moe is None else self.moe.n_experts + (1 if self.moe.shared_mlp_dim else 0)
    return d * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + self.n_heads * self.head_dim * d + d * (
        3 * self.active_mlp_dim + router)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, h, k, dh, v, n = (self.d_model, self.mlp_dim, self.n_heads, self.n_kv_heads, self.head_dim,
                            self.vocab_size, self.n_layers)
    m = self.moe
    mlp = 3 * d * f if m is None else (m.n_experts * (3 * d * m.expert_mlp_dim + d)
                                       + (3 * d * m.shared_mlp_dim + d if m.shared_mlp_dim else 0))
    per_layer = d * h * dh * 2 + d * k * dh * 2 + mlp + 2 * d
    if self.qkv_bias:
      per_layer += (h + 2 * k) * dh
    if self.qk_norm:
      per_layer += 2 * dh
    return n * per_layer + v * d * (1 if self.tie_embeddings else 2) + d


def from_dict(d: dict) -> ModelConfig:
  """Builds a ModelConfig from a plain dict (e.g. an ml_collections config's `model` field)."""
  d = dict(d)
  rs = d.pop("rope_scaling", None)
  moe = d.pop("moe", None)
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(d) - names)
  if unknown:
    raise ValueError(f"unknown model config field(s): {', '.join(unknown)}")
  if rs:
    rs = RopeScaling(**dict(rs))
  if moe:
    moe = MoEConfig(**dict(moe))
  return ModelConfig(rope_scaling=rs or None, moe=moe or None, **d)


PRESETS = {
    # W1/W2/W3 benchmark model (see bench/).
    "w1": dict(vocab_size=1024, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
               mlp_dim=1024),
    # Qwen2.5-32B / QwQ-32B architecture (the paper's policy).
    "qwq32b": dict(arch="qwen2", vocab_size=152064, d_model=5120, n_layers=64, n_heads=40,
                   n_kv_heads=8, head_dim=128, mlp_dim=27648, qkv_bias=True, rope_theta=1e6,
                   norm_eps=1e-5, param_dtype="bfloat16", dtype="bfloat16", scan_layers=True,
                   remat=True, max_position=40960),
    # Qwen2.5-7B architecture (a student beside a QwQ-32B teacher: configs/paper_distill.py).
    "qwen2.5-7b": dict(arch="qwen2", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       head_dim=128, mlp_dim=18944, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6,
                       param_dtype="bfloat16", dtype="bfloat16", scan_layers=True, remat=True,
                       max_position=32768),
    # Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen3MoeForCausalLM): 128 experts, top-8, every layer sparse.
    "qwen3_moe_30b": dict(arch="qwen3_moe", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, mlp_dim=6144, qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
                          param_dtype="bfloat16", dtype="bfloat16", scan_layers=True, remat=True,
                          max_position=40960, moe=dict(n_experts=128, top_k=8, expert_mlp_dim=768)),
    "qwen3_moe_235b": dict(arch="qwen3_moe", vocab_size=151936, d_model=4096, n_layers=94, n_heads=64,
                           n_kv_heads=4, head_dim=128, mlp_dim=12288, qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
                           param_dtype="bfloat16", dtype="bfloat16", scan_layers=True, remat=True,
                           max_position=40960, moe=dict(n_experts=128, top_k=8, expert_mlp_dim=1536)),
}


def preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return from_dict({**PRESETS[name], **overrides})
