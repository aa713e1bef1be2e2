"""XManager launcher (optional `xmanager` extra): runs a config, or a sweep of one field, as local jobs.

  pip install -e ".[xmanager]"      # in its own venv: it pulls ~100 packages and downgrades protobuf
  python -m launch.xm_launch --config=configs/demo.py --sweep=optimizer.lr=1e-3,3e-3

Each job is `python -m launch.main --config=<config> [--config.<field>=<value>]` on xmanager's local
executor (`xm_local.Local`, a local binary: no Docker, no Bazel). Cloud executors take the same
`xm.Job`s; see docs/scale.md for TPU slices (launch/tpu.py prints those commands directly).
"""

import sys

from absl import app, flags

CONFIG = flags.DEFINE_string("config", "configs/demo.py", "Config file for launch.main.")
SWEEP = flags.DEFINE_string("sweep", "", "field=v1,v2,...: one job per value (empty: one job).")
TITLE = flags.DEFINE_string("title", "rlax", "Experiment title.")


def job_args(config: str, sweep: str) -> list[dict]:
  """Flag dicts of the jobs: [{'config': ...}] or one per sweep value with the override added."""
  if not sweep:
    return [{"config": config}]
  field, sep, values = sweep.partition("=")
  if not sep or not field or not values:
    raise ValueError(f"--sweep={sweep!r} is not 'field=v1,v2,...'")
  return [{"config": config, f"config.{field}": v} for v in values.split(",")]


def main(argv):
  del argv
  try:
    from xmanager import xm, xm_local  # pytype: disable=import-error
  except ImportError:
    print("rlax: xm_launch: xmanager is not installed; install the optional extra in its own venv: "
          "pip install -e '.[xmanager]'", file=sys.stderr)
    sys.exit(2)
  try:
    jobs = job_args(CONFIG.value, SWEEP.value)
  except ValueError as e:
    print(f"rlax: xm_launch: {e}", file=sys.stderr)
    sys.exit(2)
  with xm_local.create_experiment(experiment_title=TITLE.value) as experiment:
    [executable] = experiment.package([xm.binary(path=sys.executable, args=["-m", "launch.main"],
                                                 executor_spec=xm_local.Local.Spec())])
    for args in jobs:
      experiment.add(xm.Job(executable=executable, executor=xm_local.Local(), args=args))


if __name__ == "__main__":
  app.run(main)
