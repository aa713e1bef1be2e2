"""The job-level restart loop behind `launch.multihost` (importable, so tests use it directly)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Supervisor:
  """Runs `cmd` as `num_processes` processes; when one exits non-zero, stops the rest and restarts all.

  `max_restarts` whole-job restarts at most; `pid_file` receives {"attempt", "pids"} after each start.
  """

  def __init__(self, cmd: Sequence[str], num_processes: int, *, max_restarts: int = 3,
               pid_file: Optional[str] = None, log_dir: Optional[str] = None, poll_s: float = 0.1,
               env: Optional[dict] = None):
    if num_processes < 1 or max_restarts < 0:
      raise ValueError(f"need num_processes >= 1 and max_restarts >= 0, got {num_processes}, {max_restarts}")
    self.cmd, self.n, self.max_restarts = list(cmd), num_processes, max_restarts
    self.pid_file, self.log_dir, self.poll_s = pid_file, log_dir, poll_s
    self.env = dict(os.environ if env is None else env)

  def _start(self, attempt: int) -> list[subprocess.Popen]:
    coord = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(self.n):
      env = dict(self.env, RLAX_COORDINATOR=coord, RLAX_NUM_PROCESSES=str(self.n), RLAX_PROCESS_ID=str(i),
                 RLAX_ATTEMPT=str(attempt))
      cmd = [a.replace("{process_id}", str(i)) for a in self.cmd]
      out = None
      if self.log_dir:
        os.makedirs(self.log_dir, exist_ok=True)
        out = open(os.path.join(self.log_dir, f"process_{i}.log"), "a")
      procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True))
    if self.pid_file:
      tmp = self.pid_file + ".tmp"
      with open(tmp, "w") as f:
        json.dump({"attempt": attempt, "pids": [p.pid for p in procs]}, f)
      os.replace(tmp, self.pid_file)
    return procs

  @staticmethod
  def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 10
    for p in procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

  def run(self) -> dict:
    """Runs to success or until restarts run out; returns {"ok", "restarts", "attempts"}."""
    attempts = []
    for attempt in range(self.max_restarts + 1):
      procs = self._start(attempt)
      try:
        while True:
          codes = [p.poll() for p in procs]
          failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
          if failed or all(c == 0 for c in codes):
            break
          time.sleep(self.poll_s)
      finally:
        self._stop(procs)  # a dead peer makes JAX abort the others anyway; don't wait for it
      codes = [p.returncode for p in procs]
      attempts.append(codes)
      if not failed:
        return {"ok": True, "restarts": attempt, "attempts": attempts}
      what = (f"restarting the job (restart {attempt + 1} of {self.max_restarts})" if attempt < self.max_restarts
              else "no restarts left")
      print(f"rlax: supervisor: process {failed[0]} exited with {codes[failed[0]]}; {what}", file=sys.stderr,
            flush=True)
    return {"ok": False, "restarts": self.max_restarts, "attempts": attempts}
