"""Local runs: one process on fake CPU devices, or N processes on this machine under the supervisor.

  python -m launch.local --config=configs/demo.py                  # launch.main, 8 fake devices
  python -m launch.local --processes=2 --mode=steps --steps=20      # 2-process job (trainer on process 0,
                                                                    # sampler on 1), restarted if one dies

--processes=1 runs `launch.main` with --cpu_devices; more runs `launch._mh_worker` (the multi-host CPU
job: weight pushes through `rlax.multihost.CrossMeshPush`) through `launch.multihost`'s supervisor,
each process with --cpu_devices devices. Extra arguments after -- go to the child unchanged.
"""

import os
import subprocess
import sys

from absl import app, flags

PROCESSES = flags.DEFINE_integer("processes", 1, "1: one controller process; N: N processes on 127.0.0.1.")
CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Fake CPU devices per process (0: 8 for one, 4 for N).")
CONFIG = flags.DEFINE_string("config", "configs/demo.py", "One process: the config file for launch.main.")
MODE = flags.DEFINE_string("mode", "steps", "N processes: the worker's --mode (push or steps).")
STEPS = flags.DEFINE_integer("steps", 20, "N processes: the worker's --steps.")
WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlax_local", "N processes: checkpoints and process logs.")
MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 3, "N processes: whole-job restarts.")


def command(extra: list[str]) -> list[str]:
  """The command line this launcher runs (printed first, so it can be copied)."""
  py = sys.executable
  if PROCESSES.value == 1:
    return [py, "-m", "launch.main", f"--config={CONFIG.value}", f"--cpu_devices={CPU_DEVICES.value or 8}",
            *extra]
  out = os.path.join(WORKDIR.value, "weights.npz")
  return [py, "-m", "launch.multihost", f"--num_processes={PROCESSES.value}",
          f"--max_restarts={MAX_RESTARTS.value}", f"--process_logs={WORKDIR.value}/logs", "--",
          py, "-m", "launch._mh_worker", f"--mode={MODE.value}", f"--steps={STEPS.value}",
          f"--workdir={WORKDIR.value}", f"--out={out}", f"--cpu_devices={CPU_DEVICES.value or 4}", *extra]


def main(argv):
  extra = list(argv[1:])
  if extra and extra[0] == "--":
    extra = extra[1:]
  if PROCESSES.value < 1:
    print(f"rlax: local: --processes must be >= 1, got {PROCESSES.value}", file=sys.stderr)
    sys.exit(2)
  cmd = command(extra)
  print(" ".join(cmd), flush=True)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process sets its own device count
  sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
  app.run(main)
