"""launch.fault_inject's accounting, without flags (importable by tests): a faulted run's logs → fault rows."""

import json
import os


def metric_rows(workdir):
  """The run's metrics.jsonl rows (one per trained step)."""
  path = os.path.join(workdir, "logs", "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(x) for x in f if x.strip()]


def events(workdir, kind=None):
  """failover.jsonl events, optionally only those of one `event` kind."""
  path = os.path.join(workdir, "failover.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    logged = [json.loads(x) for x in f if x.strip()]
  return [e for e in logged if kind is None or e["event"] == kind]


def slice_rows(run_dir, resumed_of_pid):
  """A row per injected slice fault: recovered in-process, or carried across a restart, or lost (the truth)."""
  logged, rows = events(run_dir), []
  metric_times = sorted(r["time"] for r in metric_rows(run_dir))
  for i, e in enumerate(logged):
    if e["event"] != "injected":
      continue
    sl, gone = e["slice"], e["kind"] == "lose"
    name = f"slice_{'loss' if gone else 'return'} [{sl}]"
    handled = None
    for later in logged[i + 1:]:
      if later["event"] == "recovered" and sl in later["lost" if gone else "returned"]:
        handled = later
        break
      if later["event"] == "restart" and (sl in later["missing"]) == gone:
        handled = later
        break
    if handled is None:
      rows.append({"kind": f"{name} (injected, never recovered)", "step": e["step"], "lost": 0,
                   "recovery_s": float("nan"), "survived": False})
    elif handled["event"] == "recovered":
      rows.append({"kind": f"{name} (trainer {handled['trainer']}, sampler {handled['sampler']})",
                   "step": e["step"], "lost": handled["steps_lost"], "recovery_s": handled["recovery_s"],
                   "survived": True})
    else:  # the process died inside the recovery; the next one started without the slice
      kills = [k for k in logged[i + 1:logged.index(handled)] if k["event"] == "killed"]
      how = f"killed in phase {kills[-1]['phase']}" if kills else "process killed"
      later = [t for t in metric_times if t > handled["time"]]
      rows.append({"kind": f"{name} (recovery interrupted: {how}; restarted with trainer {handled['trainer']}, "
                           f"sampler {handled['sampler']})",
                   "step": e["step"], "lost": e["step"] - resumed_of_pid[handled["pid"]],
                   "recovery_s": (later[0] if later else handled["time"]) - e["time"], "survived": True})
  return rows
