"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv 2106.09685) on the transformer's linear layers.

A target weight W of one layer ([in..., out...], the layer axis first in the tree) gets A [in..., r] and
B [r, out...]; the adapted layer computes x @ W + (x @ A) @ B * alpha / r. B starts at 0, so step 0's logits
are the base model's exactly. Two ways to use the adapters, the same math:

    lora.attach(params, adapters, cfg)   # training: W stays frozen, x @ A @ B beside it (`layers.dense`)
    lora.merge(params, adapters, cfg)    # sampling: W + A @ B * scale, one fused compute from pristine W

Adapters are a tree {"layers": {target: {"a", "b"}}} stacked over layers like the params, sharded by the
same logical axes (the rank axis replicated).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rlax.models import sharding, transformer
from rlax.models.config import ModelConfig

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# A mixture of experts: its dense shared expert (Qwen2-MoE) takes adapters; routed experts do not (an adapter
# per expert would be E times the adapter state, and a shared one across experts would make them alike).
SHARED_EXPERT = ("shared_gate", "shared_up", "shared_down")
# The Hugging Face module each target adapts (PEFT's target_modules and tensor names).
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
              "shared_gate": "mlp.shared_expert.gate_proj", "shared_up": "mlp.shared_expert.up_proj",
              "shared_down": "mlp.shared_expert.down_proj"}
# How many of a target's dims (after the layer axis) are its input: o is [heads, head_dim, embed].
_IN_DIMS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1, "shared_gate": 1, "shared_up": 1,
            "shared_down": 1}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank 0: no adapters (every weight trains). alpha / rank scales the update; dropout must be 0 (the
  sampler merges the adapters, which dropout would make differ from training); targets: linear layers
  (default every one of attention and MLP)."""
  rank: int = 0
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = TARGETS

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def validate(self) -> "LoraConfig":
    if self.rank < 0:
      raise ValueError(f"model.lora.rank={self.rank} must be >= 0 (0: no adapters)")
    if self.enabled and not self.alpha > 0:
      raise ValueError(f"model.lora.alpha={self.alpha} must be > 0")
    if self.dropout != 0.0:
      raise ValueError(f"model.lora.dropout={self.dropout}: only 0 is supported (the sampler runs merged weights)")
    bad = [t for t in self.targets if t not in TARGETS + SHARED_EXPERT]
    if bad or (self.enabled and not self.targets):
      raise ValueError(f"model.lora.targets={list(self.targets)}: choose from {', '.join(TARGETS + SHARED_EXPERT)}")
    return self


def parse_targets(spec: Any) -> tuple[str, ...]:
  """"all", "attention", "mlp", "shared_expert", or a comma-separated list / sequence of target names."""
  if isinstance(spec, str):
    named = {"all": TARGETS, "attention": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down"),
             "shared_expert": SHARED_EXPERT}
    return named.get(spec, tuple(t.strip() for t in spec.split(",") if t.strip()))
  return tuple(spec)


def target_spec(targets: Sequence[str]) -> str:
  """The string `parse_targets` reads back as `targets` ("all": every target)."""
  return "all" if tuple(targets) == TARGETS else ",".join(targets)


def _adapters_of(full: dict, lora: LoraConfig, rank_entry) -> dict:
  """A [lead, in..., rank] and B [lead, rank, out...] of each target, from the full layer tree's entries
  (shapes or logical axes), with `rank_entry` on the rank axis."""
  out = {}
  missing = [t for t in lora.targets if t not in full]
  if missing:  # routed experts have no gate/up/down of their own (rlax.models.moe)
    raise ValueError(f"model.lora.targets: {', '.join(missing)} is not a weight of this model (on a mixture of "
                     "experts LoRA adapts attention and a shared expert, not the routed experts: "
                     "targets='attention' or 'q,k,v,o,shared_gate,shared_up,shared_down')")
  for t in lora.targets:
    lead, *dims = full[t]
    n = _IN_DIMS[t]
    out[t] = {"a": (lead, *dims[:n], rank_entry), "b": (lead, rank_entry, *dims[n:])}
  return {"layers": out}


def shapes(cfg: ModelConfig, lora: LoraConfig) -> dict:
  return _adapters_of(transformer.param_shapes(cfg)["layers"], lora, lora.rank)


def axes(cfg: ModelConfig, lora: LoraConfig) -> dict:
  return _adapters_of(transformer.param_axes(cfg)["layers"], lora, None)  # the rank axis replicated


def init(cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> dict:
  """A ~ N(0, 1 / fan_in) (f32), B = 0."""
  out = {}
  for i, (t, s) in enumerate(sorted(shapes(cfg, lora)["layers"].items())):
    fan_in = 1
    for d in s["a"][1:-1]:
      fan_in *= d
    a = jax.random.normal(jax.random.fold_in(key, i), s["a"], jnp.float32) / jnp.sqrt(float(fan_in))
    out[t] = {"a": a, "b": jnp.zeros(s["b"], jnp.float32)}
  return {"layers": out}


def abstract(cfg: ModelConfig, lora: LoraConfig) -> dict:
  return jax.eval_shape(lambda: init(cfg, lora, jax.random.key(0)))


def adapter_shardings(cfg: ModelConfig, lora: LoraConfig, mesh: Mesh, rules=sharding.RULES):
  return sharding.tree_shardings(abstract(cfg, lora), axes(cfg, lora), mesh, rules)


def create(cfg: ModelConfig, lora: LoraConfig, mesh: Optional[Mesh] = None, seed: int = 0) -> dict:
  """Adapters initialized straight into their shardings on `mesh` (or on the default device)."""
  fn = lambda k: init(cfg, lora, k)
  key = jax.random.key(seed)
  if mesh is None:
    return jax.jit(fn)(key)
  return jax.jit(fn, out_shardings=adapter_shardings(cfg, lora, mesh))(key)


def delta(t: str, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """A @ B * scale of target t, [L, in..., out...] (f32)."""
  L, r = a.shape[0], a.shape[-1]
  n_in = _IN_DIMS[t]
  d = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r).astype(jnp.float32), b.reshape(L, r, -1).astype(jnp.float32))
  return (d * scale).reshape(L, *a.shape[1:1 + n_in], *b.shape[2:])


def merge(params: dict, adapters: dict, lora: LoraConfig) -> dict:
  """The params with W + A @ B * scale on every target (in W's dtype), computed from W as given: merging a
  new version into the pristine base never accumulates the old one."""
  layers = dict(params["layers"])
  for t, ab in adapters["layers"].items():
    w = layers[t]
    layers[t] = (w.astype(jnp.float32) + delta(t, ab["a"], ab["b"], lora.scale)).astype(w.dtype)
  return {**params, "layers": layers}


def merge_to(params: dict, adapters: dict, lora: LoraConfig, dtype: Any) -> dict:
  """`merge`, every leaf then cast to `dtype`: the sampler's weights for one version, from its pristine base."""
  return jax.tree.map(lambda x: x.astype(dtype), merge(params, adapters, lora))


def attach(params: dict, adapters: dict, lora: LoraConfig) -> dict:
  """The params with every target W as {"w": W, "a": A * scale, "b": B}: `layers.dense` then computes
  x @ W + (x @ A) @ B, so the gradient reaches A and B and never forms one of W's size."""
  layers = dict(params["layers"])
  for t, ab in adapters["layers"].items():
    layers[t] = {"w": layers[t], "a": ab["a"] * lora.scale, "b": ab["b"]}
  return {**params, "layers": layers}


def count(adapters: Any) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(adapters))


def to_peft(adapters: dict) -> dict:
  """PEFT's tensors of the adapters (host numpy, f32): per layer and target, lora_A [r, in] and lora_B
  [out, r] of `base_model.model.model.layers.<i>.<module>` (HF linear weights are [out, in])."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  out = {}
  for t, ab in adapters["layers"].items():
    a, b = (np.asarray(jax.device_get(ab[k]), np.float32) for k in ("a", "b"))
    r = a.shape[-1]
    for i in range(a.shape[0]):
      name = f"base_model.model.model.layers.{i}.{HF_MODULES[t]}"
      out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
      out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
  return out


def peft_config(lora: LoraConfig, base_model: str = "") -> dict:
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
          "lora_dropout": lora.dropout,
          # PEFT matches a module name's suffix: "gate_proj" alone would also adapt every routed expert.
          "target_modules": sorted(".".join(HF_MODULES[t].split(".")[-2 if t in SHARED_EXPERT else -1:])
                                   for t in lora.targets),
          "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
          "modules_to_save": None, "base_model_name_or_path": base_model}
