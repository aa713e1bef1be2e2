"""Code-reward hacking and sandbox escapes through the public entry point `rewards.code_reward`.

Every cheat is written against the record's tests `assert f(2) == 987654321`-style, whose expected values an
honest solution must compute. A cheat scores 0; an escape's solution returns True only if the escape worked
(so reward 1 would mean it got through). Each case also checks the host is left clean (`clean_host`).
"""

import os

import pytest

from rlax import rewards
from rlax.data.records import Record
from rlax.rewards import sandbox

_LIMITS = sandbox.SandboxLimits(wall_s=3.0, cpu_s=3, memory_mb=256)
_TESTS = ("assert f(2) == 987654321", "assert f(3) == [1, 2, 3]", "assert sorted(f(4)) == ['a', 'b']")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _grade(code, tests=_TESTS):
  rec = Record(id="hostile", prompt="p", tests=tuple(tests), task="code")
  return rewards.code_reward(f"```python\n{code}\n```", rec, limits=_LIMITS)


def test_honest_solutions_score_one(clean_host):
  code = ("def f(x):\n  return {2: 987654321, 3: [1, 2, 3], 4: ['b', 'a']}[x]\n")
  assert _grade(code)[0] == 1.0
  tests = ["assert g(3) == 6.0", "import math\nassert math.isclose(g(0.1), 0.2)", "want = 10\nassert g(5) == want",
           "assert all(g(i) == 2 * i for i in range(20))", "x = g(4)\nassert x == 8", "assert g(1) in (2, 3)",
           "assert abs(g(1.5) - 3.0) < 1e-9", "assert h() == {'k': (1, None), 'z': {1, 2}}"]
  code = "def g(x):\n  return 2 * x\ndef h():\n  return {'k': (1, None), 'z': {2, 1}}\n"
  reward, info = _grade(code, tests)
  assert reward == 1.0, info


CHEATS = {
    "eq_always_true": "class A:\n  def __eq__(self, o): return True\n  def __hash__(self): return 0\n"
                      "def f(x):\n  return A()",
    "int_subclass": "class I(int):\n  def __eq__(self, o): return True\n  __hash__ = int.__hash__\n"
                    "def f(x):\n  return I(0)",
    "str_and_list_subclasses": "class L(list):\n  def __eq__(self, o): return True\n"
                               "class S(str):\n  def __eq__(self, o): return True\n  __hash__ = str.__hash__\n"
                               "def f(x):\n  return L() if x != 2 else S()",
    "fake_class_attribute": "class A:\n  __class__ = int\n  def __eq__(self, o): return True\n"
                            "def f(x):\n  return A()",
    "eq_raises_during_comparison": "class A:\n  def __eq__(self, o): raise AssertionError('no')\n"
                                   "def f(x):\n  return A()",
    "early_exit_at_load": "import os\nos._exit(0)",
    "sys_exit_in_call": "import sys\ndef f(x):\n  sys.exit(0)",
    "exit_in_call": "import os\ndef f(x):\n  os._exit(0)",
    "patch_builtins": "import builtins\nbuiltins.sorted = lambda *a, **k: ['a', 'b']\n"
                      "builtins.len = lambda x: 0\ndef f(x):\n  return ['z']",
    "patch_harness_json": "import json\njson.dumps = lambda *a, **k: '{\"value\": [\"i\", \"0x3ade68b1\"]}'\n"
                          "def f(x):\n  return 0",
    "write_fake_replies": "import os\nfor fd in range(3, 12):\n  try:\n"
                          "    os.write(fd, b'{\"value\": [\"i\", \"0x3ade68b1\"]}\\n' * 3)\n  except OSError:\n"
                          "    pass\ndef f(x):\n  return 0",
    "print_fake_results": "print('3 3 \"\"')\nprint('{\"value\": [\"i\", \"0x3ade68b1\"]}')\nprint('PASSED')\n"
                          "def f(x):\n  return 0",
    "read_expected_from_frames_and_gc": (
        "import gc, sys\ndef f(x):\n  seen = []\n  fr = sys._getframe()\n  while fr:\n"
        "    seen += [v for v in fr.f_code.co_consts if isinstance(v, int) and v > 10**6]\n"
        "    seen += [v for v in fr.f_locals.values() if isinstance(v, int) and v > 10**6]\n    fr = fr.f_back\n"
        "  seen += [o for o in gc.get_objects() if isinstance(o, int) and o > 10**6]\n"
        "  seen += [o for o in gc.get_objects() if isinstance(o, str) and '987654321' in o]\n"
        "  return int(str(seen[0]).split('== ')[-1]) if seen else 0"),
    "read_expected_from_files_and_env": (
        "import os\ndef f(x):\n  blob = str(os.environ)\n  for root in ('/', '/proc'):\n"
        "    for d, _, fs in os.walk(root):\n      for n in fs[:50]:\n        try:\n"
        "          blob += open(os.path.join(d, n), errors='ignore').read(1 << 16)\n"
        "        except Exception:\n          pass\n      if len(blob) > 1 << 22:\n        break\n"
        "  return 987654321 if '987654321' in blob else 0"),
    "generator_and_function_values": "def f(x):\n  return (i for i in range(3)) if x == 3 else f",
    "deeply_nested_value": "def f(x):\n  v = []\n  for _ in range(100000):\n    v = [v]\n  return v",
    "self_referencing_value": "def f(x):\n  v = []\n  v.append(v)\n  return v",
    "huge_value": "def f(x):\n  return 'x' * (200 << 20)",
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheats_score_zero(name, clean_host):
  reward, info = _grade(CHEATS[name])
  assert reward == 0.0, (name, info)


_FRAMES = "import sys\ndef _up(name):\n  fr = sys._getframe(1)\n  while fr:\n    for d in (fr.f_locals, fr.f_globals):\n" \
          "      if name in d:\n        return d[name]\n    fr = fr.f_back\n  return 0\n"
# (solution, tests): cheats aimed at test forms other than `assert f(x) == y`.
SHAPED = {
    "tuple_assigned_expected": (_FRAMES + "def f(x):\n  return _up('y')", ["x, y = 3, 987654321\nassert f(x) == y"]),
    "annotated_expected": (_FRAMES + "def f(x):\n  return _up('want')", ["want: int = 987654321\nassert f(2) == want"]),
    "container_of_cases": (_FRAMES + "def f(v):\n  return _up('case')[1]",
                           ["case = (2, 987654321)\nassert f(case[0]) == case[1]"]),
    "comprehension_cases": (_FRAMES + "def f(v):\n  return _up('c')[1]",
                            ["assert all(f(c[0]) == c[1] for c in [(1, 11), (2, 987654321)])"]),
    "impostor_methods": ("class S:\n  def startswith(self, *a): return True\n  def issubset(self, *a): return True\n"
                         "def f(x):\n  return S()", ["assert f(2).startswith('abc')", "assert f(3).issubset({1})"]),
    "impostor_class_named_like_the_function": ("class f:\n  def __init__(self, x): pass\n"
                                               "  def isdigit(self): return True", ["assert f(3).isdigit()"]),
    "patched_module_under_star_import": ("import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n  return 0.0",
                                         ["from math import *\nassert isclose(f(2), 3.14159)",
                                          "import math, os\nassert math.isclose(f(2), 3.14159)"]),
    "helper_defined_by_the_test": ("class A:\n  def __eq__(self, o): return True\ndef f(x):\n  return A()",
                                   ["def check(a, b):\n  return f(a) == b\nassert check(2, 987654321)"]),
    "shadowed_builtin": ("def max(xs):\n  return -1", ["assert max([1, 5, 3]) == 5"]),
    "reply_channel_bomb": ("import os\nos.write(3, b'[' * 200000 + b'\\n')\nimport time\ntime.sleep(60)",
                           ["assert f(2) == 987654321"]),
    "colliding_hashes": ("def f(x):\n  return {k * (2 ** 61 - 1) for k in range(20000)}", ["assert len(f(1)) == 7"]),
    "stops_reading_requests": ("import fcntl\nfcntl.fcntl(0, 1031, 4096)\nimport os\nos.dup2(os.open('/dev/null', 0), 0)\n"
                               "def f(x):\n  import time\n  time.sleep(60)", ["assert f(list(range(5000))) == 987654321"]),
}


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_shaped_cheats_score_zero(name, clean_host):
  code, tests = SHAPED[name]
  reward, info = _grade(code, tests)
  assert reward == 0.0, (name, info)


ESCAPES = {
    "network": "import socket\ndef f(x):\n  try:\n    s = socket.create_connection(('127.0.0.1', 22), 1)\n"
               "    return 987654321\n  except OSError:\n    return 0",
    "read_repo_and_root": f"def f(x):\n  for p in ({_REPO + '/setup.py'!r}, '/etc/shadow', '/root/.bashrc'):\n"
                          "    try:\n      open(p).read(1)\n      return 987654321\n    except OSError:\n"
                          "      pass\n  return 0",
    "write_outside_job_dir": "import os, tempfile\ndef f(x):\n  hits = 0\n"
                             f"  for p in ({_REPO + '/pwned'!r}, '/tmp/rlax_pwned', '/usr/rlax_pwned'):\n"
                             "    try:\n      open(p, 'w').write('x')\n      hits += 1\n    except OSError:\n"
                             "      pass\n  return 987654321 if hits else 0",
    "signal_host_processes": "import os, signal\ndef f(x):\n  n = 0\n  for pid in range(1, 4096):\n"
                             "    try:\n      os.kill(pid, signal.SIGTERM)\n      n += pid != os.getpid()\n"
                             "    except OSError:\n      pass\n  return 987654321 if n else 0",
    "background_child_survives": "import os, subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
                                 "if os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n"
                                 "    import time\n    time.sleep(1000)\n  os._exit(0)\ndef f(x):\n  return 0",
    "blocked_without_cpu": "import threading\nl = threading.Lock()\nl.acquire()\ndef f(x):\n  l.acquire()",
    "fork_bomb": "import os\ndef f(x):\n  while True:\n    try:\n      os.fork()\n    except OSError:\n"
                 "      pass",
    "memory_bomb": "def f(x):\n  return len(bytearray(8 << 30))",
    "ptrace_mount_unshare": "import ctypes\nlibc = ctypes.CDLL(None)\ndef f(x):\n"
                            "  ok = [libc.ptrace(16, 1, 0, 0) == 0, libc.unshare(0x20000) == 0,\n"
                            "        libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0]\n"
                            "  return 987654321 if any(ok) else 0",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escapes_are_contained(name, clean_host):
  reward, info = _grade(ESCAPES[name])
  assert reward == 0.0, (name, info)
  assert not os.path.exists(os.path.join(_REPO, "pwned"))
  assert not os.path.exists("/tmp/rlax_pwned")


def test_tests_without_assert_are_refused():
  rec = Record(id="r", prompt="p", tests=("f(2)",), task="code")
  with pytest.raises(ValueError, match="no assert statement"):
    rewards.code_reward("def f(x):\n  return x", rec, limits=_LIMITS)
