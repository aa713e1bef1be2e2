"""pass@k: hand values, brute-force enumeration, and `evaluate` on a stub policy."""

import itertools
import math

import numpy as np
import pytest

from rlax import evaluation
from rlax.data.records import Record


def _brute_force(n, c, k):
  """Fraction of all k-subsets of the n samples containing at least one correct one."""
  samples = [1] * c + [0] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_hand_values():
  assert evaluation.pass_at_k(10, 0, 1) == 0.0
  assert evaluation.pass_at_k(10, 3, 1) == pytest.approx(0.3)
  assert evaluation.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
  assert evaluation.pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
  assert evaluation.pass_at_k(5, 4, 2) == 1.0
  with pytest.raises(ValueError, match="pass@k needs"):
    evaluation.pass_at_k(3, 1, 4)


def test_pass_at_k_matches_enumeration_and_binomials():
  for n in range(1, 9):
    for c in range(n + 1):
      for k in range(1, n + 1):
        got = evaluation.pass_at_k(n, c, k)
        assert got == pytest.approx(_brute_force(n, c, k), abs=1e-12)
        assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
  # Large n: binomials of this size overflow floats; the product form stays exact enough.
  assert evaluation.pass_at_k(2000, 10, 100) == pytest.approx(
      1 - math.comb(1990, 100) / math.comb(2000, 100), rel=1e-9)


def test_evaluate_on_stub_policy_per_source():
  # Prompt i of source s is answered correctly in `correct[i]` of its 4 samples.
  correct = {"a0": 4, "a1": 0, "b0": 2, "b1": 1}
  recs = [Record(id=k, prompt=k, answer="yes", source=k[0]) for k in correct]

  def generate_fn(records, n):
    return [["<answer>yes</answer>"] * correct[r.prompt] + ["<answer>no</answer>"] * (n - correct[r.prompt])
            for r in records]

  def reward_fn(c, r):
    return float("yes" in c), {}

  m = evaluation.evaluate(generate_fn, recs, reward_fn, n=4, ks=(1, 2), batch_size=3)
  p1 = {k: v / 4 for k, v in correct.items()}
  p2 = {k: evaluation.pass_at_k(4, v, 2) for k, v in correct.items()}
  assert m["pass@1"] == pytest.approx(np.mean(list(p1.values())))
  assert m["pass@2"] == pytest.approx(np.mean(list(p2.values())))
  assert m["pass@1/a"] == pytest.approx(0.5) and m["pass@1/b"] == pytest.approx(3 / 8)
  assert m["pass@2/b"] == pytest.approx((p2["b0"] + p2["b1"]) / 2)
  assert m["mean_reward"] == pytest.approx(7 / 16) and m["num_prompts"] == 4
  with pytest.raises(ValueError, match="1 <= k <= n"):
    evaluation.evaluate(generate_fn, recs, reward_fn, n=2, ks=(4,))


def test_evaluate_with_verifier_pool():
  from rlax import rewards  # pylint: disable=g-import-not-at-top
  recs = [Record(id=str(i), prompt=str(i), answer=str(i), task="arithmetic") for i in range(6)]

  def generate_fn(records, n):
    return [[f"<answer>{r.prompt}</answer>" if int(r.prompt) % 2 else "<answer>x</answer>"] * n for r in records]

  with rewards.VerifierPool(num_workers=3) as pool:
    m = evaluation.evaluate(generate_fn, recs, rewards.get("arithmetic"), n=2, ks=(1,),
                            grade_fn=pool.grade)
  assert m["pass@1"] == pytest.approx(0.5)
