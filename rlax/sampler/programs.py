"""The engines' compiled programs, shared by every engine of the process that runs the same program.

    jitted, traces = programs.get("decode", functools.partial(slots_lib.decode_chunk, cfg=cfg, ...),
                                  static=("strategy",), donate=(1,))

A sampler rebuilt on the same devices (after a failover that kept its slice, an evaluation engine beside the
rollout one, a restarted run in the same process) finds its programs traced and compiled already: jit's own cache
keys each call by shapes, shardings and the ambient mesh, so sharing the jit object is exact. `traces` counts the
program's traces for every engine that shares it (Sampler.trace_counts: those since the engine was built, by
whichever engine). A program whose arguments cannot be hashed is not shared. The newest `_MAX` are kept.
Callers: Sampler._jit, Sampler.empty.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Callable

import jax

_lock = threading.Lock()
_programs: collections.OrderedDict = collections.OrderedDict()  # key -> (jitted, [traces]), least recent first
_MAX = 512  # programs kept: a few engines' worth (an engine has 10-40); the least recently made goes first


def _identity(fn) -> object:
  """What makes two programs the same: the function and its bound arguments (a partial compares by identity)."""
  if isinstance(fn, functools.partial):
    return fn.func, fn.args, tuple(sorted(fn.keywords.items()))
  return fn


def _build(name: str, fn: Callable, static, donate, out_shardings) -> tuple[Callable, list]:
  traces = [0]

  def traced(*args, **kw):
    traces[0] += 1  # runs at trace time only
    return fn(*args, **kw)
  traced.__name__ = traced.__qualname__ = name  # the compile log names the program
  kw = {} if out_shardings is None else dict(out_shardings=out_shardings)
  return jax.jit(traced, static_argnames=static, donate_argnums=donate, **kw), traces


def get(name: str, fn: Callable, *, static=(), donate=(), out_shardings=None) -> tuple[Callable, list]:
  """jit(fn) as (jitted, traces): the process's one for this program, made on first use."""
  key = (name, _identity(fn), tuple(static), tuple(donate), out_shardings)
  try:
    hash(key)
  except TypeError:
    return _build(name, fn, static, donate, out_shardings)
  with _lock:
    if key not in _programs:
      _programs[key] = _build(name, fn, static, donate, out_shardings)
      while len(_programs) > _MAX:  # a dropped program's compiled code goes with its last engine
        _programs.popitem(last=False)
    _programs.move_to_end(key)
    return _programs[key]
