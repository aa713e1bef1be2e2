"""A grading's result: (reward, info) of a timeout or an error, and results crossing from a grading process as
JSON data (a hostile grader cannot make the controller unpickle anything)."""

from __future__ import annotations

import json
import numbers

MAX_MESSAGE = 16 << 20  # bytes of one result; a larger one is an error, never read whole
REPR_CHARS = 1000  # a value JSON has no type for crosses as its repr, cut to this


def timeout(seconds: float) -> tuple[float, dict]:
  """The (reward, info) of a grading stopped at its deadline: reward 0, `timeout: True`."""
  return 0.0, {"reason": f"timeout after {seconds:.1f}s", "timeout": True, "deadline_s": seconds}


def error(e: BaseException | str) -> tuple[float, dict]:
  """The (reward, info) of a grading that failed: reward 0, the reason, `error: True`."""
  text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
  return 0.0, {"reason": f"grader error: {text}"[:1000], "error": True}


def mean_fields(dicts, prefix: str) -> dict[str, float]:
  """Each numeric field of `dicts`, averaged over the dicts that have it, as `<prefix><field>`."""
  sums: dict[str, list] = {}
  for d in dicts:
    for k, v in d.items():
      if isinstance(v, numbers.Real):  # numpy scalars too
        sums.setdefault(k, []).append(float(v))
  return {f"{prefix}{k}": sum(v) / len(v) for k, v in sorted(sums.items())}


def metrics(infos) -> dict[str, float]:
  """A reward's own per-step numbers: the fields of the infos' `metrics` dicts (a judge's failures, timeouts,
  throughput), as `reward/<field>`. Callers: the episode streams' stats."""
  return mean_fields((i["metrics"] for i in infos if isinstance(i, dict) and isinstance(i.get("metrics"), dict)),
                     "reward/")


def _repr(v) -> str:
  try:
    return repr(v)[:REPR_CHARS]
  except Exception:  # pylint: disable=broad-except
    return f"<{type(v).__name__} without a repr>"


def plain(v, depth: int = 0):
  """`v` as JSON data: plain values (subclasses and numpy scalars as their base type), and dicts, lists and
  tuples of them, kept; anything else (a set, an object, a value nested too deep) its repr."""
  try:
    if v is None:
      return None
    if getattr(v, "shape", None) == () and hasattr(v, "item"):  # a numpy scalar
      v = v.item()
    base = next((b for b in (bool, int, float, str) if isinstance(v, b)), None)
    if base is not None:
      v = v if type(v) is base else base(v)
      return v if base is not int or v.bit_length() < 10000 else f"<int of {v.bit_length()} bits>"
    if depth < 16 and isinstance(v, (list, tuple)):
      return [plain(x, depth + 1) for x in v]
    if depth < 16 and isinstance(v, dict):
      return {k if type(k) is str else _repr(k): plain(x, depth + 1) for k, x in v.items()}
  except Exception:  # pylint: disable=broad-except
    pass
  return _repr(v)


def encode(result: tuple[float, dict]) -> bytes:
  """A worker's (reward, info) as the JSON bytes it sends (an error result when over MAX_MESSAGE)."""
  blob = json.dumps({"reward": result[0], "info": plain(result[1])}).encode()
  if len(blob) > MAX_MESSAGE:
    fail = error(f"the grader's result is {len(blob)} bytes, over the {MAX_MESSAGE >> 20} MB limit")
    blob = json.dumps({"reward": fail[0], "info": fail[1]}).encode()
  return blob


def decode(blob: bytes) -> tuple[float, dict]:
  """The controller's reading of `encode`'s bytes; ValueError (or a JSON error) when malformed."""
  msg = json.loads(blob)
  reward, info = float(msg["reward"]), msg["info"]
  if not isinstance(info, dict):
    raise ValueError("info is not an object")
  return reward, info
