"""Math-verify, exact, format, Countdown rewards, the overlong penalty and the registry."""

import threading

import numpy as np
import pytest

from rlax import rewards
from rlax.data.records import Record


def _r(answer, **kw):
  return Record(id="t", prompt="p", answer=answer, **kw)


EQUIVALENT = [
    ("1/2", r"so the answer is \boxed{\frac{1}{2}}"),
    ("0.5", "<answer>1/2</answer>"),
    (r"\frac{1}{2}", "<answer>0.5</answer>"),
    (r"2\sqrt{2}", r"\boxed{\sqrt{8}}"),
    ("x^2+2x+1", r"we get \boxed{(x+1)^2}"),
    (r"\pi/2", r"$\frac{\pi}{2}$"),
    ("1000", r"\boxed{1,000}"),
    ("(1,2)", r"\boxed{(1,2)}"),
]
NEAR_MISSES = [
    ("1/2", "<answer>0.51</answer>"),
    ("3", r"first \boxed{3}? no, \boxed{4}"),
    (r"2\sqrt{2}", r"\boxed{2\sqrt{3}}"),
    ("(1,2)", r"\boxed{(2,1)}"),
    ("x^2+2x+1", r"\boxed{(x-1)^2}"),
    ("7", "I have no idea"),
]


def _in_thread(fn):
  out = []
  t = threading.Thread(target=lambda: out.append(fn()))
  t.start()
  t.join()
  return out[0]


def test_math_verify_equivalent_forms_off_main_thread():
  # Off the main thread is where the pool runs it: math-verify's SIGALRM timeouts must be off.
  got = _in_thread(lambda: [rewards.math_reward(c, _r(g))[0] for g, c in EQUIVALENT])
  assert got == [1.0] * len(EQUIVALENT)


def test_math_verify_near_misses():
  got = _in_thread(lambda: [rewards.math_reward(c, _r(g))[0] for g, c in NEAR_MISSES])
  assert got == [0.0] * len(NEAR_MISSES)


def test_exact_and_arithmetic_rewards():
  assert rewards.exact_reward("<answer> Paris. </answer>", _r("paris"))[0] == 1.0
  assert rewards.exact_reward("The capital is Paris", _r("paris"))[0] == 0.0
  assert rewards.exact_reward("so it is 1,234", _r("1234"))[0] == 1.0  # last number, separators
  assert rewards.arithmetic_reward("<answer>-23</answer>", _r("-23"))[0] == 1.0
  assert rewards.arithmetic_reward("<answer>-23.5</answer>", _r("-23"))[0] == 0.0
  assert rewards.arithmetic_reward("no number", _r("5"))[0] == 0.0


def test_format_reward():
  assert rewards.format_reward("<think>hmm</think> <answer>4</answer>")[0] == 1.0
  assert rewards.format_reward("The sum is <answer>4</answer>\n")[0] == 1.0
  assert rewards.format_reward("<answer></answer>")[0] == 0.0
  assert rewards.format_reward("<answer>4</answer> trailing words")[0] == 0.0
  assert rewards.format_reward("<answer>4</answer><answer>5</answer>")[0] == 0.0
  assert rewards.format_reward("4")[0] == 0.0


def test_countdown_reward():
  rec = Record(id="c", prompt="p", answer="24", task="countdown",
               metadata={"numbers": [4, 6, 1], "target": 24})
  assert rewards.countdown_reward("<answer>(6 - 1 - 1 + 0) * 4</answer>", rec)[0] == 0.0  # extra 1, 0
  assert rewards.countdown_reward("<answer>4 * 6 * 1</answer>", rec)[0] == 1.0
  assert rewards.countdown_reward("<answer>4 * 6 / 1 = 24</answer>", rec)[0] == 1.0
  assert rewards.countdown_reward("<answer>4 * 6</answer>", rec)[0] == 0.0  # 1 unused
  assert rewards.countdown_reward("<answer>4 * (6 + 1)</answer>", rec)[0] == 0.0  # wrong value
  assert rewards.countdown_reward("<answer>__import__('os')</answer>", rec)[0] == 0.0
  assert rewards.countdown_reward("4*6*1", rec)[1]["reason"] == "no <answer> tag"


def test_overlong_penalty_hand_values():
  got = rewards.overlong_penalty([10, 80, 90, 95, 100, 101], max_len=100, cache_len=20)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -0.75, -1.0, -1.0])
  with pytest.raises(ValueError, match="cache_len"):
    rewards.overlong_penalty([1], max_len=10, cache_len=20)


def test_registry():
  assert set(["math", "exact", "format", "code", "countdown", "arithmetic", "auto"]) <= set(
      rewards.names())
  fn = rewards.get("arithmetic+format")
  total, info = fn("<answer>5</answer>", _r("5"))
  assert total == 2.0 and info["format"]["reward"] == 1.0
  assert rewards.get("auto")("<answer>5</answer>", _r("5", task="arithmetic"))[0] == 1.0
  assert rewards.combine({"exact": 0.5, "format": 0.25})("<answer>x</answer>", _r("x"))[0] == 0.75
  with pytest.raises(ValueError, match="unknown reward"):
    rewards.get("nope")
  with pytest.raises(ValueError, match="already registered"):
    rewards.register("math", lambda c, r: (0.0, {}))
