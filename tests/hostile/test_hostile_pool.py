"""Hostile graders and tools against the verifier pool's public entry points (`VerifierPool`, `ToolRunner`):
a job that blocks, spawns, double-forks, signals its group or its parent, is SIGKILLed from outside, bombs
memory or floods output gets reward 0 or a counted error outcome; its whole process tree dies with it; nothing
reaches the test process; and the pool grades the next item right. Each case runs under `clean_host`, which
also checks the whole process table, TMPDIR and the signals delivered afterwards.
"""

import asyncio
import os
import signal
import threading
import time

import psutil
import pytest

import hostile_fns as H
from rlax import rewards
from rlax.data.records import Record
from rlax.envs import renderers, tools
from rlax.rewards import pool as pool_lib


def _pool(**kw):
  kw = {"num_workers": 1, "timeout_s": 1.0, **kw}
  return rewards.VerifierPool(**kw)


def _still_serving(pool):
  assert pool.grade(H.ok, ["right", "wrong"], [None] * 2) == [(1.0, {"graded": "right"}), (0.0, {"graded": "wrong"})]


def _gone(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return True


def _tree(pid: int) -> list[int]:
  try:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]
  except psutil.NoSuchProcess:
    return []


def _workers(pool, n: int = 1) -> list[int]:
  """The pool's worker pids once `n` have started (they start in the pool's threads)."""
  end = time.monotonic() + 30
  while len(pool.worker_pids) < n:
    assert time.monotonic() < end, "the workers never started"
    time.sleep(0.02)
  return pool.worker_pids


def _wait_for_tree(pid: int, n: int) -> list[int]:
  """The worker's descendants once it has `n` of them (its job is under way)."""
  end = time.monotonic() + 5
  while len(_tree(pid)) < n:
    assert time.monotonic() < end, "the job never started its children"
    time.sleep(0.02)
  return _tree(pid)


def _calls(runner, *calls):
  return asyncio.run(runner.run([renderers.ToolCall(n, a) for n, a in calls]))


@pytest.mark.parametrize("fn", [H.sleep_long, H.lock_twice, H.read_empty_pipe])
def test_a_grader_that_blocks_is_killed_at_its_deadline(clean_host, fn):
  with _pool(timeout_s=0.5) as pool:
    _still_serving(pool)
    start = time.monotonic()
    (reward, info), = pool.grade(fn, ["x"], [None])
    assert reward == 0.0 and info["timeout"] and time.monotonic() - start < 2
    _still_serving(pool)


@pytest.mark.parametrize("fn,key", [(H.background_child, "child"), (H.double_fork, "grandchild")])
def test_what_a_job_leaves_running_dies_when_it_returns(clean_host, fn, key):
  with _pool() as pool:
    (reward, info), = pool.grade(fn, ["x"], [None])
    assert reward == 1.0 and _gone(info[key])  # killed by the worker before the result was sent
    assert _tree(_workers(pool)[0]) == []
    _still_serving(pool)


@pytest.mark.parametrize("fn", [H.killpg_zero, H.kill_zero])
def test_signalling_its_own_group_never_reaches_the_controller(clean_host, fn):
  with _pool() as pool:
    (reward, info), = pool.grade(fn, ["x"], [None])
    assert reward == 0.0 and "died" in info["reason"]  # the worker's own group: only it got the signal
    _still_serving(pool)
  assert clean_host.signals == []


def test_killing_the_fork_server_is_survived(clean_host):
  with _pool(num_workers=2) as pool:
    _still_serving(pool)
    (reward, info), = pool.grade(H.kill_parent, ["x"], [None])
    assert reward == 0.0 and info["error"]
    _still_serving(pool)
    assert pool.grade(H.ok, ["right"] * 4, [None] * 4) == [(1.0, {"graded": "right"})] * 4


def test_sigkill_of_the_worker_mid_job_leaves_no_grandchildren(clean_host):
  with _pool(timeout_s=20) as pool:
    batch = pool.submit(H.children_then_block, ["x"], [None])
    worker, = _workers(pool)
    kids = _wait_for_tree(worker, 2)  # one in the worker's group, one in a session of its own
    os.kill(worker, signal.SIGKILL)
    (reward, info), = batch.results()
    assert reward == 0.0 and "died" in info["reason"]
    assert all(_gone(p) for p in kids)
    _still_serving(pool)
    assert pool.worker_pids != [worker]


def test_sigkill_of_the_worker_mid_code_grading(clean_host):
  rec = Record(id="c", prompt="p", tests=("assert f(3) == 9",), task="code")
  with _pool(timeout_s=30) as pool:
    batch = pool.submit(rewards.code_reward, ["import time\ntime.sleep(100)"], [rec])
    worker, = _workers(pool)
    kids = _wait_for_tree(worker, 1)  # the sandbox's job
    os.kill(worker, signal.SIGKILL)
    assert batch.results()[0][0] == 0.0
    # The jailed job is SIGKILLed before the result, but its exit can lag it on a loaded host (the pool's sweep
    # waits up to 5 s: seen once in a full suite on 2 cores): it must be gone soon after, not left running.
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in kids) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert all(_gone(p) for p in kids)
    assert pool.grade(rewards.code_reward, ["def f(x):\n  return x * x"], [rec])[0][0] == 1.0


def test_close_with_jobs_in_flight_leaves_nothing(clean_host):
  pool = _pool(num_workers=2, timeout_s=60)
  batch = pool.submit(H.children_then_block, ["x"] * 3, [None] * 3)
  kids = [p for w in _workers(pool, 2) for p in _wait_for_tree(w, 2)]
  start = time.monotonic()
  pool.close()
  assert time.monotonic() - start < 5
  assert all(r == 0.0 and info["error"] for r, info in batch.results())
  assert all(_gone(p) for p in kids)


def test_a_memory_bomb_hits_the_cap(clean_host):
  with _pool(memory_mb=256, timeout_s=5) as pool:
    (reward, info), = pool.grade(H.memory_bomb, ["x"], [None])
    assert reward == 0.0 and info["memory_cap"] and "256 MB memory cap" in info["reason"]
    _still_serving(pool)


def test_results_cross_as_bounded_json(clean_host):
  with _pool(timeout_s=5) as pool:
    (reward, info), = pool.grade(H.huge_info, ["x"], [None])  # 40 MB of info: refused in the worker
    assert reward == 0.0 and "over the 16 MB limit" in info["reason"]
    (reward, info), = pool.grade(H.odd_info, ["x"], [None])
    assert reward == 0.5 and info["set"] == "{1}" and info["bytes"] == "b'\\x00'" and info["3"] == "int key"
    assert info["odd"] == "<_Odd without a repr>" and info["nested"] == [[1, 2.5]]
    assert info["obj"].startswith("<object object") and info["big"] == "<int of 16610 bits>" and info["np"] == 0.25
    (reward, info), = pool.grade(H.bad_reward, ["x"], [None])
    assert reward == 0.0 and "no float" in info["reason"]
    _still_serving(pool)


def test_hostile_tools_become_counted_outcomes(clean_host):
  ts = [tools.Tool.from_function(f) for f in (H.nap, H.spawn, H.flood, H.opaque, H.group_kill, H.echo)]
  with _pool(num_workers=2, timeout_s=1.0, memory_mb=512) as pool:
    runner = tools.ToolRunner(pool, ts, timeout_s=0.5, output_chars=100)
    res = _calls(runner, ("nap", {"seconds": 1000.0}), ("spawn", {"n": 2}), ("flood", {"mb": 50}),
                 ("opaque", {"n": 1}), ("group_kill", {"n": 1}), ("echo", {"text": "hi"}))
    assert [r.outcome for r in res] == ["timeout", "ok", "truncated", "ok", "tool_error", "ok"]
    assert "did not finish within 0.5s" in res[0].output and res[2].output == "y" * 100
    assert res[3].output.startswith("{frozenset({1}): <object object") and "died" in res[4].output
    assert _calls(runner, ("echo", {"text": "again"}))[0] == tools.ToolResult("again", "ok")
  assert clean_host.signals == []


def test_tool_arguments_longer_than_max_chars_are_bad_arguments(clean_host):
  with _pool(max_chars=100) as pool:
    runner = tools.ToolRunner(pool, [tools.Tool.from_function(H.echo)])
    long, short = _calls(runner, ("echo", {"text": "z" * 500}), ("echo", {"text": "z"}))
    assert long.outcome == "bad_arguments" and "too long" in long.output and "> 100" in long.output
    assert short == tools.ToolResult("z", "ok")
    assert _calls(runner, ("echo", [1]))[0].outcome == "bad_arguments"  # not an object: never a crash


def test_an_unpicklable_tool_is_refused_with_one_line(clean_host):
  lock = threading.Lock()

  def locked(text: str) -> str:
    """Needs a lock, which cannot be pickled."""
    with lock:
      return text.upper()

  with _pool() as pool:
    with pytest.raises(ValueError) as e:
      tools.ToolRunner(pool, [tools.Tool.from_function(locked)])
    assert "\n" not in str(e.value) and str(e.value).startswith("tool 'locked' cannot be sent to a grading process")
    assert "in_process=True" in str(e.value)
    with pytest.raises(ValueError, match="^reward function .*locked cannot be sent"):
      pool.submit(locked, ["x"], [None])  # as a reward function: refused at submit
    runner = tools.ToolRunner(pool, [tools.Tool.from_function(locked)], in_process=True)  # the opt-in
    assert _calls(runner, ("locked", {"text": "ab"}))[0] == tools.ToolResult("AB", "ok")


def test_the_sandbox_ends_its_job_before_the_pool_deadline(clean_host):
  """The deadline rule: a grading that runs the sandbox gets its wall clock plus the margin, so a solution
  that blocks without burning CPU is stopped by the sandbox (status 'timeout'), never left running."""
  code_1s = rewards.make_code_reward(wall_s=1.0)
  assert pool_lib.sandbox_wall_s(code_1s) == 1.0 and pool_lib.sandbox_wall_s(H.ok) == 0.0
  assert pool_lib.sandbox_wall_s(rewards.build("auto", format_weight=0.1)) == rewards.SandboxLimits().wall_s
  assert pool_lib.sandbox_wall_s(rewards.combine({"code": 1, "format": 1})) == rewards.SandboxLimits().wall_s
  assert pool_lib.sandbox_wall_s(tools.python) == tools.PYTHON_LIMITS.wall_s
  assert pool_lib.grading_deadline(0.5, 1.0, 2.0) == 3.0 and pool_lib.grading_deadline(0.5, 0.0, 2.0) == 0.5
  rec = Record(id="c", prompt="p", tests=("assert f(3) == 9",), task="code")
  blockers = ["import threading\nl = threading.Lock()\nl.acquire()\nl.acquire()",
              "import os\nr, w = os.pipe()\nos.read(r, 1)", "import time\ntime.sleep(100)"]
  with _pool(num_workers=2, timeout_s=0.5, job_margin_s=2.0) as pool:
    out = pool.grade(code_1s, blockers + ["def f(x):\n  return x * x"], [rec] * 4)
    assert [r for r, _ in out] == [0.0, 0.0, 0.0, 1.0]
    assert all(info["status"] == "timeout" and not info.get("timeout") for _, info in out[:3]), out
    assert pool.abandoned == 0


def test_a_sandbox_the_pool_cannot_see_still_ends_before_the_pool_deadline(clean_host):
  """Limits made inside the reward (invisible to sandbox_wall_s): the worker hands each job its deadline, and
  the sandbox ends JOB_MARGIN_S before it."""
  assert pool_lib.sandbox_wall_s(H.hidden_code) == 0.0
  rec = Record(id="c", prompt="p", tests=("assert f(3) == 9",), task="code")
  with _pool(num_workers=1, timeout_s=3.0) as pool:
    (reward, info), = pool.grade(H.hidden_code, ["import time\ntime.sleep(100)"], [rec])
    assert reward == 0.0 and info["status"] == "timeout" and not info.get("timeout"), info
    assert info["wall_s"] < 1.5 and pool.abandoned == 0


def test_the_python_tool_runs_policy_code_in_the_sandbox(clean_host):
  with _pool(num_workers=2) as pool:
    runner = tools.ToolRunner(pool, [tools.Tool.from_function(tools.python)], timeout_s=1.0)
    ok, bad, hang = _calls(runner, ("python", {"code": "print(6 * 7)"}), ("python", {"code": "1 / 0"}),
                           ("python", {"code": "import time\ntime.sleep(100)"}))
    assert ok == tools.ToolResult("42\n", "ok")
    assert bad.outcome == "ok" and "ZeroDivisionError" in bad.output and "[error after" in bad.output
    assert hang.outcome == "ok" and "[timeout after" in hang.output  # the sandbox's wall, inside the deadline
