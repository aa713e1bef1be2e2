"""Writes N synthetic problems to JSONL or Parquet, optionally deduplicated and decontaminated.

  python -m launch.make_data --task=arithmetic --n=200 --seed=1 --out=/tmp/eval.jsonl
  python -m launch.make_data --task=countdown --n=200 --out=/tmp/train.parquet   # needs pyarrow
  python -m launch.make_data --task=reasoning_gym:leg_counting=1,arithmetic=1 --n=200 --out=/tmp/mix.jsonl
  python -m launch.make_data --task=arithmetic --difficulty=2 --dedup --decontaminate=/tmp/eval.jsonl --out=/tmp/a.jsonl
  python -m launch.make_data --task=entities --split=eval --n=64 --out=/tmp/qa_eval.jsonl   # held-out facts only
"""

import sys

from absl import app
from absl import flags
from absl import logging

from launch.flags_util import define_out, define_task, parse_or_exit
from rlax.data import curation
from rlax.data import records as records_lib
from rlax.data import synthetic

_TASK = define_task("arithmetic", f"Task: one of {', '.join(sorted(synthetic.GENERATORS))}, "
                    "reasoning_gym:<dataset>, or a weighted mixture a=2,b=1.")
_OPTIONS = flags.DEFINE_string("task_options", "", "JSON options of the task (reasoning-gym dataset config).")
_N = flags.DEFINE_integer("n", 1000, "Number of problems.", lower_bound=1)
_DIFFICULTY = flags.DEFINE_integer("difficulty", 1, "Task difficulty (>= 1).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Generator seed.")
_OUT = define_out("Output path: .jsonl, or .parquet (needs pyarrow).")
_DEDUP = flags.DEFINE_bool("dedup", False, "Drop exact and near-duplicate prompts.")
_DECON = flags.DEFINE_string("decontaminate", None, "Eval .jsonl whose prompts must not leak.")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "eval"], "Which records: a task with a held-out split "
                           "(entities) asks its eval records about facts its train records never ask.")


def main(argv):
  del argv
  try:
    recs = synthetic.generate(_TASK.value, _N.value, difficulty=_DIFFICULTY.value, seed=_SEED.value,
                              options=_OPTIONS.value, split=_SPLIT.value)
    if _DEDUP.value:
      recs, _ = curation.exact_dedup(recs)
      recs, _ = curation.near_dedup(recs)
    if _DECON.value:
      evals = records_lib.read_records(_DECON.value)
      recs, _ = curation.decontaminate(recs, [r.prompt for r in evals])
    n = records_lib.write_records(recs, _OUT.value)
  except (ValueError, OSError) as e:  # a bad --out or --decontaminate file: one line, no traceback
    print(f"make_data: {e}", file=sys.stderr)
    sys.exit(2)
  logging.info("wrote %d %s problems to %s", n, _TASK.value, _OUT.value)
  print(f"wrote {n} records to {_OUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
