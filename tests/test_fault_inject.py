"""launch.fault_inject's accounting: every injected slice fault becomes a row saying what happened to it."""

import json

from launch import _fault_rows


def _write(workdir, events, metric_times):
  (workdir / "logs").mkdir(parents=True)
  (workdir / "failover.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
  (workdir / "logs" / "metrics.jsonl").write_text(
      "".join(json.dumps({"step": i, "time": t}) + "\n" for i, t in enumerate(metric_times)))


def test_slice_rows_tell_recovered_interrupted_and_lost_faults_apart(tmp_path):
  inj = lambda sl, step, t: {"event": "injected", "kind": "lose", "slice": sl, "at_step": step, "step": step, "time": t}
  events = [
      inj(2, 8, 100.0),
      {"event": "recovering", "lost": [2], "returned": [], "step": 9, "time": 100.1},
      {"event": "killed", "phase": "build", "signal": "SIGKILL", "step": 9, "pid": 11, "time": 100.2},
      {"event": "restart", "missing": [2], "why": {}, "trainer": [0, 1], "sampler": [3], "pid": 12, "time": 110.0},
      inj(0, 16, 200.0),
      {"event": "recovered", "lost": [0], "returned": [], "trainer": [1, 3], "sampler": [1, 3], "step": 16,
       "steps_lost": 1, "recovery_s": 0.3, "time": 200.3},
      inj(3, 20, 300.0),  # injected, then nothing: the harness must not call it survived
  ]
  _write(tmp_path, events, [90.0, 112.5, 205.0])
  rows = _fault_rows.slice_rows(str(tmp_path), {12: 6})
  assert [r["survived"] for r in rows] == [True, True, False]
  interrupted, recovered, lost = rows
  assert "recovery interrupted: killed in phase build" in interrupted["kind"]
  assert "trainer [0, 1], sampler [3]" in interrupted["kind"]
  assert interrupted["lost"] == 8 - 6 and abs(interrupted["recovery_s"] - 12.5) < 1e-9  # first step after restart
  assert recovered["kind"] == "slice_loss [0] (trainer [1, 3], sampler [1, 3])" and recovered["lost"] == 1
  assert lost["kind"] == "slice_loss [3] (injected, never recovered)"
