"""Preemption of multi-turn episodes: the tool-result journal replays finished calls; a run SIGKILLed in the
middle of an episode resumes without running a finished tool call again, and in deterministic mode ends with
the uninterrupted run's parameters, bitwise."""

import asyncio
import json
import os
import subprocess
import sys

from rlax import envs, rewards
from rlax.envs import renderers, tools

import journal_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_journal_replays_a_turn_with_the_same_calls(tmp_path):
  path = str(tmp_path / "j.jsonl")
  j = envs.ToolJournal(path)
  j.put((0, 1, 2, 3, 0), ["a"], [["out", "ok"]])
  j.put((0, 1, 2, 3, 1), ["b"], [["x", "timeout"]])
  j.close()
  with open(path, "a") as f:
    f.write('{"key": [0, 1, 2, 3, 2], "calls": ["c"], "res')  # torn by a kill
  again = envs.ToolJournal(path)
  assert len(again) == 2
  assert again.get((0, 1, 2, 3, 0), ["a"]) == [["out", "ok"]]
  assert again.get((0, 1, 2, 3, 0), ["other"]) is None  # a different turn under the same key runs again
  assert again.get((0, 1, 2, 3, 2), ["c"]) is None and again.replayed == 1


def test_a_bound_journal_replays_only_under_its_tool_configuration(tmp_path):
  calc = tools.Tool.from_function(tools.calculator)
  j = envs.ToolJournal(str(tmp_path / "j.jsonl"))
  j.bind([calc], True, 100, 5.0).put((0, 1, 2, 3, 0), ["a"], [["7", "ok"]])
  assert j.bind([calc], True, 100, 5.0).get((0, 1, 2, 3, 0), ["a"]) == [["7", "ok"]]
  for other in (j.bind([calc], False, 100, 5.0), j.bind([calc], True, 50, 5.0), j.bind([calc], True, 100, 1.0),
                j.bind([tools.Tool.from_function(journal_env.note)], True, 100, 5.0), j):
    assert other.get((0, 1, 2, 3, 0), ["a"]) is None
  assert j.foreign == 5 and j.replayed == 1


def test_tool_runner_replays_journaled_calls(tmp_path, monkeypatch):
  log = tmp_path / "calls.log"
  monkeypatch.setenv(journal_env.LOG, str(log))
  calls = [renderers.ToolCall("note", {"key": "k1"}), renderers.ToolCall("nope", {})]
  with rewards.VerifierPool(num_workers=1, timeout_s=5) as pool:
    out = []
    for _ in range(2):  # the second runner is a resumed process: a new journal object on the same file
      runner = tools.ToolRunner(pool, [tools.Tool.from_function(journal_env.note)],
                                journal=envs.ToolJournal(str(tmp_path / "j.jsonl")))
      out.append(asyncio.run(runner.run(calls, key=(0, 5, 1, 0, 1))))
    assert asyncio.run(runner.run(calls[:1]))[0].outcome == "ok"  # no key: not journaled, runs
  assert out[0] == out[1] == [tools.ToolResult("2", "ok"), out[0][1]] and out[0][1].outcome == "unknown_tool"
  assert log.read_text().splitlines() == ["k1", "k1"]  # once under the key, once without one


def _run(workdir, log, kill=None):
  env = dict(os.environ, **{journal_env.LOG: str(log), "PYTHONPATH": os.pathsep.join(
      [ROOT, os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])})
  env.pop(journal_env.KILL, None)
  if kill is not None:
    env[journal_env.KILL] = str(kill)
  args = [sys.executable, "-m", "launch.main", "--config=configs/demo.py:tiny", f"--config.workdir={workdir}",
          "--config.env.name=journal_env:Noting", "--config.rollout.max_new_tokens=16", "--config.deterministic=True",
          "--config.controller.steps=4", "--config.checkpoint.every_steps=1", "--noprogress", "--compilation_cache="]
  return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_sigkill_mid_episode_resumes_without_rerunning_tools_bitwise(tmp_path):
  ref = _run(tmp_path / "ref", tmp_path / "ref.log")
  assert ref.returncode == 0, ref.stderr[-3000:]
  killed = _run(tmp_path / "run", tmp_path / "run.log", kill=2)
  assert killed.returncode == -9, killed.stderr[-3000:]
  keys = lambda lines: [tuple(json.loads(c)) for c in lines if c != "null"]  # eval's calls carry no key
  before = keys((tmp_path / "run.log").read_text().splitlines())
  with open(tmp_path / "run" / "tool_journal.jsonl") as f:
    finished = {tuple(json.loads(line)["key"]) for line in f if line.strip()}
  assert any(k[1] == 2 for k in finished)  # the kill came mid-batch of step 2, some of its calls journaled
  resumed = _run(tmp_path / "run", tmp_path / "run.log")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  after = keys((tmp_path / "run.log").read_text().splitlines())[len(before):]
  assert not finished & set(after), "a finished (journaled) tool call ran again"
  # Calls in flight at the kill (run, not yet journaled) are the only ones that ran twice.
  assert set(before) & set(after) <= set(before) - finished
  assert set(before) | set(after) == set(keys((tmp_path / "ref.log").read_text().splitlines()))
  got, want = json.loads(resumed.stdout.splitlines()[-1]), json.loads(ref.stdout.splitlines()[-1])
  assert got["params_sha256"] == want["params_sha256"]
  with open(tmp_path / "run" / "tool_journal.jsonl") as f:
    steps = {json.loads(line)["key"][1] for line in f if line.strip()}
  assert steps and min(steps) >= 1  # pruned at each checkpoint to the oldest one kept (3 of steps 0..4)
