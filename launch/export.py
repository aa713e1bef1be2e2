"""Exports a run's checkpoint as a Hugging Face model directory (transformers / vLLM load it as is).

  python -m launch.export --workdir=runs/demo --out=/tmp/demo_hf            # the newest checkpoint
  python -m launch.export --workdir=runs/demo --out=/tmp/demo_hf --step=200 --dtype=bfloat16
  python -m launch.export --workdir=runs/lora --out=/tmp/adapter --lora=adapter    # a LoRA run: PEFT adapters

Runs on the host's CPU (a training job may hold the accelerators). The last output line is one JSON
object: {"step", "export_dir", "files"}.
"""

import json
import sys

from absl import app, flags, logging

from launch.flags_util import define_out, define_step, define_workdir, parse_or_exit

WORKDIR = define_workdir(None, "The run's workdir (it holds checkpoints/<step>).")
OUT = define_out("Export directory (an earlier export there is replaced).")
STEP = define_step("Checkpoint step to export (default: the newest).")
DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                          "Tensor dtype of the export (default: the run's parameter dtype).")
LORA = flags.DEFINE_enum("lora", "merged", ["merged", "adapter"],
                         "A LoRA run: the base with the adapters merged (an HF directory), or the adapters alone "
                         "(a PEFT directory: adapter_config.json, adapter_model.safetensors).")


def main(argv):
  del argv
  import jax
  jax.config.update("jax_platforms", "cpu")  # before the first JAX operation: leave accelerators to training
  from rlax.export import export_checkpoint
  # orbax logs every file operation at INFO and warns that it opened the directory read-only (as asked).
  logging.get_absl_handler().addFilter(
      lambda r: "orbax" not in r.pathname or (r.levelno >= logging.converter.STANDARD_WARNING
                                              and "read only" not in r.getMessage().replace("_", " ")))
  try:
    result = export_checkpoint(WORKDIR.value, OUT.value, STEP.value, dtype=DTYPE.value, lora=LORA.value)
  except ValueError as e:
    print(f"rlax: export: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
