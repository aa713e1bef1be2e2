"""The main job: RL post-training driven by one config.

  python -m launch.main                                   # the demo (configs/demo.py)
  python -m launch.main --config=configs/algorithm.py:dapo --config.controller.steps=200

On CPU the process sees `--cpu_devices` fake devices (default 8), so the
trainer/sampler submesh split runs on any machine. The last output line is one
JSON object with the run's summary (pass@k before/after, wall time).
"""

import json
import os
import sys

from absl import app, flags, logging

from launch.flags_util import define_config, parse_or_exit

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.py")
CONFIG = define_config(_DEFAULT)
CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Fake CPU devices when no accelerator is present.")
PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar on the console.")


def main(argv):
  del argv
  from rlax.allocator import reexec_with_tcmalloc
  reexec_with_tcmalloc()
  import jax  # after flags: the CPU device count must be set before the first JAX operation
  jax.config.update("jax_num_cpu_devices", CPU_DEVICES.value)
  from rlax.multihost import maybe_init_pathways
  if maybe_init_pathways():  # the optional `pathways` extra: one controller for every slice
    logging.info("Pathways initialized")
  from rlax.controller import Controller
  logging.set_verbosity(logging.INFO)
  # orbax logs every file operation at INFO; keep its warnings only.
  logging.get_absl_handler().addFilter(
      lambda r: r.levelno >= logging.converter.STANDARD_WARNING or "orbax" not in r.pathname)
  try:
    controller = Controller(CONFIG.value, progress=PROGRESS.value)
  except ValueError as e:
    print(f"rlax: bad config: {e}", file=sys.stderr)
    sys.exit(2)
  summary = controller.run()
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
