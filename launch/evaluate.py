"""Evaluates a model without training it: pass@1 and pass@k (unbiased), greedy accuracy, mean reward, mean
length and truncation rate, per source, as one JSON line. The numbers are the ones a training run reports
before and after training for the same model, data, samples and seed (the same held-out evaluation).

  python -m launch.evaluate --model=~/models/smollm2 --config=configs/smollm2.py            # its held-out set
  python -m launch.evaluate --model=~/models/smollm2 --data=test.jsonl --config.data.prompt_key=question
  python -m launch.evaluate --config=configs/smollm2.py --checkpoint=runs/smollm2 --n_samples=16  # a run's checkpoint

--config gives the model (unless --model), sampling, reward, chat template and column mapping (default: the
demo config); with --checkpoint it is the config the run trained with.
"""

import json
import sys

from launch import _bootstrap

_bootstrap.ensure_installed()

from absl import app, flags, logging  # noqa: E402

from launch.flags_util import (DEMO_CONFIG, apply_compilation_cache, apply_cpu_devices,  # noqa: E402
                               define_compilation_cache, define_config, define_cpu_devices, define_step,
                               define_task, parse_or_exit, quiet_library_logs)

CONFIG = define_config(DEMO_CONFIG)
CPU_DEVICES = define_cpu_devices()
COMPILATION_CACHE = define_compilation_cache()
MODEL = flags.DEFINE_string("model", None, "A Hugging Face model directory (launch.fetch_model makes one).")
CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A run's workdir: evaluate its newest (or --step) checkpoint.")
STEP = define_step("With --checkpoint: the checkpoint step (default: the newest).")
DATA = flags.DEFINE_string("data", None, "Comma-separated data files or datasets directories: every record.")
TASK = define_task(None, "A task (as data.task): its held-out set as a run draws it.")
N_SAMPLES = flags.DEFINE_integer("n_samples", None, "Samples per prompt (default: the config's eval.n_samples).")
N_PROMPTS = flags.DEFINE_integer("n_prompts", 0, "Evaluate the first N records only (0: all).")
GREEDY = flags.DEFINE_bool("greedy", True, "Also greedy accuracy (one greedy completion per prompt).")


def main(argv):
  del argv
  apply_cpu_devices()  # before the first JAX operation
  apply_compilation_cache()
  logging.set_verbosity(logging.WARNING)
  quiet_library_logs()
  from rlax.evaluation import evaluate_model  # pylint: disable=g-import-not-at-top
  try:
    result = evaluate_model(CONFIG.value, model=MODEL.value, checkpoint=CHECKPOINT.value, step=STEP.value,
                            data=DATA.value, task=TASK.value, n_samples=N_SAMPLES.value, greedy=GREEDY.value,
                            n_prompts=N_PROMPTS.value)
  except ValueError as e:
    print(f"rlax: evaluate: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
