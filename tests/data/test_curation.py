"""Curation on planted data: duplicates, contamination, difficulty band, curriculum, dynamic sampling."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A
from rlax.data import curation as C
from rlax.data import dynamic_sampling as D
from rlax.data.records import Record

_UNIQUE = [
    "A farmer has 12 sheep and buys twice as many goats as sheep, then sells a third of all the "
    "animals at the market on a sunny monday. How many animals remain on the farm?",
    "Find every real x such that the square of x minus five times x plus six equals zero, and "
    "report the sum of all solutions you found.",
    "A train leaves the station at noon travelling at sixty miles per hour; a second train "
    "follows one hour later at eighty miles per hour. When does it catch up?",
    "How many distinct ways can the letters of the word banana be arranged in a row so that no "
    "two identical letters are adjacent to each other?",
    "The perimeter of a rectangle is forty centimetres and its length is three times its width. "
    "What is the area of this rectangle in square centimetres?",
    "A bag holds four red marbles and six blue marbles. Two are drawn without replacement. What "
    "is the probability that both marbles drawn are blue?",
]


def _rec(i, text):
  return Record(id=str(i), prompt=text, answer="0")


def test_minhash_estimates_jaccard():
  h = C.MinHasher(num_perm=256, seed=1)
  for overlap in (0, 50, 100, 150):
    a = {f"g{i}" for i in range(200)}
    b = {f"g{i}" for i in range(200 - overlap, 400 - overlap)}
    est = np.mean(h.signature(a) == h.signature(b))
    assert abs(est - C.jaccard(a, b)) < 0.08, (overlap, est)  # ~3 sigma at 256 permutations


def test_exact_and_near_dedup_remove_planted_duplicates():
  uniq = [_rec(i, t) for i, t in enumerate(_UNIQUE)]
  uniq += [_rec(100 + i, f"Completely different problem number {i} about prime numbers and cats.")
           for i in range(5)]
  exact = [_rec("e0", "  " + uniq[0].prompt.upper() + "  "), _rec("e1", uniq[7].prompt + "!!")]
  near = [_rec("n0", uniq[0].prompt.replace("sunny", "rainy")),
          _rec("n1", uniq[3].prompt.replace("in a row", "in one row"))]
  data = uniq[:4] + exact[:1] + uniq[4:] + near + exact[1:]
  kept, rep = C.exact_dedup(data)
  assert rep["exact_duplicates"] == 2 and set(rep["removed_ids"]) == {"e0", "e1"}
  kept, rep = C.near_dedup(kept, threshold=0.7)
  assert rep["near_duplicates"] == 2
  assert {r for r, _ in rep["removed"]} == {"n0", "n1"}
  assert [r.id for r in kept] == [r.id for r in uniq]


def test_decontamination_drops_only_overlapping_prompts():
  evals = ["Compute the sum of the first one hundred positive odd integers and explain each step."]
  train = [_rec(0, "Warmup. Compute the sum of the first one hundred positive odd integers please."),
           _rec(1, "Compute the product of two primes."),
           _rec(2, "explain each step")]
  kept, rep = C.decontaminate(train, evals, n=8)
  assert [r.id for r in kept] == ["1", "2"] and rep["contaminated"] == 1


def test_difficulty_estimation_and_band_filter_on_stub_policy():
  true_rates = np.array([0.0, 0.25, 0.5, 0.75, 1.0, 0.125])
  recs = [Record(id=str(i), prompt=str(i), answer="yes") for i in range(len(true_rates))]

  def generate_fn(records, k):
    # Prompt i is solved in exactly round(rate * k) of its k samples.
    hits = [int(round(true_rates[int(r.prompt)] * k)) for r in records]
    return [["yes"] * h + ["no"] * (k - h) for h in hits]

  rates = C.estimate_pass_rates(recs, generate_fn, lambda c, r: (float(c == r.answer), {}), k=8,
                                batch_size=4)
  np.testing.assert_allclose(rates, true_rates)
  kept, rep = C.filter_by_pass_rate(recs, rates, lo=0.1, hi=0.9)
  assert [r.id for r in kept] == ["1", "2", "3", "5"]
  assert rep == {"too_easy": 1, "too_hard": 1, "kept": 4}
  with pytest.raises(ValueError, match="pass_rates shape"):
    C.filter_by_pass_rate(recs, rates[:3])


def test_curriculum_moves_level_with_pass_rate_and_round_trips():
  cur = C.Curriculum(level=1, max_level=3, raise_at=0.8, lower_at=0.2, ema=0.5, min_updates=3)
  levels = [cur.update(0.95) for _ in range(3)]
  assert levels == [1, 1, 2]
  state = cur.get_state()
  levels = [cur.update(0.05) for _ in range(3)]
  assert levels[-1] == 1
  cur.set_state(state)
  assert cur.level == 2 and cur.updates == 0


def test_informative_groups_and_refill():
  rewards = np.array([[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5000001]])
  keep, dropped = D.informative_groups(rewards)
  assert keep.tolist() == [False, True, False, False] and dropped == 3
  assert D.refill_count(rewards, target_groups=4) == 12  # 3 short, 1 in 4 groups informative
  assert D.refill_count(np.array([[0, 1], [1, 0]]), target_groups=2) == 0
  with pytest.raises(ValueError, match="groups, samples"):
    D.informative_groups(np.zeros(4))


def test_group_buffer_keeps_batch_size():
  rng = np.random.default_rng(0)
  buf = D.GroupBuffer(target_groups=8)
  rounds, popped = 0, []
  while len(popped) < 3:
    rewards = (rng.random((8, 4)) < 0.3).astype(float)
    buf.add([f"g{rounds}_{i}" for i in range(8)], rewards)
    rounds += 1
    while buf.ready():
      groups, r = buf.pop_batch()
      assert len(groups) == 8 and r.shape == (8, 4)
      assert np.all(r.max(1) > r.min(1))
      popped.append(groups)
  assert buf.dropped > 0 and buf.seen == 8 * rounds
  assert len(set(sum(popped, []))) == 24  # no group served twice
  with pytest.raises(ValueError, match="not ready"):
    D.GroupBuffer(2).pop_batch()


def test_tied_rows_follow_the_estimators_rule_for_a_zero_advantage():
  """A group is tied only where its rewards are exactly equal: GRPO's advantage is then exactly 0, while rewards
  1e-7 apart still get advantages far from 0 after the std division, so their rows must train."""
  rewards = np.array([0, 0, 0, 0, 1, 0, 1, 1, 0.5, 0.5, 0.5, 0.5 + 1e-7], np.float32)
  tied = D.tied_rows(rewards, 4)
  np.testing.assert_array_equal(tied, [True] * 4 + [False] * 8)
  adv = np.asarray(A.get_algorithm("grpo").advantages(jnp.asarray(rewards), 4))
  np.testing.assert_array_equal(adv[tied], 0.0)
  assert (np.abs(adv[4:].reshape(2, 4)).max(1) > 0.1).all()  # each untied group has rows that train
