"""Runs untrusted Python (a model's solution plus `assert` tests) in a contained child process.

Layers, strongest first (`isolation_mode()` says which are active here):

* Namespaces (root with a working `unshare`): new network namespace (only a down loopback: no
  network at all), PID namespace (the job is PID 1: it sees and can signal nothing of the host,
  and killing it kills all it spawned), IPC and UTS namespaces, and a private mount namespace in
  which every top-level directory except /usr, /bin, /sbin, /lib*, /proc, /dev (and /dev/shm too)
  is covered by an empty root-owned tmpfs and top-level files by /dev/null, so /etc, /root, /home,
  /work, /tmp, /var and the repo are invisible; only the Python install (read-only) and the job's
  own temp dir are bound back in. Directory *names* at / stay listable, their contents do not.
* Privileges: with namespaces (root), the job drops to uid/gid 65534 (`nobody`) before any
  untrusted code runs, so it cannot signal or write anything the host owns and RLIMIT_NPROC
  applies to it.
* Resource limits (setrlimit in the child): CPU seconds, address space, processes, file size,
  open files, no core dumps. The parent also enforces a wall-clock timeout (SIGKILL to the whole
  process group, and the job dies with its parent via PR_SET_PDEATHSIG) and reads at most
  `output_bytes` of output before killing the job.
* An audit hook (`sys.addaudithook`) installed before the solution runs: refuses sockets, process
  creation and signals, ctypes, threads, frame/gc introspection, opening files outside the
  stdlib (read) or the job dir (write), and file-system mutation outside the job dir. Without root
  this hook plus the rlimits is all there is: it is a best-effort Python-level guard (C extensions
  already loaded could bypass it), not a security boundary.

Not isolated: CPU time and memory bandwidth are shared with the host (a job can slow others down
within its limits); /proc (of the job's own PID namespace) and /dev device nodes are visible
(mostly unreadable to `nobody`). Solutions see the standard library only (`python -I -S`: no
site-packages). The verdict line is printed by the same process that ran the solution, so a solution that
defeats the audit hook could forge it (a per-job random nonce prevents print-based forging).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

_RUNNER = os.path.join(os.path.dirname(__file__), "_sandbox_runner.py")
_NOBODY = 65534
_KEEP_TOP = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev"}
_NS_FLAGS = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc", "--uts"]


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Per-job limits. `wall_s` is enforced by the parent; the rest by setrlimit in the child."""
  wall_s: float = 5.0
  cpu_s: int = 5
  memory_mb: int = 512
  nproc: int = 16
  fsize_mb: int = 8
  nofile: int = 64
  output_bytes: int = 1 << 20


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Outcome: status is 'ok' (verdict read), 'timeout', 'output_limit' or 'crashed'."""
  status: str
  passed: int
  total: int
  error: str
  wall_s: float
  output: str

  @property
  def all_passed(self) -> bool:
    return self.status == "ok" and self.total > 0 and self.passed == self.total


@functools.lru_cache(maxsize=None)
def isolation_mode() -> str:
  """'namespaces' when running as root and `unshare` with all namespaces works, else 'audit'."""
  if os.geteuid() != 0 or not shutil.which("unshare"):
    return "audit"
  try:
    ok = subprocess.run(["unshare", *_NS_FLAGS, "true"], capture_output=True, timeout=10).returncode
  except (OSError, subprocess.SubprocessError):
    return "audit"
  return "namespaces" if ok == 0 else "audit"


def _hidden_paths() -> tuple[list[str], list[str]]:
  """Top-level directories to cover with tmpfs (kept paths inside them are bound back in), and
  top-level regular files to mask with /dev/null."""
  dirs, files = [], []
  for name in sorted(os.listdir("/")):
    path = "/" + name
    if name in _KEEP_TOP or os.path.islink(path):
      continue
    if os.path.isdir(path):
      dirs.append(path)
    elif os.path.isfile(path):
      files.append(path)
  return dirs + (["/dev/shm"] if os.path.isdir("/dev/shm") else []), files


def _read_roots() -> list[str]:
  roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
  return sorted(roots)


def _kill(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  try:
    proc.kill()
  except ProcessLookupError:
    pass


def run_tests(code: str, tests: Sequence[str], limits: SandboxLimits = SandboxLimits(),
              mode: Optional[str] = None, tmp_root: Optional[str] = None,
              audit_hook: bool = True) -> SandboxResult:
  """Runs `code` and then each test statement in a fresh sandboxed interpreter.

  Returns how many of the `len(tests)` statements ran without raising. Never raises for anything
  the code does; a hang, crash or flood gives status 'timeout'/'crashed'/'output_limit'.
  `audit_hook=False` leaves only the kernel-level layers (tests use it to check those alone).
  """
  if not isinstance(code, str):
    raise ValueError(f"code must be a string, got {type(code).__name__}")
  mode = mode or isolation_mode()
  if mode not in ("namespaces", "audit"):
    raise ValueError(f"unknown sandbox mode {mode!r}")
  box = tempfile.mkdtemp(prefix="rlax_sbx_", dir=tmp_root)
  box = os.path.realpath(box)
  nonce = secrets.token_hex(16)
  as_root = os.geteuid() == 0
  if as_root and mode == "namespaces":
    os.chown(box, _NOBODY, _NOBODY)
  keep = [box] + _read_roots()
  hide, mask = _hidden_paths() if mode == "namespaces" else ([], [])
  job = {"box": box, "nonce": nonce, "code": code, "tests": list(tests), "mode": mode,
         "audit": audit_hook, "uid": _NOBODY, "keep": keep, "read_roots": _read_roots(),
         "hide": hide, "mask": mask,
         "limits": {"cpu_s": int(limits.cpu_s), "memory_bytes": limits.memory_mb << 20,
                    "nproc": limits.nproc, "fsize_bytes": limits.fsize_mb << 20,
                    "nofile": limits.nofile}}
  with open(_RUNNER) as f:
    runner = f.read()
  argv = [sys.executable, "-I", "-S", "-B", "-c", runner]
  if mode == "namespaces":
    argv = ["unshare", *_NS_FLAGS, "--"] + argv
  env = {"PATH": "/usr/bin:/bin", "HOME": box, "LANG": "C.UTF-8", "TMPDIR": box}
  start = time.monotonic()
  out, status = bytearray(), None
  try:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=box, env=env, start_new_session=True,
                            close_fds=True)
    try:
      proc.stdin.write(json.dumps(job).encode())
      proc.stdin.close()
    except BrokenPipeError:
      pass
    fd = proc.stdout.fileno()
    poller = select.poll()  # not select.select: it fails on fds >= 1024, common in a big controller
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while True:
      left = limits.wall_s - (time.monotonic() - start)
      if left <= 0:
        status = "timeout"
        break
      if not poller.poll(min(left, 0.5) * 1000):
        continue
      chunk = os.read(fd, 65536)
      if not chunk:
        break
      out += chunk
      if len(out) > limits.output_bytes:
        status = "output_limit"
        break
    _kill(proc)  # also after a clean exit: nothing the job started may outlive it
    try:
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      _kill(proc)
      proc.wait()
    proc.stdout.close()
  finally:
    shutil.rmtree(box, ignore_errors=True)
  wall = time.monotonic() - start
  text = bytes(out[:limits.output_bytes]).decode("utf-8", "replace")
  if status:
    return SandboxResult(status, 0, len(tests), f"{status} after {wall:.1f}s", wall, text[-2000:])
  for line in reversed(text.splitlines()):
    if line.startswith(nonce + " "):
      _, passed, total, err = line.split(" ", 3)
      shown = text[:text.rfind(nonce)].rstrip("\n")
      return SandboxResult("ok", int(passed), int(total), json.loads(err), wall, shown[-2000:])
  return SandboxResult("crashed", 0, len(tests), f"no verdict (exit code {proc.returncode})", wall,
                       text[-2000:])
