"""Verifier pool: order kept, none lost, crashes and hangs give 0 and never stall the pool.

Hostile completions (math bombs, signals, memory) are in test_pool_hostile.py."""

import threading
import time

import pytest

from rlax import rewards
from rlax.data import synthetic
from rlax.data.records import Record
from rlax.rewards import sandbox


def _arith(i):
  return Record(id=f"a{i}", prompt="p", answer=str(i), task="arithmetic")


def test_thousand_concurrent_gradings_in_order_none_lost():
  programs = synthetic.program(8, difficulty=2, seed=3)
  recs, comps, expected = [], [], []
  for i in range(1000):
    recs.append(_arith(i))
    comps.append(f"<answer>{i if i % 3 else i + 1}</answer>")
    expected.append(0.0 if i % 3 == 0 else 1.0)
  for j, p in enumerate(programs):  # a few real code gradings mixed in
    at = 100 * j + 50
    good = j % 2 == 0
    recs.insert(at, p)
    comps.insert(at, f"```python\n{p.metadata['solution']}```" if good else "def f(*a):\n  return 'no'")
    expected.insert(at, 1.0 if good else 0.0)
  with rewards.VerifierPool(num_workers=8, timeout_s=30) as pool:
    start = time.monotonic()
    out = pool.grade(rewards.get("auto"), comps, recs)
    elapsed = time.monotonic() - start
  assert len(out) == 1008
  assert [r for r, _ in out] == expected
  assert pool.completed == 1008 and pool.errors == 0 and pool.abandoned == 0
  assert elapsed < 60


def test_crash_and_hang_give_zero_and_pool_keeps_serving():
  def crash(c, r):
    raise RuntimeError("grader bug")

  def hang(c, r):
    time.sleep(3)
    return 1.0, {}

  ok = rewards.get("arithmetic")
  with rewards.VerifierPool(num_workers=2, timeout_s=0.3) as pool:
    pool.grade(ok, ["<answer>1</answer>"] * 2, [_arith(1)] * 2)  # workers started (not timed)
    fns = [ok, crash, hang, ok, hang, hang, ok, ok]
    recs = [_arith(i) for i in range(len(fns))]
    comps = [f"<answer>{i}</answer>" for i in range(len(fns))]
    start = time.monotonic()
    out = pool.grade(fns, comps, recs)
    assert time.monotonic() - start < 2.5  # three hangs on two workers would take >= 6 s
    assert [r for r, _ in out] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert "grader error: RuntimeError" in out[1][1]["reason"]
    assert out[2][1]["timeout"] and pool.abandoned == 3 and pool.errors == 1
    again = pool.grade(ok, ["<answer>5</answer>"] * 20, [_arith(5)] * 20)
    assert [r for r, _ in again] == [1.0] * 20


def test_hostile_code_through_pool_then_normal_service():
  rec = Record(id="c", prompt="p", tests=("assert f(3) == 9",), task="code")
  hostile = ["while True: pass", "import os\nos.kill(os.getppid(), 9)", "x = bytearray(1 << 34)",
             "import sys\nwhile True: sys.stdout.write('y' * 65536)", "import os\nwhile True: os.fork()"]
  good = "def f(x):\n  return x * x\n"
  fn = rewards.make_code_reward(wall_s=1.5)
  with rewards.VerifierPool(num_workers=4, timeout_s=10) as pool:
    out = pool.grade(fn, hostile + [good], [rec] * 6)
    assert [r for r, _ in out] == [0.0] * 5 + [1.0]
    assert all(info["reason"] for _, info in out[:5])
    assert [r for r, _ in pool.grade(fn, [good] * 4, [rec] * 4)] == [1.0] * 4


def test_batches_from_several_threads():
  results = {}
  with rewards.VerifierPool(num_workers=4) as pool:
    def client(k):
      recs = [_arith(k * 1000 + i) for i in range(100)]
      results[k] = pool.submit(rewards.get("exact"), [f"{r.answer}" for r in recs], recs).results()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  assert all(len(v) == 100 and all(r == 1.0 for r, _ in v) for v in results.values())


def _isolation(completion, record):
  return 1.0, {"mode": sandbox.isolation_mode()}


def test_the_sandbox_mode_reaches_every_worker():
  with pytest.raises(ValueError, match="sandbox='none'"):
    rewards.VerifierPool(num_workers=1, sandbox="none")
  with rewards.VerifierPool(num_workers=2, sandbox="unsafe") as pool:
    assert [info["mode"] for _, info in pool.grade(_isolation, ["x"] * 4, [None] * 4)] == ["unsafe"] * 4
  with rewards.VerifierPool(num_workers=1) as pool:  # "auto": the jail, or a refusal in one line
    (_, info), = pool.grade(_isolation, ["x"], [None])
    assert info.get("mode") == "jail" or "reward.sandbox=unsafe" in info["reason"]
