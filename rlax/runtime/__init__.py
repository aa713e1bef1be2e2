"""The runtime: the controller's thin loop; where a run starts (start), one update (step), the sampler's side
(sampling), the trainer/sampler process handshake (roles), the summary, the run state (checkpoints), preemption,
and failover."""

import importlib

# Loaded on first use, not with the package: rlax.config imports rlax.runtime.config, and the controller
# imports rlax.config, so an eager import here would be a circle.
_LAZY = {"Controller": "rlax.runtime.controller", "NonFiniteError": "rlax.runtime.run_state"}


def __getattr__(name: str):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'rlax.runtime' has no attribute {name!r}")


def __dir__():
  return sorted([*globals(), *_LAZY])
