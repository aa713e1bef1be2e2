"""rlax.pysource: the interpreter-wide AST depth race is parsed again; real syntax errors still raise."""

import ast

import pytest

from rlax import pysource
from rlax.data import expr


def _racing(monkeypatch, failures: int):
  real, calls = ast.parse, []

  def parse(source, *args, **kwargs):
    calls.append(source)
    if len(calls) <= failures:
      raise SystemError("AST constructor recursion depth mismatch (before=1, after=2)")
    return real(source, *args, **kwargs)

  monkeypatch.setattr(ast, "parse", parse)
  return calls


def test_the_race_is_parsed_again_and_the_answer_graded(monkeypatch):
  calls = _racing(monkeypatch, failures=2)
  assert expr.evaluate("(3 + 4) * 2")[0] == 14
  assert len(calls) == 3


def test_a_persistent_system_error_and_bad_syntax_still_raise(monkeypatch):
  calls = _racing(monkeypatch, failures=0)
  with pytest.raises(SyntaxError):
    pysource.parse("1 +", mode="eval")
  assert len(calls) == 1  # a real syntax error is not parsed again
  monkeypatch.undo()
  _racing(monkeypatch, failures=3)
  with pytest.raises(SystemError):
    pysource.parse("1", mode="eval")


def test_every_unparsable_answer_is_an_expression_error():
  for text in ("1 +", "1\x00 + 2", "(" * 255 + "1" + ")" * 255):  # NUL; past the parser's nesting limit
    with pytest.raises(expr.ExprError):
      expr.evaluate(text)
