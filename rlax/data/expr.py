"""A safe arithmetic-expression evaluator (no `eval`): integers, + - * /, unary minus, parentheses.

Used to build arithmetic and Countdown problems and to grade Countdown answers. The text is parsed
with `ast.parse(mode="eval")` and only a whitelist of nodes is interpreted, with exact rational
arithmetic (`fractions.Fraction`), so `7/2*2` is exactly 7 and no float rounding can fake a solution.
Exponents, names, calls and attribute access are rejected, and operand sizes are capped so a
hostile `9**9**9`-style input cannot exhaust memory.
"""

from __future__ import annotations

import ast
import fractions
import operator

from rlax import pysource

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}
_MAX_LEN = 512
_MAX_ABS = 10**30


class ExprError(ValueError):
  """The text is not an allowed arithmetic expression."""


def _eval(node: ast.AST, literals: list[int]) -> fractions.Fraction:
  if isinstance(node, ast.Expression):
    return _eval(node.body, literals)
  if isinstance(node, ast.Constant) and type(node.value) is int:  # pylint: disable=unidiomatic-typecheck
    literals.append(node.value)
    return fractions.Fraction(node.value)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    v = _eval(node.operand, literals)
    return -v if isinstance(node.op, ast.USub) else v
  if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
    a, b = _eval(node.left, literals), _eval(node.right, literals)
    if isinstance(node.op, ast.Div) and b == 0:
      raise ExprError("division by zero")
    v = _BINOPS[type(node.op)](a, b)
    if abs(v.numerator) > _MAX_ABS or v.denominator > _MAX_ABS:
      raise ExprError("intermediate value too large")
    return v
  raise ExprError(f"disallowed syntax: {type(node).__name__}")


def evaluate(text: str) -> tuple[fractions.Fraction, list[int]]:
  """Returns (exact value, integer literals in order of appearance) of an arithmetic expression.

  Raises ExprError for anything but integers, + - * /, unary signs and parentheses.
  """
  text = text.strip().replace("×", "*").replace("÷", "/")
  if not text or len(text) > _MAX_LEN:
    raise ExprError(f"expression empty or longer than {_MAX_LEN} characters")
  try:
    tree = pysource.parse(text, mode="eval")
  except pysource.PARSE_ERRORS as e:
    raise ExprError(f"not an expression: {getattr(e, 'msg', e)}") from None
  literals: list[int] = []
  return _eval(tree, literals), literals
