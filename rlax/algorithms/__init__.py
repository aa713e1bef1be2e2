"""Pure, jit-able RL building blocks (advantages, policy losses, aggregation, KL, IS) and their registry."""

from rlax.algorithms.advantages import (dr_grpo_advantages, gae_advantages, grpo_advantages,
                                        reinforce_pp_advantages, rloo_advantages)
from rlax.algorithms.distill import mean_reverse_kl, reverse_kl_advantages, top_k_forward_kl
from rlax.algorithms.aggregation import AGG_MODES, aggregate, denominators
from rlax.algorithms.off_policy import IS_MODES, importance_weights
from rlax.algorithms.policy_losses import POLICY_LOSSES, cispo_loss, gspo_loss, ppo_loss, reinforce_loss
from rlax.algorithms.registry import (ESTIMATORS, TOKEN_ESTIMATORS, AlgorithmConfig, get_algorithm,
                                      known_algorithms)
from rlax.algorithms.regularizers import (KL_ESTIMATORS, clipped_value_loss, entropy_bonus, kl_estimate,
                                          kl_penalized_rewards)
from rlax.algorithms.segments import Segments
