"""rlax.allocator: entry points re-execute under tcmalloc when it is installed, never otherwise; glibc is held to
a few arenas; free memory is released after compiles when asked (rlax.run.release_after_compiles)."""

import os
import subprocess
import sys

from rlax import allocator
from rlax.allocator import find_tcmalloc

_PROBE = ("import os; from rlax.allocator import set_up, using_tcmalloc; set_up(); "
          "maps = open('/proc/self/maps').read(); print(using_tcmalloc(), 'tcmalloc' in maps, os.getpid())")


def _probe(**env):
  full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RLAX_TCMALLOC")}
  full.update(env)
  out = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  flag, mapped, _ = out.stdout.split()
  return flag == "True", mapped == "True"


def test_reexec_preloads_tcmalloc_when_installed():
  # Re-executed: the library is really mapped into the process, not just named in the environment.
  assert _probe() == ((True, True) if find_tcmalloc() else (False, False))


def test_opt_out_keeps_the_default_allocator():
  assert _probe(RLAX_TCMALLOC="0") == (False, False)


# Eight threads each allocate once: glibc gives each thread that has none its own arena, up to 8 per core.
# malloc_stats() prints one "Arena N:" block per arena to stderr.
_ARENAS = """
import ctypes, sys, threading
from rlax import allocator
if sys.argv[1] == "set_up":
  allocator.set_up()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
held, ready = [], threading.Barrier(8)
def work():
  ready.wait()  # all alive at once, so none inherits a finished thread's arena
  held.append(libc.malloc(4096))
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.malloc_stats()
"""


def _arenas(mode):
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_ARENA_MAX")}
  env["RLAX_TCMALLOC"] = "0"
  out = subprocess.run([sys.executable, "-c", _ARENAS, mode], env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


def test_glibc_is_held_to_two_arenas():
  assert _arenas("default") > allocator.GLIBC_ARENAS  # the test can tell: glibc alone spreads the threads
  assert 1 <= _arenas("set_up") <= allocator.GLIBC_ARENAS


def test_memory_maps_past_the_share_of_the_kernels_limit_are_warned(monkeypatch):
  from rlax import allocator
  said = []
  monkeypatch.setattr(allocator.logging, "warning", lambda msg, *args: said.append(msg % args))
  allocator.check_memory_maps("a test", share=1.0)
  assert not said  # a test process holds far fewer maps than the limit
  allocator.check_memory_maps("a test", share=0.0)
  (line,) = said
  assert line.startswith("after a test this process holds") and "sysctl -w vm.max_map_count=" in line


def test_a_limit_under_what_a_run_needs_is_warned_before_it_compiles(monkeypatch):
  from rlax import allocator
  said = []
  monkeypatch.setattr(allocator.logging, "warning", lambda msg, *args: said.append(msg % args))
  _, limit = allocator.memory_maps()
  allocator.check_memory_maps("building the sampler", need=limit)
  assert not said
  allocator.check_memory_maps("building the sampler", need=limit + 1)
  assert len(said) == 1 and f"sysctl -w vm.max_map_count={4 * limit})" in said[0]


def test_free_memory_is_released_after_compiles_at_most_once_per_gap(monkeypatch):
  import jax
  import numpy as np
  from rlax.run import compiles
  calls = []
  monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append(1))
  fresh = lambda k: jax.jit(lambda x: x * k + 1.0)(np.ones(3 + k, np.float32))  # one new program each
  n0 = compiles.CompileCounter.total()[0]
  try:
    compiles.release_after_compiles(0.0)
    fresh(1), fresh(2)
    assert len(calls) == compiles.CompileCounter.total()[0] - n0 >= 2  # one release per compile
    compiles.release_after_compiles(3600.0)
    n = len(calls)
    fresh(3), fresh(4)
    assert len(calls) == n  # the last release was under an hour ago
  finally:
    compiles.release_after_compiles(None)
  fresh(5)
  assert len(calls) == n
