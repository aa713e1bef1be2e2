"""The `plan` config section, read by ahead-of-time planning only (rlax.planning, launch.plan, launch.tpu).

Its own module so that loading a config does not import the planner (jax's compile-only TPU topologies)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """Ahead-of-time planning only: the target topology and the chip's figures (see launch.plan). The defaults
  are v5p's published per-chip figures; the ICI and DCN ones are assumptions (README: "Scaling past one
  machine")."""
  topology: str = "local"         # a get_topology_desc string ("v5p:8x8x8"), or "local": this machine's devices
  num_slices: int = 1
  chip: str = "v5p"
  hbm_gib: float = 95.0
  peak_tflops: float = 459.0      # bf16
  hbm_tb_s: float = 2.76
  ici_gb_s: float = 300.0         # per chip, one direction (half of the published 4800 Gbps bidirectional)
  dcn_gb_s: float = 6.25          # per chip: a 200 Gbps NIC per 4-chip host / 4
  programs: str = ""              # comma-separated program names to compile (rlax.planning.PROGRAMS); "" = all

  def validate(self) -> "PlanConfig":
    # `programs` names are checked against the planner's list where it compiles (rlax.planning.selected_programs).
    for name in ("num_slices", "hbm_gib", "peak_tflops", "hbm_tb_s", "ici_gb_s", "dcn_gb_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"plan.{name}={getattr(self, name)!r} must be > 0")
    return self
