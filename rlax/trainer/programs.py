"""Programs compiled ahead of time, looked up by the abstract signature of their arguments.

A jitted step compiles on the first call of each new argument shape, in the middle of a run. The trainer
compiles the run's programs up front instead (`Trainer.compile_ahead`, from the resolved run's shapes) and
calls them through this table; an argument signature the table lacks falls back to the jitted function and
counts as a compile (rlax.run.compiles), which a run after warm-up must not see.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import jax


def signature(args: Any) -> tuple:
  """What a compiled program is specialized to: tree structure, shapes, dtypes and shardings of `args`
  (arrays or ShapeDtypeStructs)."""
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves)


class CompiledTable:
  """signature → jax.stages.Compiled, filled ahead (possibly from another thread) and read by the step."""

  def __init__(self):
    self._table: dict = {}
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._table)

  def add(self, abstract_args: tuple, lowered: jax.stages.Lowered, static: Any = None) -> None:
    """Compiles `lowered` (the program of `abstract_args` and the static arguments `static`) and files it."""
    compiled = lowered.compile()
    with self._lock:
      self._table[static, signature(abstract_args)] = compiled

  def call(self, fallback: Callable, *args, static: Any = None) -> Any:
    """The compiled program for `args` (and `static`) if there is one, else `fallback(*args)` (jitted)."""
    with self._lock:
      compiled: Optional[jax.stages.Compiled] = self._table.get((static, signature(args)))
    return (compiled or fallback)(*args)
