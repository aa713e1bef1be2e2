"""Child side of the code sandbox (run as `python -I -S -B -c <code_values source + this source>` inside the
jail; never imported).

Reads one length-prefixed marshal job from stdin (the grader's, trusted here), lowers its resource limits, then either

* "program": runs the code as `__main__`, the rest of stdin being the program's stdin; or
* "oracle": runs the solution, replies whether it loaded, then answers requests (length-prefixed
  marshal frames on stdin) one at a time, each with one JSON line: `exec` a statement, or `eval` an expression and reply with its value as type-tagged
  JSON (`encode`, from rlax.rewards.code_values) — or, with `store`, keep a value that is not plain data
  under that name and say so. Request values (`bind`) are the grader's, decoded here.

Replies go to the original stdout; the solution's own stdout is moved onto stderr, so nothing it prints can
be taken for a reply. Expected values and comparisons never enter this process (rlax.rewards.code_tests).
"""


def _main():
  import builtins, marshal, os, sys, resource  # pylint: disable=g-import-not-at-top,multiple-imports
  read, write, loads, exit_ = os.read, os.write, marshal.loads, os._exit
  # pylint: disable-next=undefined-variable  # code_values, prepended
  enc, dec, refused, mutable, dumps = encode, decode, Refused, MUTABLE, write_json

  def frame(fd):
    """One length-prefixed frame from `fd` (None at its end)."""
    size = b""
    while len(size) < 8:
      chunk = read(fd, 8 - len(size))
      if not chunk:
        return None
      size += chunk
    n, parts = int.from_bytes(size, "little"), []
    while n > 0:
      chunk = read(fd, min(n, 1 << 20))
      if not chunk:
        return None
      parts.append(chunk)
      n -= len(chunk)
    return loads(b"".join(parts))

  job = frame(0)
  if job is None:
    exit_(3)
  for name, value in job.pop("limits").items():
    hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU at the soft limit, SIGKILL at the hard
    resource.setrlimit(getattr(resource, name), (value, hard))
  if job["mode"] == "program":
    os.dup2(2, 1)  # one stream, in the order written
    exec(compile(job.pop("code"), "<program>", "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
    return
  reply_fd = os.dup(1)
  os.dup2(2, 1)  # the solution's prints go with its stderr
  requests = os.dup(0)
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # input() reads nothing rather than the requests
  pristine = dict(vars(builtins))  # probes see the builtins as they were before the solution ran
  type_, str_, len_, dict_, base_exc = type, str, len, dict, BaseException
  compile_, exec_, eval_, callable_ = compile, exec, eval, callable
  type_name = type.__dict__["__name__"].__get__  # the C slot: a metaclass cannot fake it
  flushes = (sys.stdout.flush, sys.stderr.flush)  # bound now: the solution may replace sys.stdout
  max_bytes = job["reply_bytes"]

  def reply(obj):
    for flush in flushes:  # its prints reach the grader's log before the process is killed
      try:
        flush()
      except base_exc:  # pylint: disable=broad-except
        pass
    data = dumps(obj).encode() + b"\n"
    if len_(data) > max_bytes:
      data = dumps({"error": f"the value is over {max_bytes} bytes"}).encode() + b"\n"
    while data:
      data = data[write(reply_fd, data):]

  def failure(e):
    out = {"error": "an exception that cannot be printed"}
    try:
      out = {"error": f"{type_(e).__name__}: {str_(e)[:200]}"}
      if pristine.get(type_(e).__name__) is type_(e):  # a builtin exception, for the test's `except`
        out["raised"] = type_(e).__name__
    except base_exc:  # pylint: disable=broad-except
      pass
    return out

  scope = {"__name__": "__main__"}
  try:
    exec_(compile_(job.pop("code"), "<solution>", "exec"), scope)
    out = {"ok": True}
  except base_exc as e:  # pylint: disable=broad-except
    out = failure(e)
    out["error"] = "solution: " + out["error"]
  reply(out)
  while True:
    req = frame(requests)
    if req is None:
      exit_(0)
    try:
      bind = {k: dec(v, refs=scope.__getitem__) for k, v in req["bind"].items()}
      if req["op"] == "exec":
        scope.update(bind)
        exec_(compile_(req["src"], "<test>", "exec"), scope)
        out = {"ok": True}
      else:
        glob = dict_(scope)
        glob["__builtins__"] = pristine
        value = eval_(compile_(req["src"], "<test>", "eval"), glob, bind)
        try:
          out = {"value": enc(value)}
        except refused:
          if not req.get("store"):
            raise
          scope[req["store"]] = value
          out = {"stored": True, "type": type_name(type_(value)), "callable": callable_(value)}
        changed = {k: v for k, v in bind.items() if type_(v) in mutable}  # the grader's, changed in place
        if changed:
          out["after"] = {k: enc(v) for k, v in changed.items()}
    except refused as e:
      out = {"error": f"refused {e}"}
    except base_exc as e:  # pylint: disable=broad-except
      out = failure(e)
    try:
      reply(out)
    except base_exc:  # pylint: disable=broad-except
      exit_(4)


_main()
