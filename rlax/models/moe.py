"""Routed experts: the MLP of a mixture-of-experts layer (Qwen3-MoE, Qwen2-MoE, Mixtral), dropless.

A softmax router (f32) scores every expert for every token; each token goes to its top-k experts, weighted by
their probabilities (renormalized over the k when `norm_topk_prob`). The token-expert pairs are sorted by
expert, so each expert's tokens are one contiguous group, and the three expert matmuls are grouped matmuls over
those groups (`grouped_matmul`: `jax.lax.ragged_dot` on TPU, blocks of one expert elsewhere): no capacity
factor, no dropped token, no padding to the busiest expert. Qwen2-MoE adds a shared expert, gated per token by
a sigmoid. `routed` is the MLP that `layers.block` applies for a MoE config.

Shapes: N tokens, D d_model, E experts, k experts per token, Fe expert MLP, Fs shared expert MLP.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rlax.models import expert_parallel, linear
from rlax.models.config import ModelConfig, MoEConfig

# Routing replay: a token's recorded experts are ids in ROUTE_DTYPE (n_experts <= 255: MoEConfig checks it);
# NO_ROUTE marks a token that has none (padding, a row's last token, which no forward fed), routed afresh.
ROUTE_DTYPE = jnp.uint8
NO_ROUTE = 255


def replayed_routes(cfg: ModelConfig) -> Optional[tuple[int, int]]:
  """(layers, top_k): the routes each token of a rollout carries when `cfg` replays them, else None. The one
  rule for the sampler's slots (rlax.sampler.slots), its memory (rlax.sampler.sizing), the batches
  (rlax.trainer.batch, rlax.rollout.packing) and the trainer's forward (rlax.trainer.layouts)."""
  if cfg.moe is None or cfg.moe.routing_replay != "rollout":
    return None
  return cfg.n_layers, cfg.moe.top_k


def route(cfg: ModelConfig, router: jax.Array, x: Float[Array, "N D"],
          experts: Optional[Int[Array, "N k"]] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(router logits [N, E] f32, experts [N, k] int32, weights [N, k] f32).

  `experts` given (routing replay): those experts, weighted by this router's own probabilities over them, so
  the router still gets gradients (a token whose ids hold NO_ROUTE or any id >= E: its own top-k); otherwise
  the top-k of the probabilities.
  """
  m = cfg.moe
  logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
  probs = jax.nn.softmax(logits, axis=-1)
  weights, own = jax.lax.top_k(probs, m.top_k)
  if experts is not None:
    given = experts.astype(jnp.int32)
    experts = jnp.where(jnp.all(given < m.n_experts, axis=-1, keepdims=True), given, own)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
  else:
    experts = own
  if m.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return logits, experts.astype(jnp.int32), weights


class RouterStats(NamedTuple):
  """A forward's router statistics, each the mean over its MoE layers (rlax.models.hidden_states). balance: the
  load-balancing loss E·Σ_e f_e·P_e (Switch Transformer, arXiv 2101.03961 eq. 4, with f_e the share of the
  token-expert pairs that go to e, so perfect balance is 1 at any k; Megatron-LM's normalization); z: the router
  z-loss, the mean of logsumexp(logits)² (ST-MoE, arXiv 2202.08906 eq. 5)."""
  balance: jax.Array
  z: jax.Array


def router_stats(logits: Float[Array, "N E"], experts: Int[Array, "N k"], valid: Float[Array, "N"]) -> RouterStats:
  """One layer's RouterStats over the tokens with valid > 0. Gradients reach the router through the mean
  probabilities P_e and the logits; the shares f_e count the experts actually used (replayed ones included)."""
  e, k = logits.shape[-1], experts.shape[-1]
  n = jnp.maximum(jnp.sum(valid), 1.0)
  probs = jax.nn.softmax(logits, axis=-1)
  mean_prob = jnp.sum(probs * valid[:, None], axis=0) / n
  share = jnp.zeros((e,), jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(valid, k), mode="drop") / (n * k)
  z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * valid) / n
  return RouterStats(balance=e * jnp.sum(jax.lax.stop_gradient(share) * mean_prob), z=z)


def aux_loss(cfg: ModelConfig, stats: RouterStats) -> jax.Array:
  """The auxiliary loss the config asks for (0 unless MoEConfig.load_balance_coef / router_z_coef are set)."""
  return cfg.moe.load_balance_coef * stats.balance + cfg.moe.router_z_coef * stats.z


def as_routes(chosen: jax.Array) -> jax.Array:
  """Expert ids as a rollout stores them (ROUTE_DTYPE)."""
  return chosen.astype(ROUTE_DTYPE)


def _swiglu(x, gate, up, down, matmul):
  g, u = matmul(x, gate), matmul(x, up)
  return matmul(jax.nn.silu(g) * u, down)


def _blocks(x: Float[Array, "M D"], w: Float[Array, "E D F"], sizes: Int[Array, "E"]) -> Float[Array, "M F"]:
  """ragged_dot's result, computed in blocks of rows that belong to one group each: every group padded to a
  multiple of the block, and each block multiplied by its group's weights (at most E blocks of padding). Rows
  past the groups (sum(sizes) < M) are a last group whose result is 0, as ragged_dot's."""
  m, d = x.shape
  e = w.shape[0]
  block, n_blocks = _block_shape(m, e)
  sizes = jnp.concatenate([sizes, (m - jnp.sum(sizes))[None]])
  padded = -(-sizes // block) * block
  ends_p, ends = jnp.cumsum(padded), jnp.cumsum(sizes)
  rows = jnp.arange(m)
  group = jnp.searchsorted(ends, rows, side="right")
  at = (ends_p - padded)[group] + rows - (ends - sizes)[group]
  xb = jnp.zeros((n_blocks * block, d), x.dtype).at[at].set(x).reshape(n_blocks, block, d)
  block_group = jnp.searchsorted(ends_p, jnp.arange(n_blocks) * block, side="right")
  y = jnp.einsum("nbd,ndf->nbf", xb, w[jnp.minimum(block_group, e - 1)])
  y = jnp.where((block_group < e)[:, None, None], y, 0)
  return y.reshape(n_blocks * block, -1)[at]


def _block_shape(m: int, e: int) -> tuple[int, int]:
  """(rows a block, blocks) of `_blocks` for m rows in e groups: about a group's mean size (decode steps route
  few rows), at most 128 rows, enough blocks for every group's padding and the rows past the groups."""
  block = 8
  while block < 128 and block * e < m:
    block *= 2
  return block, -(-(m + (e + 1) * (block - 1)) // block)


def block_weight_bytes(cfg: ModelConfig, tokens: int, tensor: int, itemsize: int, platform: str) -> int:
  """Bytes of the expert weights a MoE layer's `_blocks` copies per block (three matmuls) for `tokens` tokens
  off TPU, kept for the backward pass; 0 for a dense model or on TPU (ragged_dot). rlax.memory's estimate."""
  if cfg.moe is None or platform == "tpu":
    return 0
  _, n_blocks = _block_shape(tokens * cfg.moe.top_k, cfg.moe.n_experts)
  return 3 * n_blocks * cfg.d_model * -(-cfg.moe.expert_mlp_dim // tensor) * itemsize


def grouped_matmul(x: Float[Array, "M D"], w: Float[Array, "E D F"], sizes: Int[Array, "E"]) -> Float[Array, "M F"]:
  """Rows sorted by group (sizes[g] consecutive rows each; rows past them: 0) times their group's weights. On TPU
  `jax.lax.ragged_dot` lowers to a grouped matmul kernel; XLA:CPU lowers it as every group against every row
  (E times the FLOPs), so elsewhere the rows are multiplied in blocks of one group each: on this CPU at 8
  experts, 4096 rows, 576 x 1536, 2.4x faster than ragged_dot forward and 3.3x with the backward."""
  if _platform() == "tpu":
    return jax.lax.ragged_dot(x, w, sizes)
  return _blocks(x, w, sizes)


def _platform() -> str:
  """The platform the program is for: the ambient mesh's devices' (a plan lowers for TPU from this CPU), else
  the default backend's."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else mesh.abstract_device
  return device.platform if device is not None and device.platform else jax.default_backend()


def expert_mlp(w: dict[str, Any], x: Float[Array, "N D"], experts: Int[Array, "N k"],
               weights: Float[Array, "N k"], matmul=None) -> Float[Array, "N D"]:
  """Σ_j weights[:, j] · expert_{experts[:, j]}(x), as grouped matmuls over the pairs sorted by expert (an id
  >= E: no expert here, 0). matmul(x, w, sizes): the grouped matmul (default `grouped_matmul`; bench/moe.py
  compares ragged_dot)."""
  k = experts.shape[1]
  n_experts = w["experts_gate"].shape[0]
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  token = order // k
  sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
  grouped = lambda a, b: (matmul or grouped_matmul)(a, b, sizes)
  y = _swiglu(x[token], w["experts_gate"], w["experts_up"], w["experts_down"], grouped)
  y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
  return jnp.zeros_like(x).at[token].add(y)


def routed(cfg: ModelConfig, w: dict[str, Any], h: Float[Array, "B T D"],
           experts: Optional[Int[Array, "B T k"]] = None) -> tuple[Float[Array, "B T D"], jax.Array, jax.Array]:
  """The MoE MLP of one layer → (output [B, T, D], router logits [B, T, E] f32, experts [B, T, k])."""
  lead, d = h.shape[:-1], h.shape[-1]
  x = h.reshape(-1, d)
  logits, chosen, weights = route(cfg, w["router"], x, None if experts is None else experts.reshape(x.shape[0], -1))
  out = expert_parallel.experts(w, x, chosen, weights, expert_mlp)
  if cfg.moe.shared_mlp_dim:  # dense: its weights may carry LoRA adapters (routed experts never do)
    shared = _swiglu(x, w["shared_gate"], w["shared_up"], w["shared_down"], linear.dense)
    out = out + jax.nn.sigmoid(jnp.dot(x, w["shared_router"])).astype(x.dtype) * shared
  return (out.reshape(*lead, d), logits.reshape(*lead, -1), chosen.reshape(*lead, -1))


def upcycle(cfg: ModelConfig, params: dict[str, Any], *, n_experts: int, top_k: int, key: jax.Array,
            router_std: float = 0.02) -> tuple[ModelConfig, dict[str, Any]]:
  """Sparse upcycling: a dense Llama (→ Mixtral) or Qwen3 (→ Qwen3-MoE) whose every MLP becomes `n_experts`
  copies of itself behind a fresh router (N(0, router_std²)). The top-k weights are renormalized, so they sum
  to 1 over identical experts: the upcycled model computes the dense model's logits until training makes the
  experts differ."""
  if top_k < 2:  # one expert's renormalized weight is p / p = 1: the router would get no gradient
    raise ValueError(f"upcycle: top_k={top_k} must be >= 2 for the router to learn")
  arch = {"llama": "mixtral", "qwen3": "qwen3_moe"}.get(cfg.arch)
  if cfg.moe is not None or arch is None:
    raise ValueError(f"upcycle: a dense llama or qwen3 model is needed, got arch={cfg.arch!r}"
                     f"{' with experts' if cfg.moe is not None else ''}")
  new = cfg.replace(arch=arch, moe=MoEConfig(n_experts=n_experts, top_k=top_k, expert_mlp_dim=cfg.mlp_dim))
  layers = dict(params["layers"])
  copies = lambda w: jnp.repeat(w[:, None], n_experts, axis=1)
  gate, up, down = layers.pop("gate"), layers.pop("up"), layers.pop("down")
  router = router_std * jax.random.normal(key, (cfg.n_layers, cfg.d_model, n_experts), jnp.float32)
  layers.update(router=router.astype(gate.dtype), experts_gate=copies(gate), experts_up=copies(up),
                experts_down=copies(down))
  return new, {**params, "layers": layers}
