"""Short-answer QA rewards (search agents): SQuAD normalization, exact match and token F1 by hand, the answer
read from the last <answer> tag or the last line, aliases."""

import pytest

from rlax.data.records import Record
from rlax.rewards import get, qa


def _rec(answer, aliases=None):
  return Record(id="r", prompt="q", answer=answer, metadata={"aliases": aliases} if aliases else {})


def test_squad_normalization_and_f1_by_hand():
  assert qa.normalize("  The Capital, of  Zorbia!! ") == "capital of zorbia"
  assert qa.normalize("An apple a day") == "apple day"
  assert qa.token_f1("mira tolvane", "mira") == pytest.approx(2 * 0.5 * 1 / 1.5)
  assert qa.token_f1("a b c", "c d") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
  assert qa.token_f1("", "") == 1.0 and qa.token_f1("x", "") == 0.0


def test_the_answer_is_the_last_tag_or_the_last_line():
  assert qa.final_answer("<answer>x</answer> more <answer> Quellan </answer>\ntrailing") == "Quellan"
  assert qa.final_answer("I searched.\n\nThe answer is Quellan.\n  \n") == "The answer is Quellan."
  assert qa.final_answer("   \n") is None


def test_em_and_f1_rewards_with_aliases():
  em, f1 = get("qa_em"), get("qa_f1")
  assert em("<answer>the Quellan.</answer>", _rec("Quellan"))[0] == 1.0
  assert em("<answer>Quellan city</answer>", _rec("Quellan"))[0] == 0.0
  assert f1("<answer>Quellan city</answer>", _rec("Quellan"))[0] == pytest.approx(2 / 3)
  r, info = em("<answer>Old Quellan</answer>", _rec("Quellan", aliases=["Old Quellan"]))
  assert r == 1.0 and info["em"] == 1.0 and info["reason"] == "match"
  assert em("", _rec("Quellan")) == (0.0, {"reason": "no answer", "em": 0.0, "f1": 0.0})
  with pytest.raises(ValueError, match="QA reward: the record has no answer"):
    em("<answer>x</answer>", Record(id="c", prompt="q", tests=("assert True",), task="code"))


def test_an_answer_that_normalizes_to_nothing_scores_zero_even_against_such_a_gold():
  from rlax.data.records import Record
  from rlax.rewards import qa
  rec = Record(id="x", prompt="q", answer="The The")
  for text in ("<answer></answer>", "<answer>a</answer>", ".", "<answer>the</answer>"):
    assert qa.qa_em_reward(text, rec)[0] == 0.0 and qa.qa_f1_reward(text, rec)[0] == 0.0
