"""The RL objective of one micro-batch: recompute log-probs, then registry loss + KL + entropy + IS correction."""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from rlax import algorithms
from rlax import models
from rlax.models import moe
from rlax.trainer import layouts
from rlax.trainer.batch import PackedBatch, RolloutBatch
from rlax.trainer.state import masked_extreme


@flax.struct.dataclass
class LossInputs:
  """The per-row arrays the loss needs: the forward's inputs (`model`, see layouts.Layout.inputs), the
  per-slot masks and log-probs, and advantages ([B] or per slot; per slot in a packed batch); with a forward-KL
  term the teacher's top-k ids and log-probs per slot."""
  model: dict
  loss_mask: jax.Array
  behaviour_logprobs: jax.Array
  advantages: jax.Array
  ref_logprobs: Optional[jax.Array] = None
  teacher_top_ids: Optional[jax.Array] = None
  teacher_top_logprobs: Optional[jax.Array] = None


def kl_reward_old_logprobs(algo: algorithms.AlgorithmConfig) -> bool:
  """Whether the advantages need the old policy's log-probs recomputed by the trainer: a KL-in-reward
  penalty is KL(pi_old || pi_ref) (REINFORCE++ eq. 4; Ouyang et al. 2022), and with
  old_policy="recompute" pi_old is the trainer's policy at step start, not the sampler's."""
  return algo.kl_coef > 0 and algo.kl_in_reward and algo.old_policy == "recompute"


def batch_advantages(algo: algorithms.AlgorithmConfig, batch: RolloutBatch | PackedBatch, group_size: int,
                     old_logprobs: Optional[jax.Array] = None) -> jax.Array:
  """The batch's advantages if given, else the estimator's on (optionally KL-shaped) rewards; [B] or per slot.
  A distilling algorithm (distill_coef) adds the teacher's per-token reverse-KL advantage
  (rlax.algorithms.distill) to reward_coef x those: per slot.

  old_logprobs (per slot): the old policy's log-probs, needed for kl_in_reward when old_policy="recompute"
  (with "behaviour" the sampler's are the old policy's).
  """
  if batch.advantages is not None:
    return batch.advantages.astype(jnp.float32)
  if not algo.distill_coef:  # (a forward-KL term alone is in the loss, not the advantages)
    return algo.reward_coef * _task_advantages(algo, batch, group_size, old_logprobs)
  if batch.teacher_logprobs is None:
    raise ValueError(f"{algo.name} has distill_coef={algo.distill_coef}: fill batch.teacher_logprobs (rlax.teachers)")
  adv = algorithms.reverse_kl_advantages(batch.behaviour_logprobs, batch.teacher_logprobs, batch.loss_mask,
                                         algo.distill_coef)
  if not algo.reward_coef:
    return adv
  task = _task_advantages(algo, batch, group_size, old_logprobs)
  if task.ndim == 1:  # a sequence's advantage on each of its slots
    layout = layouts.of(batch)
    task = layout.segments(layout.inputs(batch)).spread(task, batch.loss_mask)
  return adv + algo.reward_coef * task


def _task_advantages(algo: algorithms.AlgorithmConfig, batch: RolloutBatch | PackedBatch, group_size: int,
                     old_logprobs: Optional[jax.Array]) -> jax.Array:
  """The estimator's advantages of the (optionally KL-shaped) rewards; [B] or per slot."""
  layout = layouts.of(batch)
  seg = layout.segments(layout.inputs(batch))
  rewards = batch.rewards
  if algo.kl_coef > 0 and algo.kl_in_reward:
    if batch.ref_logprobs is None:
      raise ValueError(f"{algo.name}: kl_in_reward needs batch.ref_logprobs (fill with Trainer.ref_logprobs)")
    if kl_reward_old_logprobs(algo):
      if old_logprobs is None:
        raise ValueError(f"{algo.name}: kl_in_reward with old_policy='recompute' needs the old policy's log-probs")
      old = jax.lax.stop_gradient(old_logprobs)
    else:
      old = batch.behaviour_logprobs
    m = batch.loss_mask.astype(jnp.float32)
    if algo.advantage in algorithms.TOKEN_ESTIMATORS:  # REINFORCE++: the KL to go from each token
      kl = algorithms.kl_estimate(old.astype(jnp.float32), batch.ref_logprobs, algo.kl_estimator) * m
      return algo.advantages(rewards, group_size, mask=m, kl=kl, segments=seg)
    rewards = algorithms.kl_penalized_rewards(rewards, old, batch.ref_logprobs, m, algo.kl_coef, algo.kl_estimator,
                                              segments=seg)
  if algo.advantage in algorithms.TOKEN_ESTIMATORS:
    return algo.advantages(rewards, group_size, mask=batch.loss_mask, segments=seg)
  return algo.advantages(rewards, group_size)


def loss_inputs(algo: algorithms.AlgorithmConfig, batch: RolloutBatch | PackedBatch, group_size: int,
                old_logprobs: Optional[jax.Array] = None) -> LossInputs:
  """The loss's view of a full batch (advantages computed, masks cast); raises if a needed input is missing.
  A packed batch's sequence advantages go onto its slots, so that every input is split by rows."""
  needs_ref = algo.kl_coef > 0 and not algo.kl_in_reward
  if needs_ref and batch.ref_logprobs is None:
    raise ValueError(f"{algo.name} has kl_coef={algo.kl_coef}: fill batch.ref_logprobs (Trainer.ref_logprobs)")
  layout = layouts.of(batch)
  x = layout.inputs(batch)
  adv = batch_advantages(algo, batch, group_size, old_logprobs)
  if layout.packed and adv.ndim == 1:
    adv = layout.segments(x).spread(adv, batch.loss_mask)
  return LossInputs(model=x, loss_mask=batch.loss_mask.astype(jnp.float32),
                    behaviour_logprobs=batch.behaviour_logprobs.astype(jnp.float32),
                    advantages=adv, ref_logprobs=batch.ref_logprobs, **_forward_kl_inputs(algo, batch))


def _forward_kl_inputs(algo: algorithms.AlgorithmConfig, batch: RolloutBatch | PackedBatch) -> dict:
  if not algo.forward_kl_coef:
    return {}
  if batch.teacher_top_ids is None:
    raise ValueError(f"{algo.name} has forward_kl_coef={algo.forward_kl_coef}: fill batch.teacher_top_ids and "
                     "teacher_top_logprobs (rlax.teachers)")
  return dict(teacher_top_ids=batch.teacher_top_ids, teacher_top_logprobs=batch.teacher_top_logprobs)


def _router_loss(model_cfg: models.ModelConfig) -> bool:
  """Whether a MoE policy's router losses are in the objective (their coefficients are set)."""
  return model_cfg.moe is not None and bool(model_cfg.moe.load_balance_coef or model_cfg.moe.router_z_coef)


def contributes(algo: algorithms.AlgorithmConfig, model_cfg: models.ModelConfig, mb: LossInputs) -> jax.Array:
  """[] bool: whether micro-batch `mb` adds to the gradient of `rl_loss`: it scores a token and, where a zero
  advantage adds nothing (AlgorithmConfig.zero_advantage_inert, no router loss), one with a nonzero advantage.
  The trainer skips the others, so a tied group laid out apart (rlax.rollout.packing) costs nothing."""
  m = mb.loss_mask > 0
  if not algo.zero_advantage_inert or _router_loss(model_cfg):
    return jnp.any(m)
  adv = mb.advantages if mb.advantages.ndim == m.ndim else mb.advantages[:, None]
  return jnp.any(m & (adv != 0))


def rl_loss(params, model_cfg: models.ModelConfig, algo: algorithms.AlgorithmConfig, mb: LossInputs, *, num_tokens,
            num_seqs, num_rows: int, chunk: int = 256, temperature: float = 1.0, start: int = 0,
            layout: Optional[layouts.Layout] = None, num_inputs=None) -> tuple[jax.Array, dict]:
  """Loss of one micro-batch, normalized by full-batch denominators, and its metric sums.

  Per token: policy loss (x detached IS weight) + kl_coef * KL + entropy bonus,
  reduced with `algo.loss_agg`. The "old" policy is the current log-probs,
  detached (exact for one update per batch), or the sampler's when
  algo.old_policy == "behaviour". Metrics are sums / extremes over this
  micro-batch; the trainer reduces them over micro-batches. `layout`: the batch's (default: padded rows
  whose positions before `start` are not computed; their loss_mask must be 0). A MoE policy adds its router
  losses (rlax.models.moe.aux_loss) when their coefficients are set, this micro-batch's weighted by its share of
  the full batch's `num_inputs` real input tokens (default: this micro-batch's own, one micro-batch).
  """
  layout = layout or layouts.Layout(packed=False, start=start, max_len=mb.loss_mask.shape[1] - start)
  seg = layout.segments(mb.model)
  lp, ent, *rest = layout.logprobs(params, model_cfg, mb.model, chunk=chunk, temperature=temperature,
                                   with_entropy=True, router_stats=model_cfg.moe is not None, at=mb.teacher_top_ids)
  student_top, router = (rest[0], rest[1:]) if mb.teacher_top_ids is not None else (None, rest)
  m = mb.loss_mask
  behaviour = mb.behaviour_logprobs
  old = jax.lax.stop_gradient(lp) if algo.old_policy == "recompute" else behaviour
  tok_loss, info = algo.token_loss(lp, old, mb.advantages, m, segments=seg)
  is_mode = algo.off_policy if algo.old_policy == "recompute" else "none"
  w, is_stats = algorithms.importance_weights(old, behaviour, m, is_mode, algo.is_cap, segments=seg)
  pg_tok = tok_loss * w
  total = pg_tok
  kl = None
  if mb.ref_logprobs is not None:
    # Reported whenever reference log-probs are given; a loss term only for KL-in-loss algorithms.
    kl = algorithms.kl_estimate(lp, mb.ref_logprobs, algo.kl_estimator) * m
    if algo.kl_coef > 0 and not algo.kl_in_reward:
      total = total + algo.kl_coef * kl
  if algo.entropy_coef:
    total = total + algorithms.entropy_bonus(ent, m, algo.entropy_coef)
  fkl = None
  if student_top is not None:  # no IS weight: the term scores the sampled prefix, not the sampled token
    fkl = algorithms.top_k_forward_kl(mb.teacher_top_logprobs, student_top) * m
    total = total + algo.forward_kl_coef * fkl
  # Dr. GRPO's constant normalizer is the generation budget (arXiv 2503.20783, sec. 3.1): the response slots
  # after `start`, not T - 1, which would count the prompt's slots too.
  max_len = algo.max_len or layout.max_len
  agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, num_rows=num_rows, max_len=max_len, segments=seg)
  loss = algorithms.aggregate(total, m, algo.loss_agg, **agg)
  inputs = layout.input_tokens(mb.model)
  if router and _router_loss(model_cfg):  # else no gradient to spend
    share = inputs / jnp.maximum(inputs if num_inputs is None else num_inputs, 1.0)
    loss = loss + moe.aux_loss(model_cfg, router[0]) * share

  tokens = jnp.sum(m)
  ratio = jnp.where(m > 0, info["ratio"], jnp.nan)
  diff = jnp.abs(jax.lax.stop_gradient(lp) - behaviour) * m
  metrics = {
      "pg_loss": algorithms.aggregate(jax.lax.stop_gradient(pg_tok), m, algo.loss_agg, **agg),
      "kl_sum": jnp.sum(jax.lax.stop_gradient(kl)) if kl is not None else jnp.zeros(()),
      "entropy_sum": jnp.sum(jax.lax.stop_gradient(ent) * m),
      "clipped_sum": jnp.sum(info["clipped"]),
      "ratio_sum": jnp.sum(jnp.nan_to_num(jax.lax.stop_gradient(ratio))),
      "ratio_max": jnp.nanmax(jnp.where(tokens > 0, ratio, 1.0)),
      "ratio_min": jnp.nanmin(jnp.where(tokens > 0, ratio, 1.0)),
      "is_ratio_sum": is_stats["is_ratio_mean"] * tokens,
      "is_ratio_max": is_stats["is_ratio_max"],
      "is_ratio_min": is_stats["is_ratio_min"],
      "is_truncated_sum": is_stats["is_over"],
      "is_units": is_stats["is_units"],
      "logp_diff_sum": jnp.sum(diff),
      "logp_diff_max": jnp.max(diff),
      "tokens": tokens,
  }
  if fkl is not None:
    metrics["forward_kl_sum"] = jnp.sum(jax.lax.stop_gradient(fkl))
  if router:
    stats = jax.lax.stop_gradient(router[0])
    metrics.update(router_balance_sum=stats.balance * inputs, router_z_sum=stats.z * inputs, router_inputs=inputs)
  return loss, metrics


def reduce_metrics(stacked: dict, loss: jax.Array, grad_norm: jax.Array, lr: jax.Array) -> dict:
  """Micro-batch metric sums/extremes ([n] each, `stacked["active"]` 1 where one ran) -> one scalar per metric
  for the whole batch; extremes are over the micro-batches that ran."""
  tokens = jnp.sum(stacked["tokens"])
  per_tok = lambda k: jnp.sum(stacked[k]) / jnp.maximum(tokens, 1.0)
  on = stacked["active"]
  ext = lambda k, fn, empty: masked_extreme(stacked[k], on, fn, empty)
  return {
      "loss": loss, "pg_loss": jnp.sum(stacked["pg_loss"]), "kl": per_tok("kl_sum"),
      "entropy": per_tok("entropy_sum"), "clip_frac": per_tok("clipped_sum"),
      "ratio_mean": per_tok("ratio_sum"), "ratio_max": ext("ratio_max", jnp.max, 1.0),
      "ratio_min": ext("ratio_min", jnp.min, 1.0), "is_ratio_mean": per_tok("is_ratio_sum"),
      "is_ratio_max": ext("is_ratio_max", jnp.max, 1.0), "is_ratio_min": ext("is_ratio_min", jnp.min, 1.0),
      "is_frac_truncated": jnp.sum(stacked["is_truncated_sum"]) / jnp.maximum(jnp.sum(stacked["is_units"]), 1.0),
      "logp_diff_mean": per_tok("logp_diff_sum"),
      "logp_diff_max": ext("logp_diff_max", jnp.max, 0.0), "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
      "micro_batches_run": jnp.sum(on),
      **({"forward_kl": per_tok("forward_kl_sum")} if "forward_kl_sum" in stacked else {}),
      **_router_metrics(stacked),
  }


def _router_metrics(stacked: dict) -> dict:
  """A MoE policy's router statistics over the micro-batches that ran (rlax.models.moe.RouterStats): the
  load-balancing and z-losses, logged whether or not they are in the loss."""
  if "router_inputs" not in stacked:
    return {}
  inputs = jnp.maximum(jnp.sum(stacked["router_inputs"]), 1.0)
  return {"router_balance": jnp.sum(stacked["router_balance_sum"]) / inputs,
          "router_z": jnp.sum(stacked["router_z_sum"]) / inputs}
