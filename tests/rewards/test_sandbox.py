"""The code sandbox against hostile solutions: each attack is contained and graded 0.

Each attack sets `ok = True` only if it succeeded, and the single test is `assert ok`, so a
reward of 1 would mean the attack got through. Attacks run with every available isolation mode,
and — where namespaces are available — also with the audit hook off, to check the kernel layers
on their own.
"""

import os

import psutil
import pytest

from rlax.rewards import sandbox

_REPO_FILE = os.path.abspath(__file__)
_MODES = ["audit"] + (["namespaces"] if sandbox.isolation_mode() == "namespaces" else [])
# (mode, audit hook): with namespaces also the kernel layers alone, without the Python-level hook.
_LAYERS = [(m, True) for m in _MODES] + [(m, False) for m in _MODES if m == "namespaces"]
_FAST = sandbox.SandboxLimits(wall_s=2.0, cpu_s=2, memory_mb=256)


def _attacks(tmp_path):
  outside = str(tmp_path / "pwned.txt")
  return {
      "read_passwd": "ok = 'root:' in open('/etc/passwd').read()",
      "read_repo": f"ok = len(open({_REPO_FILE!r}).read()) > 0",
      "list_dirs": (f"import os\nok = len(os.listdir('/etc')) + "
                    f"len(os.listdir({os.path.dirname(_REPO_FILE)!r})) > 0"),
      "write_outside": f"open({outside!r}, 'w').write('x')\nok = True",
      "network": ("import socket\ns = socket.socket()\ns.settimeout(1)\n"
                  "ok = s.connect_ex(('1.1.1.1', 80)) == 0"),
      "kill_parent": f"import os\nos.kill(os.getppid(), 9)\nos.kill({os.getpid()}, 9)\nok = True",
      "fork_bomb": ("import os, time\nn = 0\ntry:\n  while n < 500:\n    if os.fork() == 0:\n"
                    "      time.sleep(30)\n      os._exit(0)\n    n += 1\nexcept OSError:\n  pass\n"
                    "ok = n >= 500"),
      "memory_bomb": "x = bytearray(4 * 1024 ** 3)\nok = True",
      "subprocess": ("import subprocess\nok = 'root:' in subprocess.run(['cat', '/etc/passwd'], "
                     "capture_output=True, text=True).stdout"),
  }


def _assert_no_leftover_children():
  kids = psutil.Process().children(recursive=True)
  assert not [k for k in kids if k.status() != psutil.STATUS_ZOMBIE], kids


@pytest.mark.parametrize("mode,audit_hook", _LAYERS)
def test_attacks_are_contained(mode, audit_hook, tmp_path):
  for name, code in _attacks(tmp_path).items():
    res = sandbox.run_tests(code, ["assert ok"], limits=_FAST, mode=mode, audit_hook=audit_hook)
    assert res.passed == 0 and res.error, (name, res)
  assert not os.path.exists(tmp_path / "pwned.txt")
  _assert_no_leftover_children()
  good = sandbox.run_tests("def f(x):\n  return 2 * x\n", ["assert f(2) == 4"], mode=mode,
                           audit_hook=audit_hook)
  assert good.all_passed and good.status == "ok"


def test_namespace_job_runs_as_nobody_alone_in_its_pid_namespace():
  res = sandbox.run_tests("import os\nprint(os.getuid(), os.getpid())", ["assert True"],
                          audit_hook=False)
  if sandbox.isolation_mode() == "namespaces":
    assert res.all_passed and res.output.split() == ["65534", "1"]
  else:  # the fallback keeps the caller's uid and shares the host PID space
    assert res.all_passed and res.output.split()[0] == str(os.geteuid())


@pytest.mark.parametrize("mode", _MODES)
def test_hangs_floods_and_exits(mode):
  loop = sandbox.run_tests("while True:\n  pass", ["assert True"], limits=_FAST, mode=mode)
  assert loop.status == "timeout" and loop.passed == 0 and loop.wall_s < 5
  sleep = sandbox.run_tests("import time\ntime.sleep(60)", ["assert True"], limits=_FAST, mode=mode)
  assert sleep.status == "timeout"
  flood = sandbox.run_tests("import sys\nfor _ in range(4096):\n  sys.stdout.write('x' * (1 << 20))",
                            ["assert True"], limits=_FAST, mode=mode)
  assert flood.status == "output_limit" and len(flood.output) <= _FAST.output_bytes
  early = sandbox.run_tests("import os\nos._exit(0)", ["assert True"], mode=mode)
  assert early.status == "crashed" and early.passed == 0
  forged = sandbox.run_tests("print('\\n0' * 32 + ' 1 1 \"\"')", ["assert False"], mode=mode)
  assert forged.status == "ok" and forged.passed == 0
  cheat = sandbox.run_tests("import builtins\nbuiltins.exec = lambda *a: None", ["assert False"],
                            mode=mode)
  assert cheat.passed == 0
  _assert_no_leftover_children()


def test_partial_results_and_errors():
  res = sandbox.run_tests("def f(x):\n  return x + 1\nprint('hello')",
                          ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 4"])
  assert (res.status, res.passed, res.total) == ("ok", 2, 3)
  assert res.output == "hello" and "test 1: AssertionError" in res.error
  syntax = sandbox.run_tests("def f(:", ["assert True"])
  assert syntax.passed == 0 and "SyntaxError" in syntax.error
  with pytest.raises(ValueError, match="code must be a string"):
    sandbox.run_tests(None, [])
