"""Picks the process's allocator: tcmalloc when the system has it (`apt-get install libtcmalloc-minimal4`),
else glibc's malloc held to a few arenas.

XLA:CPU allocates a program's temporaries afresh on every run. glibc serves
blocks over its mmap threshold (at most 32 MB) with fresh mmaps and unmaps them
on free, so every train step page-faults its gigabyte of activations back in;
tcmalloc keeps freed pages. On the W2 step that is ~15% of the step time.
Entry points call `set_up()` before any JAX work; RLAX_TCMALLOC=0 turns tcmalloc
off. (JAX's TPU VM images preload tcmalloc for the same reason.)

glibc gives each contending thread its own arena (up to 8 per core), and what one
arena frees only that arena reuses: XLA's worker threads, the producer and the
graders each held freed memory apart. With two arenas the SmolLM2 run peaked at
9.2 GB against 10.0 GB, and W3's iteration time did not move (2.85 against 2.94 s,
medians of alternating runs; 2026-12-06).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from typing import Optional

from absl import logging

_ENV = "RLAX_TCMALLOC"
_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
GLIBC_ARENAS = 2


def find_tcmalloc() -> Optional[str]:
  """The soname of an installed tcmalloc, or None."""
  for name in ("tcmalloc_minimal", "tcmalloc"):
    lib = ctypes.util.find_library(name)
    if lib:
      return lib
  return None


def set_up() -> None:
  """Runs the process under tcmalloc (`reexec_with_tcmalloc`), or else limits glibc to `GLIBC_ARENAS` arenas
  (the threads that start later share them). Called first thing by launch.main and the benchmarks."""
  reexec_with_tcmalloc()
  if not using_tcmalloc() and sys.platform.startswith("linux"):
    try:
      ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, GLIBC_ARENAS)
    except (OSError, AttributeError):  # another libc (musl): its own policy
      pass


def reexec_with_tcmalloc() -> None:
  """Re-executes this process with tcmalloc preloaded, unless off, absent, or already loaded.

  Call it first thing in main(): the process restarts from scratch with the same
  command line, so nothing done before the call survives.
  """
  if os.environ.get(_ENV, "1") == "0" or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
    return
  lib = find_tcmalloc()
  if lib is None or not sys.platform.startswith("linux"):
    return
  env = dict(os.environ, LD_PRELOAD=f"{lib} {os.environ.get('LD_PRELOAD', '')}".strip())
  # Not the user's business on every start (`-v=1` shows it); `using_tcmalloc()` tells afterwards.
  logging.vlog(1, "re-executing under %s (%s=0 turns this off)", lib, _ENV)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)


def using_tcmalloc() -> bool:
  """Whether tcmalloc is preloaded in this process."""
  return "tcmalloc" in os.environ.get("LD_PRELOAD", "")


def release_free_memory() -> None:
  """Hands the allocator's free pages back to the OS. Compiling and host-side batches leave gigabytes free
  but held in glibc's arenas (malloc_trim returned 1.45 of 3.9 GB after the SmolLM2 run's warm-up); the
  runtime calls this after the sampler's warm-up and after each step (~0.2 s), and under launch.main after
  compiles (`rlax.run.release_after_compiles`). tcmalloc: ReleaseFreeMemory."""
  try:
    if using_tcmalloc():
      ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory()
    else:
      ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # another libc (musl) or allocator: nothing to release through
    pass


def memory_maps() -> tuple[int, int]:
  """(maps this process holds, vm.max_map_count); (0, 0) off Linux. XLA:CPU maps three pages per compiled kernel,
  and a process past the limit aborts ("LLVM ERROR: Unable to allocate section memory"). Read by
  `check_memory_maps` and by the test suite (tests/conftest.py), which drops compiled programs before the limit."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f), limit
  except (OSError, ValueError):
    return 0, 0


# What a multi-turn run on CPU can hold: configs/search_tool.py's SmolLM2 run held 71k maps after its warm-up
# (its sampler's extensions were then 20 programs), past the kernel's default of 65530.
MULTI_TURN_MAPS = 262144


def check_memory_maps(after: str, share: float = 0.5, need: int = 0) -> None:
  """Warns when this process holds more than `share` of vm.max_map_count (`memory_maps`), or when the limit is
  under `need` (before a warm-up that compiles many programs). Called by the sampler's warm-up (`after` names
  the moment)."""
  held, limit = memory_maps()
  if limit and (held > share * limit or limit < need):
    logging.warning("after %s this process holds %d memory maps of vm.max_map_count=%d (XLA:CPU maps three "
                    "pages per compiled kernel); a run that compiles more aborts past it: raise the limit "
                    "(sysctl -w vm.max_map_count=%d) or compile fewer programs (model.overrides.scan_layers=True)",
                    after, held, limit, max(need, 4 * limit))
