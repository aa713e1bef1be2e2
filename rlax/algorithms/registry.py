"""One registry of RL algorithms: `AlgorithmConfig` (estimator + loss + aggregation + defaults) and `get_algorithm`.

    algo = get_algorithm("grpo")                      # defaults of the paper
    algo = get_algorithm("dapo", eps_high=0.3)        # overrides are validated
    adv = algo.advantages(rewards, group_size=8)      # [B]
    loss_tok, info = algo.token_loss(logp, old_logp, adv, mask)

Known names: grpo, dr_grpo, dapo, rloo, reinforce_pp, reinforce_pp_baseline, gspo, cispo, ppo, distill.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from rlax.algorithms import advantages as adv_lib
from rlax.algorithms import policy_losses
from rlax.algorithms.aggregation import AGG_MODES
from rlax.algorithms.off_policy import IS_MODES
from rlax.algorithms.regularizers import KL_ESTIMATORS
from rlax.algorithms.segments import Segments

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
# Estimators whose advantage is per token ([B, T]) given the scored-token mask (KL to go, token-level norm).
TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")
# Estimators that normalize within a prompt's group of samples (a group needs at least 2).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  """Everything that defines an RL objective; validated at construction (a bad field raises ValueError).

  advantage: one of ESTIMATORS ("gae" needs `has_value_model`: the trainer then computes GAE with its
    value model, rlax.trainer.critic). policy_loss: ppo | gspo | cispo | reinforce.
  loss_agg: token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (`max_len` is the
    Dr. GRPO constant, the generation budget; None = the batch's response slots, T - prompt_len).
    kl_coef/kl_estimator: KL-to-reference term; `kl_in_reward` subtracts it from the reward (per token
    for REINFORCE++ and PPO, computed with the old policy's log-probs) instead of adding it to the loss.
  off_policy/is_cap: TIS/MIS correction between sampler and trainer log-probs.
  old_policy: "recompute" (ratio against the trainer's log-probs at step start) or
    "behaviour" (against the sampler's log-probs; then no separate IS correction applies).
  PPO's value model (has_value_model): GAE(gamma, lam) over token rewards, clipped value loss
    (value_clip); its own AdamW at critic_lr; initialized from the starting policy ("policy") or a HF
    directory of the policy's architecture ("hf:<dir>"); the first value_warmup_steps steps train only it.
  distill_coef: on-policy distillation, the per-token reverse KL to a teacher as an advantage
    (rlax.algorithms.distill; batches carry the teacher's log-probs), added to reward_coef x the estimator's
    advantage of the task reward (0: distillation alone). forward_kl_coef: a top-k forward-KL term in the loss,
    KL(teacher || student) over the teacher's `forward_kl_top_k` most likely tokens at each scored slot
    (rlax.algorithms.distill.top_k_forward_kl); batches then carry the teacher's top-k.
  """
  name: str = "grpo"
  advantage: str = "grpo"
  policy_loss: str = "ppo"
  loss_agg: str = "seq_mean_token_mean"
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: Optional[float] = None
  adv_eps: float = 1e-6
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_in_reward: bool = False
  entropy_coef: float = 0.0
  off_policy: str = "none"
  is_cap: float = 2.0
  old_policy: str = "recompute"
  max_len: Optional[int] = None
  has_value_model: bool = False
  gamma: float = 1.0
  lam: float = 0.95
  value_clip: float = 0.2
  critic_lr: float = 1e-4
  critic_init: str = "policy"
  value_warmup_steps: int = 0
  distill_coef: float = 0.0
  reward_coef: float = 1.0
  forward_kl_coef: float = 0.0
  forward_kl_top_k: int = 16

  def __post_init__(self):
    def one_of(field, options):
      if getattr(self, field) not in options:
        raise ValueError(f"AlgorithmConfig.{field}={getattr(self, field)!r}; expected one of {list(options)}")
    one_of("advantage", ESTIMATORS)
    one_of("policy_loss", tuple(policy_losses.POLICY_LOSSES))
    one_of("loss_agg", AGG_MODES)
    one_of("kl_estimator", KL_ESTIMATORS)
    one_of("off_policy", IS_MODES)
    one_of("old_policy", ("recompute", "behaviour"))
    if self.eps_low < 0 or self.eps_high < 0:
      raise ValueError(f"clip ranges must be >= 0, got eps_low={self.eps_low}, eps_high={self.eps_high}")
    if self.policy_loss != "cispo" and self.eps_low >= 1:
      raise ValueError(f"eps_low={self.eps_low} must be < 1 (the ratio's lower clip 1 - eps_low must be > 0)")
    if self.dual_clip is not None and (self.policy_loss != "ppo" or self.dual_clip <= 1):
      raise ValueError(f"dual_clip={self.dual_clip} needs policy_loss='ppo' and a value > 1")
    if self.kl_coef < 0 or self.entropy_coef < 0:
      raise ValueError(f"kl_coef={self.kl_coef} and entropy_coef={self.entropy_coef} must be >= 0")
    if self.is_cap <= 0:
      raise ValueError(f"is_cap={self.is_cap} must be > 0")
    if self.advantage == "gae" and not self.has_value_model:
      raise ValueError("advantage='gae' (PPO) needs a value model: set has_value_model=True")
    if self.policy_loss == "gspo" and self.advantage == "gae":
      raise ValueError("GSPO uses one advantage per sequence; it cannot take per-token GAE advantages")
    if self.old_policy == "behaviour" and self.off_policy != "none":
      raise ValueError("old_policy='behaviour' already takes the ratio against the sampler; set off_policy='none'")
    if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
      raise ValueError(f"gamma={self.gamma} and lam={self.lam} must lie in [0, 1]")
    if self.critic_lr <= 0 or self.value_clip <= 0 or self.value_warmup_steps < 0:
      raise ValueError(f"critic_lr={self.critic_lr} and value_clip={self.value_clip} must be > 0, "
                       f"value_warmup_steps={self.value_warmup_steps} >= 0")
    if self.critic_init != "policy" and not (self.critic_init.startswith("hf:") and len(self.critic_init) > 3):
      raise ValueError(f"critic_init={self.critic_init!r}: use 'policy' or 'hf:<HF model directory>'")
    if self.has_value_model != (self.advantage == "gae"):
      raise ValueError(f"has_value_model={self.has_value_model} goes with advantage='gae' (PPO) only")
    if min(self.distill_coef, self.reward_coef, self.forward_kl_coef) < 0 or not (
        self.distill_coef or self.reward_coef or self.forward_kl_coef):
      raise ValueError(f"distill_coef={self.distill_coef}, reward_coef={self.reward_coef} and forward_kl_coef="
                       f"{self.forward_kl_coef} must be >= 0, not all 0")
    if self.forward_kl_top_k < 1:
      raise ValueError(f"forward_kl_top_k={self.forward_kl_top_k} must be >= 1")
    if self.distill_coef and (self.has_value_model or self.policy_loss == "gspo"):
      raise ValueError(f"distill_coef={self.distill_coef} gives per-token advantages: not with "
                       f"{'a value model' if self.has_value_model else 'GSPO'}")
    if self.max_len is not None and self.max_len <= 0:
      raise ValueError(f"max_len={self.max_len} must be positive")

  @property
  def needs_groups(self) -> bool:
    """Whether the advantage normalizes within a prompt's group: then rollout.samples_per_prompt >= 2 (not
    for distillation alone, reward_coef = 0: the teacher's advantage is per token)."""
    return self.advantage in GROUP_ESTIMATORS and self.reward_coef > 0

  @property
  def distills(self) -> bool:
    """Whether batches carry a teacher's log-probs (RolloutBatch.teacher_logprobs): the trainer then adds the
    reverse-KL advantage (and the forward-KL term), and the run scores its rollouts with the teacher
    (rlax.teachers)."""
    return self.distill_coef > 0 or self.forward_kl_coef > 0

  @property
  def teacher_top_k(self) -> int:
    """The teacher's most likely tokens a batch carries per scored slot: forward_kl_top_k with a forward-KL term,
    else 0. Callers: the trainer's batch shapes, rlax.teachers, rlax.runtime.run_state."""
    return self.forward_kl_top_k if self.forward_kl_coef > 0 else 0

  @property
  def zero_advantage_inert(self) -> bool:
    """Whether a scored token with advantage 0 adds nothing to the policy's gradient: every policy loss is the
    advantage times a function of the log-probs, but an entropy bonus or a KL term in the loss is not. The
    trainer then skips micro-batches whose advantages are all 0 (rlax.trainer.trainer)."""
    return not self.entropy_coef and not (self.kl_coef > 0 and not self.kl_in_reward) and not self.forward_kl_coef

  @property
  def tied_groups_inert(self) -> bool:
    """Whether a group whose rewards all tie trains nothing: a group-relative estimator gives it advantage 0
    (unless a KL shapes the rewards) and `zero_advantage_inert`. The step lays such groups out in micro-batches
    of their own (rlax.runtime.step), which the trainer then skips."""
    shaped = (self.kl_coef > 0 and self.kl_in_reward) or self.distills  # a teacher scores tokens of tied groups
    return self.zero_advantage_inert and self.advantage in GROUP_ESTIMATORS and not shaped

  def replace(self, **kw) -> "AlgorithmConfig":
    return dataclasses.replace(self, **kw)

  def advantages(self, rewards, group_size: int, mask=None, kl=None, segments: Segments = Segments()):
    """Advantages from rewards [B] (P groups of `group_size` contiguous rows): [B], or [B, T] for the
    REINFORCE++ estimators when `mask` [B, T] is given (`kl` [B, T]: per-token KL, penalized with kl_coef;
    `segments`: which sequence each slot of a packed batch is)."""
    if kl is not None and self.advantage not in TOKEN_ESTIMATORS:
      raise ValueError(f"advantage={self.advantage!r} takes sequence rewards: subtract the KL from them first")
    if self.advantage == "grpo":
      return adv_lib.grpo_advantages(rewards, group_size, self.adv_eps)
    if self.advantage == "dr_grpo":
      return adv_lib.dr_grpo_advantages(rewards, group_size)
    if self.advantage == "rloo":
      return adv_lib.rloo_advantages(rewards, group_size)
    if self.advantage in TOKEN_ESTIMATORS:
      # Plain REINFORCE++ has no group baseline (with G = 1 a group mean would zero every advantage).
      g = group_size if self.advantage == "reinforce_pp_baseline" else None
      return adv_lib.reinforce_pp_advantages(rewards, g, self.adv_eps, mask=mask, kl=kl, beta=self.kl_coef,
                                             segments=segments)
    raise ValueError("advantage='gae' is per token and needs values: pass precomputed advantages "
                     "(rlax.algorithms.gae_advantages) in the batch")

  def policy_loss_fn(self):
    """The per-token loss function with this config's clip parameters bound."""
    fn = policy_losses.POLICY_LOSSES[self.policy_loss]
    if self.policy_loss == "ppo":
      return functools.partial(fn, eps_low=self.eps_low, eps_high=self.eps_high, dual_clip=self.dual_clip)
    if self.policy_loss in ("gspo", "cispo"):
      return functools.partial(fn, eps_low=self.eps_low, eps_high=self.eps_high)
    return fn

  def token_loss(self, logp, old_logp, advantages, mask, segments: Segments = Segments()):
    """Per-token loss [B, T] and info (ratio, clipped); see policy_losses (`segments`: GSPO's sequences)."""
    if self.policy_loss == "gspo":
      return self.policy_loss_fn()(logp, old_logp, advantages, mask, segments=segments)
    return self.policy_loss_fn()(logp, old_logp, advantages, mask)


_DEFAULTS = {
    # DeepSeekMath: group-std advantages, PPO clip 0.2, per-sequence token mean, k3 KL with beta 0.04.
    "grpo": dict(advantage="grpo", policy_loss="ppo", loss_agg="seq_mean_token_mean", kl_coef=0.04),
    # Dr. GRPO: no std, no per-length normalization (constant normalizer), no KL.
    "dr_grpo": dict(advantage="dr_grpo", policy_loss="ppo", loss_agg="seq_mean_token_sum_norm"),
    # DAPO: clip-higher (0.2 / 0.28), token-level aggregation, no KL.
    "dapo": dict(advantage="grpo", policy_loss="ppo", loss_agg="token_mean", eps_high=0.28),
    "rloo": dict(advantage="rloo", policy_loss="ppo", loss_agg="token_mean"),
    # REINFORCE++: per-token KL-to-go in the reward, token-level batch normalization, no group baseline;
    # "-baseline" (same paper) subtracts the group mean reward first.
    "reinforce_pp": dict(advantage="reinforce_pp", policy_loss="ppo", loss_agg="token_mean"),
    "reinforce_pp_baseline": dict(advantage="reinforce_pp_baseline", policy_loss="ppo", loss_agg="token_mean"),
    # GSPO: sequence-level ratio with very narrow clip ranges.
    "gspo": dict(advantage="grpo", policy_loss="gspo", loss_agg="seq_mean_token_mean", eps_low=3e-4,
                 eps_high=4e-4),
    "cispo": dict(advantage="grpo", policy_loss="cispo", loss_agg="token_mean", eps_low=1.0, eps_high=0.28),
    "ppo": dict(advantage="gae", policy_loss="ppo", loss_agg="token_mean", has_value_model=True),
    # On-policy distillation: the teacher's per-token reverse KL alone, token-level aggregation.
    "distill": dict(advantage="grpo", policy_loss="ppo", loss_agg="token_mean", distill_coef=1.0, reward_coef=0.0),
}


def known_algorithms() -> list[str]:
  """Sorted names accepted by `get_algorithm`."""
  return sorted(_DEFAULTS)


def get_algorithm(name: str, **overrides) -> AlgorithmConfig:
  """The named algorithm's config with its paper defaults, plus validated overrides."""
  if name not in _DEFAULTS:
    raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(known_algorithms())}")
  fields = {f.name for f in dataclasses.fields(AlgorithmConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown AlgorithmConfig field(s) for {name!r}: {', '.join(unknown)}")
  return AlgorithmConfig(name=name, **{**_DEFAULTS[name], **overrides})
