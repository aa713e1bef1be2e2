"""How a checkpoint save meets training, decided once: read by the run's checkpoints (rlax.runtime.run_state)
and the memory estimate (rlax.memory)."""

from __future__ import annotations

from typing import Optional

_STREAM_GB = 0.25  # the host copy a blocking save holds at once


def checkpoint_blocks(platform: str) -> bool:
  """True: a save is written before the next train step starts. On CPU devices the train state's host copy
  shares RAM with the step's gradients and activations, so a save running in the background added the copy to
  the run's peak (12.0 GB against 9.9 GB on the SmolLM2 run); accelerators hold those in device memory, so
  their saves run in the background."""
  return platform == "cpu"


def save_concurrent_gb(platform: str) -> Optional[float]:
  """GB of the train state a save copies to the host at once (orbax's `save_concurrent_gb`), None for orbax's
  default. A blocking save streams the state in chunks, so its host copy is a chunk: the SmolLM2 run's 1.6 GB
  state added 1.3 GB at a save when copied whole, 0.16 GB in 0.25 GB chunks, in the same time. A background
  save copies the whole state before training goes on (the step may donate the buffers)."""
  return _STREAM_GB if checkpoint_blocks(platform) else None


def host_copy_bytes(platform: str, state_bytes: int) -> int:
  """The host bytes a save of `state_bytes` holds at once."""
  gb = save_concurrent_gb(platform)
  return state_bytes if gb is None else min(state_bytes, int(gb * 1e9))
