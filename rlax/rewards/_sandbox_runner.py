"""Child side of the code sandbox (run as `python -I -S -c <this source>`; never imported).

Reads one JSON job from stdin, then, in this order: (as root in fresh namespaces) hides the host
file system behind empty tmpfs mounts, re-exposing only the Python install read-only and the job
directory; lowers resource limits; drops to uid/gid `nobody`; arms parent-death SIGKILL; installs an
audit hook; runs the solution and the tests; prints `<nonce> <passed> <total> <error>` as its last
line. Everything is inside `_main` so user code cannot reach the nonce through `__main__`.
"""


def _main():
  import json, os, sys, resource  # pylint: disable=g-import-not-at-top,multiple-imports
  job = json.loads(sys.stdin.read())
  sys.stdin.close()
  os.close(0)
  box, nonce, lim = job["box"], job["nonce"], job["limits"]
  os.chdir(box)
  if job["mode"] == "namespaces":
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    ms_nosuid, ms_nodev, ms_bind, ms_rec, ms_remount, ms_rdonly = 2, 4, 4096, 16384, 32, 1

    def mount(src, dst, fstype, flags, data):
      if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                    data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {dst}")

    keep = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in job["keep"]]
    for d in job["hide"]:
      mount("tmpfs", d, "tmpfs", ms_nosuid | ms_nodev, "size=64k,mode=755")
    for f in job["mask"]:
      mount("/dev/null", f, None, ms_bind, None)
    for p, fd in keep:
      os.makedirs(p, exist_ok=True)
      mount(f"/proc/self/fd/{fd}", p, None, ms_bind | ms_rec, None)
      if p != box:
        mount(None, p, None, ms_bind | ms_remount | ms_rdonly, None)
      os.close(fd)
    os.chdir(box)
  for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_bytes"]),
                      ("RLIMIT_NPROC", lim["nproc"]), ("RLIMIT_FSIZE", lim["fsize_bytes"]),
                      ("RLIMIT_NOFILE", lim["nofile"]), ("RLIMIT_CORE", 0)):
    hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU at soft, SIGKILL at hard
    resource.setrlimit(getattr(resource, name), (value, hard))
  if job["mode"] == "namespaces" and os.geteuid() == 0:
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
    import ctypes  # pylint: disable=g-import-not-at-top
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG=SIGKILL: setuid cleared the one unshare set
  read_roots = tuple(os.path.realpath(p) for p in job["read_roots"]) + (box,)
  blocked_prefixes = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.exec", "os.spawn",
                      "os.posix_spawn", "os.system", "os.kill", "os.killpg", "signal.", "ctypes.",
                      "sys.setprofile", "sys.settrace", "sys._getframe", "sys._current_frames",
                      "gc.get_", "os.setuid", "resource.setrlimit", "_thread.", "pty.", "fcntl.",
                      "os.setsid", "os.startfile", "os.chroot", "cpython.remote")
  write_events = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                  "os.symlink", "os.link", "os.truncate", "os.utime", "os.chdir", "shutil.")
  frame_attrs = ("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_globals", "f_locals")
  realpath, isinstance_, str_, bytes_, any_ = os.path.realpath, isinstance, str, bytes, any

  def inside(path, roots):
    if isinstance_(path, bytes_):
      path = path.decode("utf-8", "replace")
    if not isinstance_(path, str_):
      return True  # an already-open file descriptor
    p = realpath(path)
    return any_(p == r or p.startswith(r + "/") for r in roots)

  def hook(event, args):
    if event == "open":
      path, mode, flags = args
      writing = (mode and any_(c in mode for c in "wax+")) or (flags or 0) & 0o3
      if not inside(path, (box,) if writing else read_roots + ("/dev/null", "/dev/urandom")):
        raise PermissionError(f"sandbox: open({path!r}) outside the job directory")
    elif event.startswith(blocked_prefixes) or event == "import" and args[0] in ("ctypes", "_ctypes"):
      raise PermissionError(f"sandbox: {event} is not allowed")
    elif event == "object.__getattr__" and args[1] in frame_attrs:
      raise PermissionError("sandbox: frame introspection is not allowed")
    elif event.startswith(write_events) and not inside(args[0], (box,)):
      raise PermissionError(f"sandbox: {event} outside the job directory")
    elif event in ("os.listdir", "os.scandir") and not inside(args[0] or ".", read_roots):
      raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")

  passed, error, tests, code = 0, "", list(job["tests"]), job["code"]
  # Bound before user code runs: the solution may rebind builtins to fake a pass.
  write, dumps, exit_, exec_, compile_ = os.write, json.dumps, os._exit, exec, compile
  flush_out, flush_err = sys.stdout.flush, sys.stderr.flush
  n_tests, range_ = len(tests), range
  if job["audit"]:
    sys.addaudithook(hook)
  del job
  scope = {"__name__": "__main__"}
  try:
    exec_(compile_(code, "<solution>", "exec"), scope)
    for i in range_(n_tests):
      try:
        exec_(compile_(tests[i], f"<test {i}>", "exec"), scope)
        passed += 1
      except BaseException as e:  # pylint: disable=broad-except
        error = error or f"test {i}: {type(e).__name__}: {str(e)[:200]}"
  except BaseException as e:  # pylint: disable=broad-except
    error = f"solution: {type(e).__name__}: {str(e)[:200]}"
  for flush in (flush_out, flush_err):
    try:
      flush()
    except BaseException:  # pylint: disable=broad-except
      pass
  write(1, ("\n%s %d %d %s\n" % (nonce, passed, n_tests, dumps(error))).encode())
  exit_(0)


_main()
