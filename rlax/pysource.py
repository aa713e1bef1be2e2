"""Parsing Python source (expressions the policy writes, tests, tool arguments) in a threaded process.

Python 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread: a thread formatting a
traceback (its caret lines parse source) while another parses makes one of them raise SystemError("AST
constructor recursion depth mismatch"). The input is fine, so it is parsed again; callers: rlax.data.expr,
rlax.rewards.code_tests, rlax.envs.tools, and the tests that read rlax's own source.
"""

from __future__ import annotations

import ast

# What a failed parse of untrusted source raises (ValueError: NUL, on older Pythons); callers turn these into their
# own error: rlax.data.expr.evaluate, rlax.rewards.code_tests.plan.
PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError)


def parse(source: str, mode: str = "exec") -> ast.AST:
  """`ast.parse(source, mode=mode)`, tried up to 3 times on the interpreter-wide depth race (SystemError)."""
  for _ in range(2):
    try:
      return ast.parse(source, mode=mode)
    except SystemError as e:
      if "recursion depth mismatch" not in str(e):
        raise
  return ast.parse(source, mode=mode)
