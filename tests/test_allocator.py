"""rlax.allocator: entry points re-execute under tcmalloc when it is installed, never otherwise."""

import os
import subprocess
import sys

from rlax.allocator import find_tcmalloc

_PROBE = ("import os; from rlax.allocator import reexec_with_tcmalloc, using_tcmalloc; reexec_with_tcmalloc(); "
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
