"""Supervisor: start N processes of one multi-process JAX job, restart the whole job when any dies.

  python -m launch.multihost --num_processes=2 --max_restarts=3 -- \
      python tests/harness/mh_worker.py --mode=steps --steps=20 --workdir=/tmp/job

JAX aborts every process when one peer dies (no Python exception reaches the survivors), so recovery is
job-level: kill the survivors, pick a fresh coordinator port, start all N again. The job resumes from
its own last checkpoint. Each process gets RLAX_COORDINATOR / RLAX_NUM_PROCESSES / RLAX_PROCESS_ID
(read by `rlax.multihost.init_from_env`); `{process_id}` in the command is substituted too. The last
output line is JSON: {"ok", "restarts", "attempts": [exit codes per attempt]}.
"""

import json
import sys

from absl import app, flags

from launch._supervisor import Supervisor
from launch.flags_util import parse_or_exit

NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes in the job.")
MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 3, "Whole-job restarts before giving up.")
PID_FILE = flags.DEFINE_string("pid_file", "", "Write the live processes' pids here (one JSON line).")
LOG_DIR = flags.DEFINE_string("process_logs", "", "Folder for process_<i>.log; empty: inherit stdout.")


def main(argv):
  cmd = argv[1:]
  if cmd and cmd[0] == "--":
    cmd = cmd[1:]
  if not cmd:
    print("rlax: multihost: give the worker command after --", file=sys.stderr)
    sys.exit(2)
  sup = Supervisor(cmd, NUM_PROCESSES.value, max_restarts=MAX_RESTARTS.value, pid_file=PID_FILE.value or None,
                   log_dir=LOG_DIR.value or None)
  result = sup.run()
  print(json.dumps(result))
  sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
