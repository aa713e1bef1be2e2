"""The code sandbox: grading outside it, programs in it, limits, the isolation policy and stale job dirs.

The hostile cases (reward hacks, escapes, lifetimes) are in tests/hostile/; these check the mechanics.
"""

import ast
import os

import pytest

from rlax.rewards import code_tests
from rlax.rewards import jail
from rlax.rewards import sandbox

_FAST = sandbox.SandboxLimits(wall_s=2.0, cpu_s=2, memory_mb=256)


def test_the_jail_is_available_here():
  assert sandbox.isolation_mode() == "jail", jail.available()


def test_partial_results_and_errors():
  res = code_tests.run_tests("def f(x):\n  return x + 1\nprint('hello')",
                             ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 4"])
  assert (res.status, res.passed, res.total) == ("ok", 2, 3)
  assert res.output.strip() == "hello" and res.error.startswith("test 1: assertion failed")
  syntax = code_tests.run_tests("def f(:", ["assert f(1) == 1"])
  assert syntax.passed == 0 and "SyntaxError" in syntax.error
  raised = code_tests.run_tests("def f(x):\n  return 1 / x", ["assert f(0) == 1", "assert f(1) == 1"])
  assert (raised.passed, raised.error) == (1, "test 0: ZeroDivisionError: division by zero")
  with pytest.raises(ValueError, match="code must be a string"):
    code_tests.run_tests(None, ["assert True"])
  with pytest.raises(ValueError, match="not valid Python"):
    code_tests.run_tests("x = 1", ["assert (("])


def test_values_cross_with_their_exact_types():
  """3 == 3.0 holds as in Python, but True is not 1 when the test asks for the type, and containers keep
  their kind (tuple vs list; OrderedDict order)."""
  code = ("import collections\ndef f():\n  return 3\ndef g():\n  return True\ndef h():\n  return (1, [2])\n"
          "def o():\n  return collections.OrderedDict([('b', 1), ('a', 2)])\n")
  tests = ["assert f() == 3.0", "assert type(g()) is bool and g() == 1", "assert h() == (1, [2])",
           "assert h() != [1, [2]]", "assert list(o()) == ['b', 'a']", "assert type(f()) is int",
           "assert isinstance(o(), dict)"]
  res = code_tests.run_tests(code, tests, _FAST)
  assert res.passed == len(tests), res


def test_probes_carry_argument_values_never_expected_ones():
  split = code_tests.Split(set(code_tests.SAFE_BUILTINS) | {"math"}, {"want", "case"}, [])
  split.visit(ast.parse("sorted(f(x=case[0])) == want and math.isclose(g(), 0.5)", mode="eval"))
  assert split.probes == [("f(x=__rlax_a0_0)", ("__rlax_a0_0",), False), ("g()", (), False)]
  split = code_tests.Split(set(code_tests.SAFE_BUILTINS), set(), [])
  split.visit(ast.parse("all(f(i) == 2 * i for i in range(3))", mode="eval"))
  assert split.probes == [("f(__rlax_a0_0)", ("__rlax_a0_0",), False)]  # i's value goes in; 2 * i stays here
  with pytest.raises(ValueError, match="no assert statement"):
    code_tests.plan("f(2)")


def test_statements_run_here_unless_they_need_the_solution():
  code = ("class Solution:\n  def __init__(self):\n    self.n = 0\n  def add(self, k):\n    self.n += k\n"
          "    return self.n\ndef sq(x):\n  return x * x\ndef sort_in_place(xs):\n  xs.sort()\n"
          "def gen(n):\n  yield from range(n)\nclass Node:\n  def __init__(self, v, left=None):\n"
          "    self.val, self.left, self.kids = v, left, [1, 2]\ndef tree():\n  return Node(0, Node(1))\n")
  tests = ["n = 5\nresult = sq(n)\nassert result == 25", "res = []\nfor i in range(3):\n  res.append(sq(i))\n"
           "assert res == [0, 1, 4]", "def check(a, b):\n  return sq(a) == b\nassert check(3, 9)",
           "s = Solution()\ns.add(2)\nassert s.add(3) == 5", "try:\n  sq('x')\nexcept TypeError:\n  ok = True\n"
           "assert ok", "from math import *\nassert isclose(sq(sqrt(2)), 2)", "x, *rest = 3, 9\nassert sq(x) == rest[0]",
           "nums = [3, 1, 2]\nsort_in_place(nums)\nassert nums == [1, 2, 3]", "g = gen(3)\nassert next(g) == 0 and "
           "list(g) == [1, 2]", "def check(candidate):\n  assert candidate(4) == 16\ncheck(sq)\nassert True",
           "root = tree()\nassert root.left.val == 1 and len(root.kids) == 2", "assert isinstance(sq(2), int) and type(sq(2.0)) is float"]
  res = code_tests.run_tests(code, tests, _FAST)
  assert res.passed == len(tests), res


def test_hangs_floods_and_exits():
  loop = code_tests.run_tests("while True:\n  pass", ["assert True"], limits=_FAST)
  assert loop.status == "timeout" and loop.passed == 0 and loop.wall_s < 4
  sleep = code_tests.run_tests("def f():\n  import time\n  time.sleep(60)", ["assert f() is None"], limits=_FAST)
  assert sleep.status == "timeout"
  flood = code_tests.run_tests("import sys\nfor _ in range(4096):\n  sys.stdout.write('x' * (1 << 20))",
                               ["assert True"], limits=_FAST)
  assert flood.status == "output_limit" and len(flood.output) <= _FAST.output_bytes
  early = code_tests.run_tests("import os\nos._exit(0)", ["assert True"], limits=_FAST)
  assert early.status == "crashed" and early.passed == 0


def test_run_program():
  ok = sandbox.run_program("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3",
                           limits=_FAST)
  assert (ok.status, ok.output.strip()) == ("ok", "6")
  err = sandbox.run_program("raise ValueError('boom')", limits=_FAST)
  assert err.status == "error" and "ValueError: boom" in err.output
  hang = sandbox.run_program("while True:\n  pass", limits=_FAST)
  assert hang.status in ("timeout", "crashed") and hang.wall_s < 4
  ids = sandbox.run_program("import os\nprint(os.getuid(), os.getpid(), sum(p.isdigit() for p in os.listdir('/proc')) < 5)",
                            limits=_FAST)
  uid, pid, few = ids.output.split()
  want = jail.job_uid() if os.geteuid() == 0 else jail.NOBODY
  assert ids.status == "ok" and int(uid) == want and int(pid) < 10 and few == "True", ids


def test_unsafe_is_an_explicit_opt_in(monkeypatch):
  monkeypatch.setattr(jail, "available", lambda: (False, "bwrap: cannot create a namespace"))
  with pytest.raises(RuntimeError, match="no sandbox for untrusted code: bwrap: cannot create a namespace; .*"
                                         "reward.sandbox=unsafe"):
    code_tests.run_tests("def f():\n  return 1", ["assert f() == 1"])
  sandbox.configure("unsafe")
  try:
    assert sandbox.isolation_mode() == "unsafe"
    assert code_tests.run_tests("def f():\n  return 1", ["assert f() == 1"], _FAST).all_passed
    assert sandbox.run_program("print(2 + 2)", limits=_FAST).output.strip() == "4"
  finally:
    sandbox.configure("auto")
  with pytest.raises(ValueError, match="reward.sandbox='off'"):
    sandbox.configure("off")


def test_stale_job_directories_are_removed(tmp_path):
  dead = tmp_path / "rlax_sbx_999999999_abc"
  live = tmp_path / f"rlax_sbx_{os.getpid()}_abc"
  legacy = tmp_path / "rlax_sbx_q1w2e3"
  for d in (dead, live, legacy):
    d.mkdir()
    (d / "f").write_text("x")
  assert sandbox.remove_stale_jobs(str(tmp_path)) == 2
  assert live.exists() and not dead.exists() and not legacy.exists()
