"""XManager launcher (optional `xmanager` extra): runs a config, or a sweep of one field, as local jobs.

  pip install -e ".[xmanager]"      # in its own venv: it pulls ~100 packages and downgrades protobuf
  python -m launch.xm_launch --config=configs/demo.py --sweep=optimizer.lr=1e-3,3e-3

Each job is `python -m launch.main --config=<config> [--config.<field>=<value> ...]` (the overrides given
here, plus the swept field) on xmanager's local executor (`xm_local.Local`, a local binary: no Docker, no
Bazel). Cloud executors take the same `xm.Job`s; for TPU slices see the README's "Scaling past one machine"
(`python -m launch.tpu` prints those commands directly).
"""

import sys

from absl import app, flags

from launch.flags_util import DEMO_CONFIG, config_args, define_config, parse_or_exit

CONFIG = define_config(DEMO_CONFIG)
SWEEP = flags.DEFINE_string("sweep", "", "field=v1,v2,...: one job per value (empty: one job).")
TITLE = flags.DEFINE_string("title", "rlax", "Experiment title.")


def job_args(config: str, sweep: str, overrides: dict[str, str] | None = None) -> list[dict]:
  """Flag dicts of the jobs: [{'config': ..., **overrides}] or one per sweep value with its override added."""
  base = {"config": config, **(overrides or {})}
  if not sweep:
    return [base]
  field, sep, values = sweep.partition("=")
  if not sep or not field or not values:
    raise ValueError(f"--sweep={sweep!r} is not 'field=v1,v2,...'")
  return [{**base, f"config.{field}": v} for v in values.split(",")]


def main(argv):
  del argv
  try:
    from xmanager import xm, xm_local  # pytype: disable=import-error
  except ImportError:
    print("rlax: xm_launch: xmanager is not installed; install the optional extra in its own venv: "
          "pip install -e '.[xmanager]'", file=sys.stderr)
    sys.exit(2)
  args = config_args()
  try:
    jobs = job_args(args.pop("config"), SWEEP.value, args)
  except ValueError as e:
    print(f"rlax: xm_launch: {e}", file=sys.stderr)
    sys.exit(2)
  with xm_local.create_experiment(experiment_title=TITLE.value) as experiment:
    [executable] = experiment.package([xm.binary(path=sys.executable, args=["-m", "launch.main"],
                                                 executor_spec=xm_local.Local.Spec())])
    for job in jobs:
      experiment.add(xm.Job(executable=executable, executor=xm_local.Local(), args=job))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
