"""Whether a checkpoint save may overlap training, decided once: read by the run's checkpoints
(rlax.runtime.run_state) and the memory estimate (rlax.memory)."""

from __future__ import annotations


def checkpoint_blocks(platform: str) -> bool:
  """True: a save is written before the next train step starts. On CPU devices the train state's host copy
  shares RAM with the step's gradients and activations, so a save running in the background added the copy to
  the run's peak (12.0 GB against 9.9 GB on the SmolLM2 run); accelerators hold those in device memory, so
  their saves run in the background."""
  return platform == "cpu"
