"""Eight fake CPU devices for every test: set once, before any JAX operation.

Compiled programs go to a persistent cache shared by the test workers and the subprocesses they start:
most tests build the same tiny controller, and recompiling it dominated the suite's time. LLVM's optimizations
are off for the same reason.
"""

import getpass
import os
import tempfile

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"rlax-tests-jax-cache-{getpass.getuser()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

DEVICES = 8  # fake CPU devices: this process's and, unless XLA_FLAGS sets a count, its subprocesses'
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={DEVICES}"
# Tiny models: compiling, not running, is the suite's time. Without LLVM's optimizations, compile-heavy tests took
# 0.82x as long from a cold cache and the 150-step learning test 0.88x (2026-12-07).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)
jax.config.update("jax_platforms", "cpu")

import gc  # noqa: E402

import pytest  # noqa: E402

from rlax import allocator  # noqa: E402


@pytest.fixture
def own_devices_env() -> dict:
  """The environment for a job whose processes set their own CPU device count: the suite's XLA flags without
  the device count (the rest keep them compiling as this process does, so results compare bit for bit)."""
  flags = [f for f in os.environ["XLA_FLAGS"].split() if "xla_force_host_platform_device_count" not in f]
  return {**os.environ, "XLA_FLAGS": " ".join(flags)}


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """A worker keeps every module's compiled programs; XLA:CPU maps three pages per kernel, and a process past
  vm.max_map_count aborts (a crashed worker). When a module ends with a third of the limit held, the compiled
  programs are dropped (the persistent cache makes a later recompile a load from disk)."""
  yield
  held, limit = allocator.memory_maps()
  if held > limit / 3:
    jax.clear_caches()
    gc.collect()
