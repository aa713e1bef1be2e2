"""The resolved run: every decision that gives a shape or a byte count, made once from the typed config and
the topology, and read by the builders, the trainer, the packer, the memory estimate and the planner."""

from rlax.run.compiles import CompileCounter, release_after_compiles
from rlax.run.saves import checkpoint_blocks, host_copy_bytes, largest_array_bytes, save_concurrent_gb
from rlax.run.train import TrainPlan, TrainProgram, row_lengths, train_plan
from rlax.run.weights import versions_kept, versions_replayable
