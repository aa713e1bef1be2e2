"""Held-out learning curves of finished runs, in one plot: each run's `curve` (summary.json; eval.every
evaluates during training) as held-out pass@1 against the steps trained.

  python -m launch.curves --runs=runs/smollm2,runs/smollm2_distill --out=curves.png

The plot needs matplotlib (`pip install -e ".[plot]"`). The last output line is one JSON object:
{"out", "curves": {workdir: {"step": [...], "pass1": [...], "algorithm"}}}.
"""

import json
import os
import sys

from absl import app, flags

from launch.flags_util import define_out, parse_or_exit

RUNS = flags.DEFINE_list("runs", None, "Workdirs of finished runs (each holds summary.json).", required=True)
OUT = define_out("The plot (a .png or .svg file).")


def _curve(workdir: str) -> dict:
  """The run's curve and algorithm, or a ValueError naming what is missing."""
  path = os.path.join(workdir, "summary.json")
  try:
    with open(path) as f:
      summary = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: {e}") from None
  if "curve" not in summary:
    raise ValueError(f"{path} has no held-out curve (a run that finished; eval.every adds points between)")
  return {**summary["curve"], "algorithm": summary.get("algorithm", "?")}


def main(argv):
  del argv
  try:
    curves = {w: _curve(w) for w in RUNS.value}
  except ValueError as e:
    print(f"rlax: curves: {e}", file=sys.stderr)
    sys.exit(1)
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print('rlax: curves: the plot needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
    sys.exit(1)
  fig, ax = plt.subplots(figsize=(6, 4))
  for w, c in curves.items():
    ax.plot(c["step"], c["pass1"], marker="o", label=f"{os.path.basename(os.path.normpath(w))} ({c['algorithm']})")
  ax.set(xlabel="steps trained", ylabel="held-out pass@1", ylim=(0, 1))
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(OUT.value)
  print(json.dumps({"out": OUT.value, "curves": curves}))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
