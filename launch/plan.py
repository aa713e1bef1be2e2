"""Ahead-of-time plan of a config on its target TPU topology: per-chip memory, FLOPs, time estimates.

  pip install -e ".[tpu]"        # jax[tpu] / libtpu: compiles for TPU without a TPU attached
  python -m launch.plan --config=configs/paper_qwq32b.py
  python -m launch.plan --config=configs/v5p_128.py --config.rollout.slots=128
  python -m launch.plan --config=configs/paper_qwq32b.py:tiny   # the same code path on 8 local CPU devices

Compiles, at the run's own sizes, the runtime's trainer RL steps (each of the run's batch shapes), the sampling
engine's prefill, admission, decode chunk (on TPU the paged layout, with the Pallas paged-attention kernel) and
recompute over the run's slots (rollout.slots) and the trainer → sampler weight push for
`config.plan.topology` x `config.plan.num_slices` and prints a table (rlax.planning lists what it compiles);
the last output line is the table as JSON.
`--config.plan.programs=sampler_decode` (comma-separated names) compiles only those programs. A
program that does not fit the chip's HBM ends the run with one line (exit code 3) naming the program, the
overshoot and the knob to turn.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's SPMD warnings drown the table

from absl import app, logging

from launch.flags_util import apply_cpu_devices, define_config, define_cpu_devices, parse_or_exit

CONFIG = define_config(None)
CPU_DEVICES = define_cpu_devices()  # the devices of plan.topology='local'


def main(argv):
  del argv
  import jax  # after flags: the platform and CPU device count must be set before the first JAX operation
  jax.config.update("jax_platforms", "cpu")  # eager helpers run on CPU; TPU programs are compile-only
  apply_cpu_devices()
  from launch._plan_table import format_table
  from rlax import planning
  logging.set_verbosity(logging.INFO)
  c = CONFIG.value
  if c is None or "plan" not in c:
    print("rlax: plan: the config has no `plan` section (see configs/paper_qwq32b.py)", file=sys.stderr)
    sys.exit(2)
  try:
    table = planning.make_plan(c)
  except planning.PlanError as e:
    print(f"rlax: plan: {e}", file=sys.stderr)
    sys.exit(3)
  except ValueError as e:
    print(f"rlax: plan: bad config: {e}", file=sys.stderr)
    sys.exit(2)
  print(format_table(table))
  print(json.dumps(table))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
