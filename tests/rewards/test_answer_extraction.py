"""Final-answer extraction from chat-model text, answer modes in the rewards, and `rewards.build`."""

import time
from fractions import Fraction

import pytest

from rlax import rewards
from rlax.data.records import Record


def _r(answer, task="math", **kw):
  return Record(id="t", prompt="p", answer=answer, task=task, **kw)


BOXED = [
    (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"First \boxed{3}, but rechecking: \boxed{4}. Hope that helps!", "4"),
    (r"\boxed{x^{2} + \sqrt{2}} is the result", r"x^{2} + \sqrt{2}"),
    (r"\boxed{\boxed{7}}", "7"),  # a box whose whole content is a box is unwrapped
    (r"\boxed{\boxed{a}+1}", r"\boxed{a}+1"),  # not when the inner box is only part of it
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the box
    (r"\boxed{5} and then \boxed{6", "5"),  # a truncated last box is ignored
    (r"\boxed {10} (with a space)", "10"),
    (r"\fbox{9}", "9"),
    (r"\boxed{ }", None),
    ("no box at all: 42", None),
]

LAST_NUMBER = [
    ("Sure! 17 + 25 = 42. So the answer is 42.", "42"),
    ("Adding 1,000 and 234 gives a total of 1,234.", "1,234"),
    ("It went from 2.5 degrees down to -3.5.", "-3.5"),
    ("She ate 1/4 of the pie, so 3/4 is left.", "3/4"),
    (r"The probability is $\frac{3}{4}$.", r"\frac{3}{4}"),
    (r"so $x = -\dfrac{1}{3}$", r"-\dfrac{1}{3}"),
    ("x = 5-3", "3"),  # a binary minus is not a sign
    ("The point is (1,2)", "2"),  # not a thousands group
    ("we have 12,3456", "3456"),
    ("The answer is 42.\n\nLet me know if you need anything else!", "42"),
    ("No numbers here.", None),
]


@pytest.mark.parametrize("text,want", BOXED)
def test_extract_boxed(text, want):
  assert rewards.extract_boxed(text) == want


@pytest.mark.parametrize("text,want", LAST_NUMBER)
def test_extract_last_number(text, want):
  assert rewards.extract_last_number(text) == want


def test_parse_number_exact_values():
  assert rewards.parse_number("42") == 42
  assert rewards.parse_number(" $-3.5$. ") == Fraction(-7, 2)
  assert rewards.parse_number("1,234") == 1234
  assert rewards.parse_number("1,234,567.25") == Fraction(123456725, 100)
  assert rewards.parse_number("3/4") == Fraction(3, 4)
  assert rewards.parse_number(r"\frac{6}{8}") == Fraction(3, 4)
  assert rewards.parse_number(r"-\frac{1}{3}") == Fraction(-1, 3)
  assert rewards.parse_number("\u22127") == -7
  for bad in ("12,34", "x = 3", "3/0", "1.5e3", "", "3 apples"):
    assert rewards.parse_number(bad) is None, bad


def test_extract_final_modes_and_auto_order():
  text = r"We get \boxed{12}. <answer>13</answer> Double-check: 14 apples."
  assert rewards.extract_final(text, "auto") == ("13", "answer_tag")
  assert rewards.extract_final(text, "answer_tag") == ("13", "answer_tag")
  assert rewards.extract_final(text, "boxed") == ("12", "boxed")
  assert rewards.extract_final(text, "last_number") == ("14", "last_number")
  no_tag = r"We get \boxed{12}. Double-check: 14 apples."
  assert rewards.extract_final(no_tag, "auto") == ("12", "boxed")
  assert rewards.extract_final("so 3 + 4 = 7 apples", "auto") == ("7", "last_number")
  assert rewards.extract_final("<answer> </answer> 5", "auto") == ("5", "last_number")  # empty tag
  assert rewards.extract_final("nothing", "auto") == (None, None)
  assert rewards.extract_final("nothing", "boxed") == (None, None)
  with pytest.raises(ValueError, match="reward.answer='box'"):
    rewards.extract_final(text, "box")


def test_has_answer_format():
  assert rewards.has_answer_format(r"\boxed{x}", "boxed")
  assert not rewards.has_answer_format("the answer is 5", "boxed")
  assert not rewards.has_answer_format(r"\boxed{5", "boxed")  # truncated
  assert rewards.has_answer_format("<answer>Paris</answer>", "answer_tag")
  assert not rewards.has_answer_format("<answer></answer> 5", "answer_tag")
  assert rewards.has_answer_format("about 5", "last_number")
  assert not rewards.has_answer_format("<answer>Paris</answer>", "last_number")
  assert rewards.has_answer_format("<answer>Paris</answer>", "auto")
  assert not rewards.has_answer_format("I do not know.", "auto")


def test_math_reward_modes():
  text = r"First guess \boxed{1/2}. Actually the answer is \frac{3}{4}."
  rec = _r("3/4")
  assert rewards.math_reward(text, rec)[0] == 0.0  # auto: math-verify prefers the box
  assert rewards.math_reward(text, rec, answer="boxed")[0] == 0.0
  got, info = rewards.math_reward(text, rec, answer="last_number")
  assert got == 1.0 and info["extracted"] == r"\frac{3}{4}" and info["found_by"] == "last_number"
  got, info = rewards.math_reward(text, rec, answer="answer_tag")
  assert got == 0.0 and info["extracted"] is None and "answer> tag" in info["reason"]
  assert rewards.math_reward("In total there are 1,234 marbles.", _r("1234"), answer="last_number")[0] == 1.0
  assert rewards.math_reward("It is -3.5 degrees", _r("-7/2"), answer="last_number")[0] == 1.0
  assert rewards.math_reward(r"<answer>\frac{6}{8}</answer> or 5", _r("0.75"), answer="answer_tag")[0] == 1.0
  # 'auto' reads the final answer phrase of plain prose, as before.
  assert rewards.math_reward("So the answer is 7. I used 2 steps.", _r("7"))[0] == 1.0


def test_arithmetic_and_exact_modes():
  # Default 'auto' keeps the original extraction: tag, else the last number ('2' here).
  text = r"\boxed{42}. Check: 40 + 2"
  assert rewards.arithmetic_reward(text, _r("42", "arithmetic"))[0] == 0.0
  assert rewards.arithmetic_reward(text, _r("42", "arithmetic"), answer="boxed")[0] == 1.0
  assert rewards.arithmetic_reward(r"\boxed{12.0}", _r("12", "arithmetic"), answer="boxed")[0] == 1.0
  got, info = rewards.arithmetic_reward(r"\boxed{x = 12}", _r("12", "arithmetic"), answer="boxed")
  assert got == 0.0 and info["reason"] == "answer is not a number"
  got, info = rewards.arithmetic_reward("it is 12", _r("12", "arithmetic"), answer="boxed")
  assert got == 0.0 and info["reason"] == rewards.text.missing_reason("boxed")
  got, _ = rewards.arithmetic_reward("so -1,200 total", _r("-1200", "arithmetic"), answer="last_number")
  assert got == 1.0
  assert rewards.arithmetic_reward("so 12.5", _r("12", "arithmetic"), answer="last_number")[0] == 0.0
  with pytest.raises(ValueError, match="not a number"):
    rewards.arithmetic_reward(r"\boxed{1}", _r("one", "arithmetic"), answer="boxed")
  # digit_sort is an exact text match: leading zeros matter.
  sort = rewards.build("digit_sort", answer="boxed")
  assert sort(r"Sorted: \boxed{0012}", _r("0012", "digit_sort"))[0] == 1.0
  assert sort(r"Sorted: \boxed{12}", _r("0012", "digit_sort"))[0] == 0.0
  assert rewards.exact_reward(r"It is \boxed{Paris}.", _r("paris", "exact"), answer="boxed")[0] == 1.0
  assert rewards.exact_reward(r"It is \boxed{Paris}.", _r("paris", "exact"))[0] == 0.0  # no number


def test_build_defaults_are_the_registered_rewards():
  for name in ("math", "arithmetic", "digit_sort", "exact", "countdown", "code", "format", "auto"):
    assert rewards.build(name) is rewards.get(name)
  both = rewards.build("arithmetic+format")
  assert both("<answer>5</answer>", _r("5", "arithmetic"))[0] == 2.0


def test_build_format_weight():
  fn = rewards.build("math", answer="boxed", format_weight=0.25)
  got, info = fn(r"so \boxed{5}", _r("6"))
  assert got == 0.25 and info["format_ok"] and info["correctness"] == 0.0
  assert fn(r"so \boxed{6}", _r("6"))[0] == 1.25
  got, info = fn("so 6", _r("6"))  # right number, but not in the asked format
  assert got == 0.0 and not info["format_ok"] and info["format_bonus"] == 0.0
  auto = rewards.build("arithmetic", format_weight=0.1)
  assert auto("<answer>5</answer>", _r("5", "arithmetic"))[0] == pytest.approx(1.1)
  assert auto("it is 6", _r("5", "arithmetic"))[0] == pytest.approx(0.1)
  assert auto("no idea", _r("5", "arithmetic"))[0] == 0.0
  tag = rewards.build("arithmetic+format", answer="answer_tag", format_weight=0.5)
  got, info = tag("<answer>5</answer>", _r("5", "arithmetic"))
  assert got == 2.5 and info["arithmetic"]["mode"] == "answer_tag" and info["format"]["reward"] == 1.0


def test_build_auto_applies_mode_per_task():
  fn = rewards.build("auto", answer="boxed")
  assert fn(r"\boxed{3/4}, not 5", _r(r"\frac{3}{4}", "math"))[0] == 1.0
  assert fn(r"\boxed{7} (check: 3 + 4)", _r("7", "arithmetic"))[0] == 1.0
  assert rewards.build("auto")(r"\boxed{7} (check: 3 + 4)", _r("7", "arithmetic"))[0] == 0.0
  cd = Record(id="c", prompt="p", answer="24", task="countdown", metadata={"numbers": [4, 6], "target": 24})
  assert fn(r"<answer>4 * 6</answer> \boxed{1}", cd)[0] == 1.0  # countdown ignores the mode


def test_build_errors_name_the_field():
  with pytest.raises(ValueError, match=r"reward.name='nope'"):
    rewards.build("nope")
  with pytest.raises(ValueError, match=r"reward.name='math\+nope'.*'nope'"):
    rewards.build("math+nope")
  with pytest.raises(ValueError, match=r"reward.answer='box'"):
    rewards.build("math", answer="box")
  with pytest.raises(ValueError, match=r"reward.answer='boxed' does not apply"):
    rewards.build("code+countdown", answer="boxed")
  for w in (-0.1, float("nan"), "0.1"):
    with pytest.raises(ValueError, match="reward.format_weight"):
      rewards.build("math", format_weight=w)


@pytest.mark.parametrize("fn, text", [
    (rewards.extract_tag, "<answer>" * 32000),  # unclosed tags: 34 s with a regex
    (rewards.extract_boxed, "\\boxed{" * 32000),  # unclosed boxes
    (lambda t: rewards.format_reward(t)[0], "<think>" + "</think>" * 30000 + "<answer>x</answer>"
     + "</answer>" * 30000 + "z"),
])
def test_extraction_is_linear_in_hostile_text(fn, text):
  start = time.perf_counter()
  assert not fn(text)
  assert time.perf_counter() - start < 1.0


def test_tag_and_box_pairing_unchanged():
  assert rewards.extract_tag("<answer>a<answer>b</answer> <answer>c</answer>") == "c"
  assert rewards.extract_tag("<answer>a<answer>b</answer>") == "a<answer>b"
  assert rewards.extract_tag("<answer>1</answer><answer>2") == "1"
  assert rewards.extract_boxed(r"\boxed{\boxed{ \boxed{7} }}") == "7"
  assert rewards.extract_boxed(r"\boxed{ \boxed{3} and 4") == "3"  # inside an unclosed box
  assert rewards.format_reward("<think>a</think> <answer>1</answer>\n")[0] == 1.0
  assert rewards.format_reward("<answer></answer>")[0] == 0.0
