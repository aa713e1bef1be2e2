"""PPO's value model: the policy's transformer trunk plus a scalar head, its inputs (token rewards, GAE) and loss.

    critic = init_params(policy_params)                  # {"trunk": policy-shaped tree, "head": {"w", "b"}}
    v = values(critic, cfg, tokens, input_mask)          # [B, T-1], aligned with loss_mask
    r = token_rewards(rewards, loss_mask, kl, beta)      # [B, T-1]
    adv, ret = advantages(r, v, loss_mask, gamma, lam)   # GAE, whitened advantages

The value model has the policy's parameter tree (same shapes, same shardings through models.RULES),
initialized from the starting policy's weights (`critic_init="policy"`, as InstructGPT initializes its
value model from a trained model rather than from scratch) or from a HF directory with the policy's
architecture (`"hf:<dir>"`), and a head [d_model] -> 1 on the final-normed hidden state. Its value at
loss-mask index t is V(tokens[:t+1]), the state in which token t+1 is chosen.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlax import algorithms
from rlax import models
from rlax.models.init import abstract_params
from rlax.trainer import layouts
from rlax.trainer.state import accumulate_gradients, apply_gradients, rows_in_micro_batches


def init_params(policy_params: Any) -> dict:
  """Critic parameters from the policy's: a copy of the trunk and a zero head (every value starts at 0,
  so the first GAE advantages are the plain returns)."""
  trunk = jax.tree.map(lambda x: jnp.array(x, copy=True), policy_params)
  d_model = policy_params["embed"].shape[1]
  return {"trunk": trunk, "head": {"w": jnp.zeros((d_model,), jnp.float32), "b": jnp.zeros((), jnp.float32)}}


def shardings(cfg: models.ModelConfig, mesh: Mesh) -> dict:
  """The critic's parameter shardings: the trunk as the policy's, the small head replicated."""
  rep = NamedSharding(mesh, P())
  return {"trunk": models.param_shardings(cfg, mesh), "head": {"w": rep, "b": rep}}


def load_trunk(spec: str, cfg: models.ModelConfig, mesh: Optional[Mesh]) -> Optional[Any]:
  """The trunk's weights named by `critic_init`: None for "policy", else the HF directory after "hf:",
  which must hold the policy's architecture (same parameter tree)."""
  if spec == "policy":
    return None
  from rlax.models import hf  # pylint: disable=g-import-not-at-top
  hf_cfg, params = hf.load_checkpoint(spec[len("hf:"):], mesh=mesh)
  want, got = models.param_shapes(cfg), models.param_shapes(hf_cfg)
  if jax.tree.structure(want) != jax.tree.structure(got) or jax.tree.leaves(want) != jax.tree.leaves(got):
    raise ValueError(f"critic_init={spec!r}: that model's parameter tree differs from the policy's")
  return jax.tree.map(lambda x, w: x.astype(w.dtype), params, abstract_params(cfg))


def values(critic: dict, cfg: models.ModelConfig, tokens, input_mask, *, start: int = 0) -> jax.Array:
  """V at every loss-mask index of padded rows: [B, T-1] f32 (positions before `start` are 0, not computed)."""
  layout = layouts.Layout(packed=False, start=start)
  return layout.values(critic, cfg, {"tokens": tokens, "input_mask": input_mask})


def token_rewards(rewards, mask, kl=None, beta: float = 0.0,
                  segments: algorithms.Segments = algorithms.Segments()) -> jax.Array:
  """Per-token rewards [B, T-1]: the sequence reward on each sequence's last scored token, minus beta * KL_t
  on every scored token when `kl` [B, T-1] is given (Ouyang et al. 2022, arXiv 2203.02155, eq. 2)."""
  m = mask.astype(jnp.float32)
  out = jnp.where(segments.last_masked(m), segments.spread(rewards.astype(jnp.float32), m), 0.0)
  if kl is not None:
    out = out - beta * kl * m
  return out * m


def advantages(rewards, old_values, mask, gamma: float, lam: float, eps: float = 1e-8,
               segments: algorithms.Segments = algorithms.Segments()) -> tuple[jax.Array, jax.Array]:
  """(advantages, returns), both [B, T-1]: GAE(gamma, lambda) (Schulman et al. 2016, arXiv 1506.02438) on
  the old values; the advantages whitened over the batch's scored tokens as in PPO-RLHF (Ziegler et al.
  2019), the returns not (they are the value targets)."""
  adv, ret = algorithms.gae_advantages(rewards, old_values, mask, gamma, lam, segments=segments)
  m = mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  mean = jnp.sum(adv * m) / n
  std = jnp.sqrt(jnp.sum(((adv - mean) * m) ** 2) / n)
  return (adv - mean) / (std + eps) * m, ret


def value_loss(critic: dict, cfg: models.ModelConfig, mb: dict, *, clip: float, num_tokens, layout) -> tuple[jax.Array, dict]:
  """Token-mean clipped value loss of one micro-batch (normalized by the full batch's `num_tokens`).

  mb: model (the forward's inputs in `layout`, rlax.trainer.layouts), loss_mask, old_values, returns (each
  [rows, ...]). Metric sums: value_loss_sum, value_clipped_sum (tokens whose clipped term was the larger
  one, so their gradient is 0).
  """
  m = mb["loss_mask"]
  v = layout.values(critic, cfg, mb["model"])
  tok = algorithms.clipped_value_loss(v, mb["old_values"], mb["returns"], m, clip)
  v_clip = mb["old_values"] + jnp.clip(v - mb["old_values"], -clip, clip)
  clipped = ((v_clip - mb["returns"]) ** 2 > (v - mb["returns"]) ** 2) * m
  return jnp.sum(tok) / jnp.maximum(num_tokens, 1.0), {
      "value_loss_sum": jax.lax.stop_gradient(jnp.sum(tok)),
      "value_clipped_sum": jnp.sum(clipped.astype(jnp.float32)), "value_tokens": jnp.sum(m)}


def explained_variance(old_values, returns, mask) -> jax.Array:
  """1 - Var[R - V] / Var[R] over the scored tokens (1: perfect values, 0: no better than a constant)."""
  m = mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  var = lambda x: jnp.sum(((x - jnp.sum(x * m) / n) * m) ** 2) / n
  return 1.0 - var(returns - old_values) / jnp.maximum(var(returns), 1e-8)


def value_targets(tr, critic_params, batch, old_logprobs) -> dict:
  """Old values, GAE advantages and returns (per slot) of the batch under the critic at step start (`tr`: the
  Trainer)."""
  algo, layout = tr.algo, layouts.of(batch)
  x = layout.inputs(batch)
  seg = layout.segments(x)
  m = batch.loss_mask.astype(jnp.float32)
  v_old = jax.lax.stop_gradient(rows_in_micro_batches(
      lambda mb: layout.values(critic_params, tr.model_cfg, mb), x, tr.num_micro_batches(*x["tokens"].shape),
      layout.has_tokens)) * m
  kl = None
  if algo.kl_coef > 0 and algo.kl_in_reward:
    if batch.ref_logprobs is None:
      raise ValueError(f"{algo.name}: kl_in_reward needs batch.ref_logprobs (fill with Trainer.ref_logprobs)")
    old = old_logprobs if old_logprobs is not None else batch.behaviour_logprobs
    kl = algorithms.kl_estimate(jax.lax.stop_gradient(old), batch.ref_logprobs, algo.kl_estimator) * m
  rewards = token_rewards(batch.rewards, m, kl, algo.kl_coef, segments=seg)
  adv, ret = advantages(rewards, v_old, m, algo.gamma, algo.lam, segments=seg)
  return {"old_values": v_old, "returns": ret, "advantages": adv}


def update(tr, state, new_state, batch, targets: dict):
  """One critic update on the clipped value loss (`tr`: the Trainer); during the value warm-up the policy update
  is dropped."""
  algo, m, layout = tr.algo, batch.loss_mask.astype(jnp.float32), layouts.of(batch)
  num_tokens = jnp.sum(m)
  inputs = {"model": layout.inputs(batch), "loss_mask": m, "old_values": targets["old_values"],
            "returns": targets["returns"]}

  def loss_fn(cparams, mb):
    return value_loss(cparams, tr.model_cfg, mb, clip=algo.value_clip, num_tokens=num_tokens,
                                 layout=layout)

  grads, vloss, stacked = accumulate_gradients(loss_fn, state.critic.params, inputs,
                                               tr.num_micro_batches(*batch.tokens.shape),
                                               active=lambda mb: jnp.any(mb["loss_mask"] > 0))
  critic, critic_norm = apply_gradients(tr.critic_tx, state.critic, grads, vloss)
  warm = state.step < algo.value_warmup_steps
  if algo.value_warmup_steps:
    # Value warm-up: the policy keeps its weights and Adam moments until the critic's values are usable.
    keep = lambda old, new: jax.tree.map(lambda a, b: jnp.where(warm, a, b), old, new)
    new_state = new_state.replace(params=keep(state.params, new_state.params),
                                  opt_state=keep(state.opt_state, new_state.opt_state))
  tokens = jnp.maximum(num_tokens, 1.0)
  metrics = {"value_loss": vloss, "value_clip_frac": jnp.sum(stacked["value_clipped_sum"]) / tokens,
             "explained_variance": explained_variance(targets["old_values"], targets["returns"], m),
             "value_mean": jnp.sum(targets["old_values"]) / tokens,
             "return_mean": jnp.sum(targets["returns"]) / tokens, "critic_grad_norm": critic_norm,
             "value_warmup": warm.astype(jnp.float32)}
  return new_state.replace(critic=critic), metrics
