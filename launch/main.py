"""The main job: RL post-training driven by one config.

  python -m launch.main                                   # the demo (configs/demo.py)
  python -m launch.main --config=configs/algorithm.py:dapo --config.controller.steps=200

On CPU the process sees `--cpu_devices` fake devices (default 8), so the
trainer/sampler submesh split runs on any machine. The last output line is one
JSON object with the run's summary (pass@k before/after, wall time).

  python -m launch.multihost --num_processes=2 -- python -m launch.main --cpu_devices=4

runs the same job as two processes (one per role; weights cross by a collective push).
"""

import json
import os
import sys
import traceback

from launch import _bootstrap

_bootstrap.ensure_installed()  # a clone not installed yet: `pip install -e .` first, then this command again

from absl import app, flags, logging  # noqa: E402

from launch.flags_util import (DEMO_CONFIG, apply_compilation_cache, apply_cpu_devices,  # noqa: E402
                               define_compilation_cache, define_config, define_cpu_devices, parse_or_exit,
                               quiet_library_logs)

CONFIG = define_config(DEMO_CONFIG)
CPU_DEVICES = define_cpu_devices()
COMPILATION_CACHE = define_compilation_cache()
PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar on the console.")


def main(argv):
  del argv
  from rlax.allocator import set_up
  set_up()
  apply_cpu_devices()  # before the first JAX operation
  apply_compilation_cache()
  from rlax import multihost
  if multihost.ENV_PROCESS_ID in os.environ:  # one process per role under launch.multihost
    multihost.init_from_env(cpu_devices=CPU_DEVICES.value)
  elif multihost.maybe_init_pathways():  # the optional `pathways` extra: one controller for every slice
    logging.info("Pathways initialized")
  import jax
  from rlax.checkpoint import CheckpointError
  from rlax.run import release_after_compiles
  from rlax.runtime import Controller, NonFiniteError
  release_after_compiles()
  if not flags.FLAGS["verbosity"].present:  # one-time facts; per-step details at --verbosity=1
    logging.set_verbosity(logging.INFO)
  quiet_library_logs()
  try:  # rlax.config.load types and validates the config; a relative workdir resolves against the cwd
    controller = Controller(CONFIG.value, progress=PROGRESS.value)
  except ValueError as e:
    print(f"rlax: bad config: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    summary = controller.run()
  except (NonFiniteError, CheckpointError) as e:  # the run stopped on purpose or cannot save: one line
    print(f"rlax: {e}", file=sys.stderr)
    sys.stderr.flush()
    if jax.process_count() > 1:  # see below: no shutdown barrier
      os._exit(1)
    sys.exit(1)
  except BaseException:
    if jax.process_count() == 1:
      raise
    # A peer would wait minutes at JAX's shutdown barrier; exit now so the supervisor restarts the job.
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
  if summary is not None:  # the sampler process of a multi-process job has none
    print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
