"""Fault injection: run a shrunk deterministic demo through kills, a SIGTERM, slice losses and a corrupt checkpoint.

  python -m launch.fault_inject --steps=24 --kills=5 --fault_seed=0

The faulted run is a chain of `python -m launch.main` processes in one workdir: SIGKILLs at seeded random
steps (plus a random delay inside the step), one SIGTERM (checkpoint and exit), a truncated file in the
newest checkpoint between two restarts, and, in-process, the loss of a sampler slice and of a trainer slice
(`faults.lose_slice_at`, fired by rlax.runtime.failover), one of whose recoveries is SIGKILLed in a seeded
phase (`faults.kill_in_recovery`). An uninterrupted run of the same config runs alongside; both write
`params_sha256` to summary.json.

Every injected fault is a row, with what happened to it: a slice fault is recovered in-process, or its
recovery was interrupted and the next process started without the slice, or it is reported as never
recovered. `faults_survived` counts the rows that survived; the last line is one JSON object.
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

from launch._fault_rows import events, metric_rows, slice_rows
from launch.flags_util import define_workdir, parse_or_exit
from rlax.config import RECOVERY_PHASES

STEPS = flags.DEFINE_integer("steps", 24, "RL steps of the shrunk demo.")
KILLS = flags.DEFINE_integer("kills", 5, "SIGKILLs to inject (>= 5 asked by the issue).")
FAULT_SEED = flags.DEFINE_integer("fault_seed", 0, "Seed for kill steps and delays (not the run's config.seed).")
WORKDIR = define_workdir("/tmp/rlax_fault_inject", "Parent of the ref/ and faulted/ workdirs.")
EVERY = flags.DEFINE_integer("ckpt_every", 3, "Checkpoint period in steps.")
RECOVERY_KILL = flags.DEFINE_enum(
    "kill_in_recovery", "random", ["random", "none", *RECOVERY_PHASES],
    "Recovery phase in which a slice-loss recovery SIGKILLs its process ('random': drawn with --fault_seed).")


def _cmd(workdir, extra=()):
  c = "--config."
  return [sys.executable, "-m", "launch.main", "--config=configs/demo.py", "--progress=false",
          f"{c}workdir={workdir}", f"{c}controller.steps={STEPS.value}", f"{c}deterministic=True",
          f"{c}controller.max_staleness=1", f"{c}checkpoint.every_steps={EVERY.value}", f"{c}checkpoint.keep=3",
          f"{c}init.sft_steps=5", f"{c}data.n_eval=16", f"{c}eval.n_samples=2", *extra]


def _start(workdir, extra, n):
  log = open(os.path.join(os.path.dirname(workdir), f"proc{n}.log"), "w")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(workdir), "jax_cache"))
  return subprocess.Popen(_cmd(workdir, extra), stdout=log, stderr=subprocess.STDOUT, env=env), log.name


def _resumed_step(logfile):
  m = re.findall(r"resumed from checkpoint step (\d+)", open(logfile).read())
  return int(m[0]) if m else 0


def _corrupt_newest(workdir):
  """Truncates the largest file of the newest finalized checkpoint → its step (None: none finalized yet)."""
  ck = os.path.join(workdir, "checkpoints")
  steps = [int(d) for d in os.listdir(ck) if d.isdigit()] if os.path.isdir(ck) else []
  if not steps:  # under load the first async save may still be a tmp directory when the process dies
    return None
  step = max(steps)
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
  phase = rng.choice(RECOVERY_PHASES) if RECOVERY_KILL.value == "random" else RECOVERY_KILL.value
  faults = [f"--config.faults.lose_slice_at=2:{lose_s},0:{lose_t}"]
  if phase != "none":  # the process SIGKILLs itself inside the first recovery that reaches `phase`
    faults.append(f"--config.faults.kill_in_recovery={phase}")
  ref, _ = _start(ref_dir, (), "_ref")
  # Interruptions at increasing steps, away from the slice-fault steps; the SIGTERM sits in the middle.
  plan = ["kill"] * KILLS.value
  plan.insert(len(plan) // 2, "term")
  free = [s for s in range(1, n - 3) if abs(s - lose_s) > 1 and abs(s - lose_t) > 1]
  targets = sorted(rng.sample(free, len(plan)))
  corrupt_after = 1  # truncate the newest checkpoint after the second interruption (or the first SIGKILL after it
  corrupted = False  # that finds a finalized checkpoint)
  table, logs, waiting = [], [], []  # rows waiting for the log of the process that resumes after them

  def launch():
    proc, log = _start(run_dir, faults, len(logs))
    logs.append((proc, log))
    for row in waiting:
      row["log"] = log
    waiting.clear()
    return proc

  def add_row(row):
    table.append(row)
    waiting.append(row)

  def recovery_kill(kills_before):
    """The deliberate SIGKILL a recovery sent to its process since `kills_before` kills, as a row (or None)."""
    killed = events(run_dir, "killed")[kills_before:]
    if not killed:
      return None
    e = killed[-1]
    add_row({"kind": f"sigkill in recovery ({e['phase']})", "step": e["step"], "t": e["time"]})
    return e

  def died_in_recovery(proc, kills_before):
    """A process that ended early must have been SIGKILLed by its own recovery fault: record it."""
    if proc.returncode != -signal.SIGKILL or recovery_kill(kills_before) is None:
      raise SystemExit(f"faulted run exited early (rc {proc.returncode}); see {logs[-1][1]}")

  for i, (kind, target) in enumerate(zip(plan, targets)):
    while True:
      base, kills = len(metric_rows(run_dir)), len(events(run_dir, "killed"))  # this process's rows come after `base`
      proc = launch()
      while proc.poll() is None and max((r["step"] for r in metric_rows(run_dir)[base:]), default=-1) < target:
        time.sleep(0.05)
      if proc.poll() is None:
        time.sleep(rng.uniform(0.0, 0.5))  # somewhere inside the next step
      if proc.poll() is None:
        break
      died_in_recovery(proc, kills)
    proc.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
    proc.wait()  # a SIGTERM finishes its step and checkpoints first
    t_fault = time.time()
    rows = metric_rows(run_dir)[base:]
    done = rows[-1]["step"] + 1 if rows else _resumed_step(logs[-1][1])
    row = {"kind": "sigkill" if kind == "kill" else "sigterm", "step": done, "t": t_fault}
    add_row(row)
    # A slice-loss recovery may have SIGKILLed the process before (or while) the signal took effect.
    if recovery_kill(kills) is not None:
      row["kind"] += " (overtaken by the sigkill in recovery)"
    # Not after the SIGTERM: its row checks that the checkpoint it wrote holds every finished step.
    if kind == "kill" and i >= corrupt_after and not corrupted:
      step = _corrupt_newest(run_dir)
      if step is not None:
        table.append({"kind": "corrupt_checkpoint", "step": step, "t": time.time()})
        corrupted = True
  while True:
    kills = len(events(run_dir, "killed"))
    proc = launch()
    if proc.wait() == 0:
      break
    died_in_recovery(proc, kills)
  ref_rc = ref.wait()
  # Steps lost = work done before the fault minus the step the next process resumed from.
  # (A kill right before the corruption counts the corruption's loss too: its process resumed further back.)
  for k, row in enumerate(table):
    log = table[k - 1]["log"] if row["kind"] == "corrupt_checkpoint" else row["log"]
    row["lost"] = row["step"] - _resumed_step(log)
    row["survived"] = row["kind"] != "corrupt_checkpoint" or "is unreadable" in open(log).read()
    if row["kind"] == "sigterm":
      row["survived"] = row["lost"] == 0  # the checkpoint at the stop holds every finished step
    later = [r["time"] for r in metric_rows(run_dir) if r["time"] > row["t"]]
    # Kill → the first step trained by the next process (or its summary, if no step was left to train).
    done_at = min(later) if later else os.path.getmtime(os.path.join(run_dir, "summary.json"))
    row["recovery_s"] = done_at - row["t"]
  table += slice_rows(run_dir, {p.pid: _resumed_step(log) for p, log in logs})
  width = max(52, *(len(r["kind"]) for r in table))
  print(f"{'fault':{width}s} {'step':>5s} {'lost':>5s} {'recovery_s':>10s} survived")
  for r in table:
    print(f"{r['kind']:{width}s} {r['step']:5d} {r['lost']:5d} {r['recovery_s']:10.2f} {r['survived']}")
  summ = [json.load(open(os.path.join(d, "summary.json"))) for d in (ref_dir, run_dir)]
  print(json.dumps({"faults_injected": len(table), "faults_survived": sum(bool(r["survived"]) for r in table),
                    "max_steps_lost": max(r["lost"] for r in table), "params_equal":
                    ref_rc == 0 and summ[0]["params_sha256"] == summ[1]["params_sha256"],
                    "steps": n, "faulted_steps": summ[1]["steps"], "processes": len(logs),
                    "recovery_kill_phase": phase, "fault_seed": FAULT_SEED.value,
                    "pass1_ref": summ[0].get("pass1_after"), "pass1_faulted": summ[1].get("pass1_after")}))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
