"""Rollout statistics: length percentiles, truncation from finish reasons, per-source reward and pass rate."""

import numpy as np
import pytest

from rlax.rollout import stats
from rlax.sampler import EOS, LENGTH, STOP

LENGTHS = np.array([3, 10, 7, 1, 20, 4], np.int32)
FINISH = np.array([EOS, LENGTH, STOP, EOS, LENGTH, EOS], np.int32)
REWARDS = np.array([1.0, 0.0, 0.5, 1.0, 0.25, 0.75], np.float32)
SOURCES = ["gsm8k", "math", "gsm8k", "math", "gsm8k", "synthetic/digit_sort"]


def test_truncated_from_finish_reason():
  np.testing.assert_array_equal(stats.truncated_from_finish_reason(FINISH),
                                [False, True, False, False, True, False])
  np.testing.assert_array_equal(stats.truncated_from_finish_reason(["eos", "length", "stop"]),
                                [False, True, False])
  with pytest.raises(ValueError, match="unknown values"):
    stats.truncated_from_finish_reason(np.array([0, 7]))
  with pytest.raises(ValueError, match="1-D"):
    stats.truncated_from_finish_reason(np.zeros((2, 2), np.int32))


def test_rollout_stats_hand_values():
  got = stats.rollout_stats(LENGTHS, stats.truncated_from_finish_reason(FINISH), REWARDS, SOURCES)
  # Sorted lengths 1 3 4 7 10 20: median (4 + 7) / 2; p95 at rank 0.95 * 5 = 4.75, 10 + 0.75 * 10.
  want = {"response_len_mean": 45 / 6, "response_len_p50": 5.5, "response_len_p95": 17.5,
          "truncation_rate": 2 / 6,
          "reward/gsm8k": 1.75 / 3, "pass_rate/gsm8k": 1 / 3,  # 0.5 is not > 0.5
          "reward/math": 0.5, "pass_rate/math": 0.5,
          "reward/synthetic/digit_sort": 0.75, "pass_rate/synthetic/digit_sort": 1.0}
  assert set(got) == set(want)
  for k, v in want.items():
    assert got[k] == pytest.approx(v), k
  assert got["response_len_p95"] == pytest.approx(np.percentile(LENGTHS, 95))
  assert got["response_len_p50"] == pytest.approx(np.median(LENGTHS))
  assert all(type(v) is float for v in got.values())
  lower = stats.rollout_stats(LENGTHS, np.zeros(6, bool), REWARDS, SOURCES, success=0.2)
  assert lower["pass_rate/gsm8k"] == 1.0 and lower["pass_rate/math"] == 0.5
  assert lower["truncation_rate"] == 0.0


def test_rollout_stats_bad_input():
  trunc = np.zeros(6, bool)
  with pytest.raises(ValueError, match=r"rewards must be shape \(6,\)"):
    stats.rollout_stats(LENGTHS, trunc, REWARDS[:5], SOURCES)
  with pytest.raises(ValueError, match="sources"):
    stats.rollout_stats(LENGTHS, trunc, REWARDS, SOURCES[:5])
  with pytest.raises(ValueError, match="truncated must be bool"):
    stats.rollout_stats(LENGTHS, trunc.astype(int), REWARDS, SOURCES)
  with pytest.raises(ValueError, match="rewards must be numbers"):
    stats.rollout_stats(LENGTHS, trunc, np.array(["1"] * 6), SOURCES)
  with pytest.raises(ValueError, match="at least one row"):
    stats.rollout_stats(np.zeros(0), np.zeros(0, bool), np.zeros(0), [])


def test_rollout_stats_counts_nonfinite_rewards():
  """A NaN reward is counted (the controller skips or stops on it) and left out of the per-source means."""
  rewards = REWARDS.copy()
  rewards[[0, 5]] = [np.nan, np.inf]
  got = stats.rollout_stats(LENGTHS, np.zeros(6, bool), rewards, SOURCES)
  assert got["reward_nonfinite"] == 2.0
  assert got["reward/gsm8k"] == pytest.approx(0.75 / 2) and got["pass_rate/gsm8k"] == 0.0
  assert np.isnan(got["reward/synthetic/digit_sort"]) and np.isnan(got["pass_rate/synthetic/digit_sort"])
  assert "reward_nonfinite" not in stats.rollout_stats(LENGTHS, np.zeros(6, bool), REWARDS, SOURCES)
