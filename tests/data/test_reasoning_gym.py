"""reasoning-gym tasks: procedural problems as records (options passed to the dataset), graded by the dataset's
own scorer through the reward registry and the verifier processes, mixed with built-in tasks by weight."""

import pytest

from rlax import rewards
from rlax.data import synthetic

rg = pytest.importorskip("reasoning_gym")


def test_records_are_the_datasets_problems_and_its_scorer_grades_them():
  recs = synthetic.generate("reasoning_gym:chain_sum", 4, seed=3, options='{"min_terms": 2, "max_terms": 2}')
  ds = rg.create_dataset("chain_sum", size=4, seed=3, min_terms=2, max_terms=2)
  assert [r.answer for r in recs] == [str(ds[i]["answer"]) for i in range(4)]
  assert all(r.prompt.startswith(ds[i]["question"].strip()) for i, r in enumerate(recs))
  assert {r.source for r in recs} == {"reasoning_gym/chain_sum"} and recs[0].metadata["rg"]["index"] == 0
  fn = rewards.build("reasoning_gym")
  r = recs[1]
  assert fn(f"so <answer>{r.answer}</answer>", r)[0] == ds.score_answer(r.answer, ds[1]) == 1.0
  assert fn(f"it is {int(r.answer) + 1}", r)[0] == ds.score_answer(str(int(r.answer) + 1), ds[1]) == 0.0
  assert fn("no idea", r)[0] == 0.0
  assert rewards.build("auto")(f"<answer>{r.answer}</answer>", r)[0] == 1.0  # dispatch on record.task


def test_graded_in_the_verifier_processes():
  recs = synthetic.generate("reasoning_gym:leg_counting", 3, seed=0)
  with rewards.VerifierPool(num_workers=1, timeout_s=30) as pool:
    out = pool.grade(rewards.build("reasoning_gym"), [f"<answer>{r.answer}</answer>" for r in recs] + ["<answer>-1</answer>"],
                     recs + recs[:1])
  assert [g[0] for g in out] == [1.0, 1.0, 1.0, 0.0]


def test_mixtures_and_bad_tasks():
  recs = synthetic.generate("reasoning_gym:leg_counting=3,arithmetic=1", 8, seed=0)
  assert sorted(r.source for r in recs).count("reasoning_gym/leg_counting") == 6
  assert len({r.source for r in recs[:4]}) == 2  # interleaved, so a held-out set from the front has both
  with pytest.raises(ValueError, match="reasoning-gym has no dataset 'no_such'"):
    synthetic.generate("reasoning_gym:no_such", 2)
  with pytest.raises(ValueError, match="bad options"):
    synthetic.generate("reasoning_gym:chain_sum", 2, options='{"no_such_option": 1}')
  with pytest.raises(ValueError, match="data.task_options is not JSON"):
    synthetic.generate("arithmetic", 2, options="{")
  with pytest.raises(ValueError, match="unknown task 'nope'"):
    synthetic.generate("nope=1,arithmetic=1", 2)
