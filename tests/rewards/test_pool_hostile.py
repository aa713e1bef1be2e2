"""Hostile completions through the verifier pool: every grading returns within its deadline, the pool
keeps serving, and the controller stays responsive (signals) and leaves no process behind."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlax import rewards
from rlax.data.records import Record

# What a policy can write by itself; each of these froze the thread-based pool for minutes.
MATH_BOMBS = [r"\boxed{9^{9^{9^{9}}}}", "<answer>10^{10^{10}}</answer>",
              r"\boxed{" + r"\frac{1}{" * 2000 + "2" + "}" * 2000 + "}"]
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rec(answer="1"):
  return Record(id="m", prompt="p", answer=answer, task="math")


def _warm(pool):
  assert pool.grade(rewards.math_reward, [r"\boxed{1}"], [_rec()])[0][0] == 1.0


def _gone(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] == "Z"  # a zombie is dead, only not yet reaped
  except FileNotFoundError:
    return True


def test_math_bombs_time_out_and_the_pool_keeps_serving():
  with rewards.VerifierPool(num_workers=2, timeout_s=2) as pool:
    _warm(pool)
    comps = MATH_BOMBS + ["1" * (10 << 20), r"\boxed{1}", r"\boxed{2}"]
    start = time.monotonic()
    out = pool.grade(rewards.math_reward, comps, [_rec()] * len(comps))
    elapsed = time.monotonic() - start
    assert elapsed < 9, elapsed  # three 2 s deadlines on two workers, plus replacements
    assert [info.get("timeout", False) for _, info in out[:3]] == [True] * 3
    assert out[3][1]["too_long"]  # 10 MB of digits is refused, not parsed
    assert [r for r, _ in out] == [0.0] * 4 + [1.0, 0.0]
    assert pool.abandoned == 3
    again = pool.grade(rewards.math_reward, [r"\boxed{1}"] * 8, [_rec()] * 8)
    assert [r for r, _ in again] == [1.0] * 8


def test_hundred_hung_graders_never_exhaust_the_pool():
  def hang(c, r):
    time.sleep(60)
    return 1.0, {}

  ok = rewards.get("exact")
  with rewards.VerifierPool(num_workers=4, timeout_s=0.2) as pool:
    _warm(pool)
    start = time.monotonic()
    out = pool.grade([hang] * 100 + [ok], ["<answer>x</answer>"] * 101, [_rec("x")] * 101)
    assert time.monotonic() - start < 30  # 100 x 0.2 s on 4 workers, plus replacements
    assert [r for r, _ in out] == [0.0] * 100 + [1.0] and pool.abandoned == 100
    again = pool.grade(ok, ["<answer>x</answer>"] * 8, [_rec("x")] * 8)
    assert [r for r, _ in again] == [1.0] * 8
    assert len(pool.worker_pids) == 4


def test_memory_cap_and_length_cap():
  def hog(c, r):
    return float(len(bytearray(2 << 30))), {}

  with rewards.VerifierPool(num_workers=1, timeout_s=20, memory_mb=512, max_chars=1000) as pool:
    out = pool.grade([hog, rewards.math_reward, rewards.math_reward],
                     ["x", r"\boxed{1}", r"\boxed{1}" + " " * 1000], [_rec()] * 3)
    assert out[0][0] == 0.0 and "memory cap" in out[0][1]["reason"]
    assert out[1][0] == 1.0  # a fresh worker replaced the one that ran out of memory
    assert out[2][1]["reason"] == "completion too long: 1009 chars > 1000"


def test_lambdas_closures_and_unpicklable_functions():
  lock = threading.Lock()

  def needs_lock(c, r):  # a lock pickles neither way: refused, or graded in a thread under the opt-in
    with lock:
      return 0.5, {"c": c}

  offset = 2.0
  with rewards.VerifierPool(num_workers=2, timeout_s=5) as pool:
    out = pool.grade([lambda c, r: (offset + len(c), {}), rewards.build("math")], ["ab", r"\boxed{1}"],
                     [_rec()] * 2)
    assert [r for r, _ in out] == [4.0, 1.0]
    with pytest.raises(ValueError, match=r"^reward function .*needs_lock cannot be sent to a grading process "
                                         r"\(TypeError: cannot pickle '_thread.lock' object\).*in_process=True"):
      pool.submit(needs_lock, ["cd"], [_rec()])
    assert pool.grade(needs_lock, ["cd"], [_rec()], in_process=True) == [(0.5, {"c": "cd"})]
  with rewards.VerifierPool(num_workers=1, timeout_s=5, in_process=True) as pool:
    assert pool.grade(needs_lock, ["cd"], [_rec()]) == [(0.5, {"c": "cd"})]


_CHILD = textwrap.dedent("""
    import signal, sys, threading, time
    from rlax import rewards
    from rlax.data.records import Record

    def on_term(signum, frame):
      print("terminated", flush=True)
      sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    pool = rewards.VerifierPool(num_workers=2, timeout_s=600)
    rec = Record(id="m", prompt="p", answer="1")
    assert pool.grade(rewards.math_reward, [r"\\boxed{1}"], [rec])[0][0] == 1.0
    while len(pool.worker_pids) < 2:  # the second worker may still be starting
      time.sleep(0.05)
    print(" ".join(map(str, pool.worker_pids)), flush=True)
    # Graded from another thread, as the rollout producer does.
    threading.Thread(target=pool.grade, args=(rewards.math_reward, [sys.argv[1]] * 2, [rec] * 2),
                     daemon=True).start()
    time.sleep(1)
    print("grading", flush=True)
    time.sleep(120)  # the test signals us long before; this only bounds an orphan's life
""")


def _start_child(completion):
  proc = subprocess.Popen([sys.executable, "-c", _CHILD, completion], cwd=_REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
  try:
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and proc.stdout.readline() == "grading\n"
  except BaseException:
    proc.kill()
    raise
  return proc, pids


@pytest.mark.parametrize("completion", MATH_BOMBS[:2])
def test_sigterm_is_honoured_while_a_bomb_is_graded(completion):
  proc, pids = _start_child(completion)
  start = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  try:
    assert proc.stdout.readline() == "terminated\n"
    proc.wait(timeout=10)
  finally:
    proc.kill()
  assert time.monotonic() - start < 5
  deadline = time.monotonic() + 10
  while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert all(_gone(p) for p in pids)


def test_workers_die_with_a_killed_controller():
  proc, pids = _start_child(MATH_BOMBS[0])
  proc.kill()
  proc.wait()
  deadline = time.monotonic() + 10
  while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert all(_gone(p) for p in pids)


def test_close_does_not_wait_for_queued_or_running_bombs():
  pool = rewards.VerifierPool(num_workers=2, timeout_s=60)
  _warm(pool)
  batch = pool.submit(rewards.math_reward, MATH_BOMBS[:2] * 4, [_rec()] * 8)
  time.sleep(0.5)
  pids = pool.worker_pids
  start = time.monotonic()
  pool.close()
  assert time.monotonic() - start < 5
  assert batch.done() and all(r == 0.0 and info["error"] for r, info in batch.results())
  deadline = time.monotonic() + 10
  while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert all(_gone(p) for p in pids)
