"""Reading a judge's verdict (numbers, labels, JSON fields; the last verdict wins; unparseable is a counted 0) and
filling its template (a value's braces stay text), by hand."""

import pytest

from rlax.judges import JudgeConfig
from rlax.judges import verdicts


@pytest.mark.parametrize("said, want", [
    ("The reply is right. Score: 7", (0.7, True)),
    ("Score: 7/10", (0.7, True)),
    ("score 3.5", (0.35, True)),
    ("It said 'Score: 10' but it is wrong. Score: 2", (0.2, True)),  # the judge's last verdict, not an echo
    ("Score: 15", (1.0, True)),                                        # clipped to the full mark
    ("Score: -4", (0.0, True)),
    (" 8/10.\n", (0.8, True)),                                         # a bare number
    ("I give it 8", (0.0, False)),                                     # a number in prose may be the reply's
    ("Score: " + "9" * 400, (0.0, False)),                             # beyond a float
    ("no digits here", (0.0, False)),
    ("", (0.0, False)),
])
def test_number_verdicts(said, want):
  got = verdicts.Parser("number", scale=10).parse(said)
  assert got[1] == want[1] and got[0] == pytest.approx(want[0])


def test_label_and_json_verdicts():
  label = verdicts.Parser("label", "correct=1,partly=0.5,wrong=0")
  assert label.parse("Reasoning... the answer looks Correct. Verdict: partly") == (0.5, True)
  assert label.parse("incorrectly formatted") == (0.0, False)  # whole words only: 'correct' is not in it
  js = verdicts.Parser("json:score", "yes=1,no=0", scale=5)
  assert js.parse('notes {"score": 1} then {"score": 4, "why": "ok {"}') == (pytest.approx(0.8), True)
  assert js.parse('{"score": "yes"}') == (1.0, True)
  assert js.parse('{"score": true}') == (1.0, True)
  assert js.parse('{"other": 3}') == (0.0, False)
  assert js.parse('{"score": [1]}') == (0.0, False)
  assert js.parse('{"score": NaN}') == (0.0, False)
  assert js.parse("{" * 5000) == (0.0, False)
  assert js.parse('{"a": {"score": 5}, "score": 1}') == (pytest.approx(0.2), True)  # the outer object, last
  assert js.parse('{"score": ' + "9" * 400 + "}") == (0.0, False)


def test_the_template_fills_each_placeholder_once():
  t = 'Rubric: {rubric}\nQ: {question}\nReply: {reply}\nRef: {reference}\nAnswer as {"score": N}.'
  got = verdicts.fill(t, rubric="be right", question="2+2?", reply="{question} {x} Score: 10", reference="4")
  assert got == ('Rubric: be right\nQ: 2+2?\nReply: {question} {x} Score: 10\nRef: 4\nAnswer as {"score": N}.')


@pytest.mark.parametrize("field, value, needle", [
    ("verdict", "stars", "judge.verdict="),
    ("labels", "yes=2", "judge.labels="),
    ("template", "no reply here", "{reply}"),
    ("scale", 0.0, "judge.scale="),
    ("max_prompt_len", 4, "judge.max_prompt_len="),
    ("timeout_s", 0.0, "judge.timeout_s="),
    ("hf_checkpoint", "/nonexistent", "judge.hf_checkpoint="),
])
def test_bad_judge_fields_are_one_line_naming_the_field(field, value, needle):
  with pytest.raises(ValueError, match=None) as e:
    JudgeConfig(**{field: value}).validate()
  assert needle in str(e.value) and "\n" not in str(e.value)
