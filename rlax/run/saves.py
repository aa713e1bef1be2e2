"""How a checkpoint save meets training, decided once: read by the run's checkpoints (rlax.runtime.run_state)
and the memory estimate (rlax.memory)."""

from __future__ import annotations

import math
from typing import Optional

import jax

from rlax import models

_STREAM_GB = 0.25  # the host copy a blocking save holds at once, unless one array is larger


def checkpoint_blocks(platform: str) -> bool:
  """True: a save is written before the next train step starts. On CPU devices the train state's host copy
  shares RAM with the step's gradients and activations, so a save running in the background added the copy to
  the run's peak (12.0 GB against 9.9 GB on the SmolLM2 run); accelerators hold those in device memory, so
  their saves run in the background."""
  return platform == "cpu"


def largest_array_bytes(model: models.ModelConfig) -> int:
  """The largest array a run's checkpoint holds (a parameter, its optimizer moments or reference copy) at 4
  bytes an element: orbax writes an array whole."""
  shapes = jax.tree.leaves(models.param_shapes(model), is_leaf=lambda s: isinstance(s, tuple))
  return 4 * max(math.prod(s) for s in shapes)


def save_concurrent_gb(platform: str, largest_bytes: int) -> Optional[float]:
  """GB of the train state a save copies to the host at once (orbax's `save_concurrent_gb`), None for orbax's
  default. A blocking save streams the state in chunks, so its host copy is a chunk: the SmolLM2 run's 1.6 GB
  state added 1.3 GB at a save when copied whole, 0.16 GB in 0.25 GB chunks, in the same time. Orbax refuses an
  array larger than the chunk, so the chunk is at least `largest_bytes` (`largest_array_bytes`). A background
  save copies the whole state before training goes on (the step may donate the buffers)."""
  return max(_STREAM_GB, 1.01 * largest_bytes / 1e9) if checkpoint_blocks(platform) else None


def host_copy_bytes(platform: str, state_bytes: int, largest_bytes: int) -> int:
  """The host bytes a save of `state_bytes` holds at once."""
  gb = save_concurrent_gb(platform, largest_bytes)
  return state_bytes if gb is None else min(state_bytes, int(gb * 1e9))
