"""Fault injection: run a shrunk deterministic demo through kills, a SIGTERM, slice losses and a corrupt checkpoint.

  python -m launch.fault_inject --steps=24 --kills=5 --fault_seed=0

The faulted run is a chain of `python -m launch.main` processes in one workdir: SIGKILLs at seeded random
steps (plus a random delay inside the step), one SIGTERM (checkpoint and exit), a truncated file in the
newest checkpoint between two restarts, and, in-process, the loss of a sampler slice and of a trainer slice
(`faults.lose_slice_at`, fired by rlax.runtime.failover). An uninterrupted run of the same config runs alongside;
both write `params_sha256` to summary.json. One table row per fault; the last line is one JSON object.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

from absl import app, flags

from launch.flags_util import define_workdir, parse_or_exit

STEPS = flags.DEFINE_integer("steps", 24, "RL steps of the shrunk demo.")
KILLS = flags.DEFINE_integer("kills", 5, "SIGKILLs to inject (>= 5 asked by the issue).")
FAULT_SEED = flags.DEFINE_integer("fault_seed", 0, "Seed for kill steps and delays (not the run's config.seed).")
WORKDIR = define_workdir("/tmp/rlax_fault_inject", "Parent of the ref/ and faulted/ workdirs.")
EVERY = flags.DEFINE_integer("ckpt_every", 3, "Checkpoint period in steps.")


def _cmd(workdir, extra=()):
  c = "--config."
  return [sys.executable, "-m", "launch.main", "--config=configs/demo.py", "--progress=false",
          f"{c}workdir={workdir}", f"{c}controller.steps={STEPS.value}", f"{c}deterministic=True",
          f"{c}controller.max_staleness=1", f"{c}checkpoint.every_steps={EVERY.value}", f"{c}checkpoint.keep=3",
          f"{c}init.sft_steps=5", f"{c}data.n_eval=16", f"{c}eval.n_samples=2", *extra]


def _rows(workdir):
  path = os.path.join(workdir, "logs", "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(x) for x in f if x.strip()]


def _start(workdir, extra, n):
  log = open(os.path.join(os.path.dirname(workdir), f"proc{n}.log"), "w")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(workdir), "jax_cache"))
  return subprocess.Popen(_cmd(workdir, extra), stdout=log, stderr=subprocess.STDOUT, env=env), log.name


def _resumed_step(logfile):
  m = re.findall(r"resumed from checkpoint step (\d+)", open(logfile).read())
  return int(m[0]) if m else 0


def _corrupt_newest(workdir):
  ck = os.path.join(workdir, "checkpoints")
  step = max(int(d) for d in os.listdir(ck) if d.isdigit())
  files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(ck, str(step), "state")) for f in fs]
  victim = max(files, key=os.path.getsize)
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  return step


def main(argv):
  del argv
  rng = random.Random(FAULT_SEED.value)
  n = STEPS.value
  os.makedirs(WORKDIR.value, exist_ok=True)
  ref_dir, run_dir = (os.path.join(WORKDIR.value, d) for d in ("ref", "faulted"))
  subprocess.run(["rm", "-rf", ref_dir, run_dir], check=True)
  lose_s, lose_t = max(2, n // 3), max(4, (2 * n) // 3)  # sampler slice 2, trainer slice 0 (in-process)
  faults = [f"--config.faults.lose_slice_at=2:{lose_s},0:{lose_t}"]
  ref, _ = _start(ref_dir, (), "_ref")
  # Interruptions at increasing steps, away from the slice-fault steps; the SIGTERM sits in the middle.
  plan = ["kill"] * KILLS.value
  plan.insert(len(plan) // 2, "term")
  free = [s for s in range(1, n - 3) if abs(s - lose_s) > 1 and abs(s - lose_t) > 1]
  targets = sorted(rng.sample(free, len(plan)))
  corrupt_after = 1  # truncate the newest checkpoint after the second interruption
  table, n_proc, pending = [], 0, None
  for i, (kind, target) in enumerate(zip(plan, targets)):
    base = len(_rows(run_dir))  # this process's rows come after `base`
    proc, log = _start(run_dir, faults, n_proc)
    n_proc += 1
    if pending:
      pending["log"] = log
    while proc.poll() is None and max((r["step"] for r in _rows(run_dir)[base:]), default=-1) < target:
      time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.5))  # somewhere inside the next step
    if proc.poll() is not None:
      raise SystemExit(f"faulted run exited early (rc {proc.returncode}); see {log}")
    proc.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
    proc.wait()  # a SIGTERM finishes its step and checkpoints first
    t_fault = time.time()
    rows = _rows(run_dir)[base:]
    done = rows[-1]["step"] + 1 if rows else _resumed_step(log)
    pending = {"kind": "sigkill" if kind == "kill" else "sigterm", "step": done, "t": t_fault}
    table.append(pending)
    if i == corrupt_after:
      table.append({"kind": "corrupt_checkpoint", "step": _corrupt_newest(run_dir), "t": time.time()})
  proc, log = _start(run_dir, faults, n_proc)
  pending["log"] = log
  rc = proc.wait()
  ref_rc = ref.wait()
  # Steps lost = work done before the fault minus the step the next process resumed from.
  # (A kill right before the corruption counts the corruption's loss too: its process resumed further back.)
  for k, row in enumerate(table):
    log = table[k - 1]["log"] if row["kind"] == "corrupt_checkpoint" else row["log"]
    row["lost"] = row["step"] - _resumed_step(log)
    row["survived"] = row["kind"] != "corrupt_checkpoint" or "is unreadable" in open(log).read()
    if row["kind"] == "sigterm":
      row["survived"] = row["lost"] == 0  # the checkpoint at the stop holds every finished step
    later = [r["time"] for r in _rows(run_dir) if r["time"] > row["t"]]
    # Kill → the first step trained by the next process (or its summary, if no step was left to train).
    done_at = min(later) if later else os.path.getmtime(os.path.join(run_dir, "summary.json"))
    row["recovery_s"] = done_at - row["t"]
  events = [json.loads(x) for x in open(os.path.join(run_dir, "failover.jsonl"))]
  for e in (e for e in events if e["event"] == "recovered"):
    table.append({"kind": f"slice_loss {e['lost']} (trainer {e['trainer']}, sampler {e['sampler']})",
                  "step": e["step"], "lost": e["steps_lost"], "recovery_s": e["recovery_s"], "survived": True})
  print(f"{'fault':52s} {'step':>5s} {'lost':>5s} {'recovery_s':>10s}")
  for r in table:
    print(f"{r['kind']:52s} {r['step']:5d} {r['lost']:5d} {r['recovery_s']:10.2f}")
  summ = [json.load(open(os.path.join(d, "summary.json"))) for d in (ref_dir, run_dir)]
  injected = len(table) + sum(1 for e in events if e["event"] == "injected") - sum(
      1 for e in events if e["event"] == "recovered")
  print(json.dumps({"faults_injected": injected, "faults_survived": sum(bool(r["survived"]) for r in table),
                    "max_steps_lost": max(r["lost"] for r in table), "params_equal":
                    rc == 0 and ref_rc == 0 and summ[0]["params_sha256"] == summ[1]["params_sha256"],
                    "steps": n, "faulted_steps": summ[1]["steps"], "processes": n_proc + 1,
                    "pass1_ref": summ[0].get("pass1_after"), "pass1_faulted": summ[1].get("pass1_after")}))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
