"""The algorithm registry: defaults per name, dispatch, and clear errors for bad configs."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A

NAMES = ["cispo", "dapo", "distill", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]


def test_known_names():
  assert A.known_algorithms() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_each_algorithm_builds_and_computes(name):
  algo = A.get_algorithm(name)
  assert algo.name == name
  logp = jnp.full((4, 3), -1.0)
  mask = jnp.array([[1.0, 1.0, 0.0]] * 4)
  if algo.advantage == "gae":
    adv, _ = A.gae_advantages(jnp.ones((4, 3)), jnp.zeros((4, 3)), mask, algo.gamma, algo.lam)
  else:
    adv = algo.advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), group_size=2)
    assert adv.shape == (4,)
  loss, info = algo.token_loss(logp, logp, adv, mask)
  assert loss.shape == (4, 3) and np.all(np.isfinite(loss))
  np.testing.assert_allclose(np.asarray(info["ratio"])[np.asarray(mask) > 0], 1.0)


def test_paper_defaults():
  assert A.get_algorithm("grpo").kl_coef == 0.04
  assert A.get_algorithm("dapo").eps_high == 0.28 and A.get_algorithm("dapo").loss_agg == "token_mean"
  assert A.get_algorithm("dr_grpo").loss_agg == "seq_mean_token_sum_norm"
  assert A.get_algorithm("gspo").eps_high == 4e-4
  adv = A.get_algorithm("rloo").advantages(jnp.array([3.0, 1.0]), 2)
  np.testing.assert_allclose(adv, [2.0, -2.0])


def test_overrides_are_applied_and_validated():
  assert A.get_algorithm("dapo", eps_high=0.3).eps_high == 0.3
  with pytest.raises(ValueError, match="unknown AlgorithmConfig field"):
    A.get_algorithm("grpo", epsilon=0.1)


def test_unknown_algorithm_lists_known_ones():
  with pytest.raises(ValueError, match="unknown algorithm 'grpo2'; known: cispo, dapo, distill, dr_grpo, grpo"):
    A.get_algorithm("grpo2")


@pytest.mark.parametrize("kw, msg", [
    (dict(has_value_model=False), "needs a value model"),
    (dict(eps_low=-0.1), "clip ranges must be >= 0"),
    (dict(eps_low=1.0), "must be < 1"),
    (dict(dual_clip=0.5), "dual_clip=0.5"),
    (dict(loss_agg="mean"), "loss_agg='mean'"),
    (dict(kl_estimator="k9"), "kl_estimator='k9'"),
    (dict(off_policy="tis"), "off_policy='tis'"),
    (dict(gamma=1.5), "gamma=1.5"),
])
def test_inconsistent_configs_fail_clearly(kw, msg):
  with pytest.raises(ValueError, match=msg):
    A.get_algorithm("ppo", **kw)


def test_gspo_cannot_take_gae_and_behaviour_ratio_excludes_is():
  with pytest.raises(ValueError, match="GSPO"):
    A.AlgorithmConfig(advantage="gae", has_value_model=True, policy_loss="gspo")
  with pytest.raises(ValueError, match="old_policy='behaviour'"):
    A.get_algorithm("grpo", old_policy="behaviour", off_policy="tis_token")


def test_gae_estimator_refuses_sequence_rewards():
  with pytest.raises(ValueError, match="precomputed advantages"):
    A.get_algorithm("ppo").advantages(jnp.ones(4), 2)
