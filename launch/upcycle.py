"""Sparse upcycling: a dense Hugging Face model directory (Llama → Mixtral, Qwen3 → Qwen3-MoE) whose every MLP
becomes --experts copies of itself behind a fresh router (rlax.models.moe.upcycle), written as an HF directory
with the source's tokenizer. At step 0 it computes the dense model's logits; RL makes the experts differ.

  python -m launch.upcycle ~/.cache/smollm2-135m-instruct --experts=4 --top_k=2 --out=/tmp/smollm2-4x2
  python -m launch.main --config=configs/smollm2.py --config.model.hf_checkpoint=/tmp/smollm2-4x2

The last output line is one JSON object: {"model_dir", "arch", "n_experts", "top_k", "params"}.
"""

import json
import os
import sys

from absl import app, flags, logging

from launch.flags_util import define_out, parse_or_exit

OUT = define_out("Directory of the upcycled model (a new or empty directory).")
EXPERTS = flags.DEFINE_integer("experts", 8, "Experts per layer.")
TOP_K = flags.DEFINE_integer("top_k", 2, "Experts each token goes to (>= 2, so that the router learns).")
ROUTER_STD = flags.DEFINE_float("router_std", 0.02, "Standard deviation of the fresh router's weights.")
ROUTER_SEED = flags.DEFINE_integer("router_seed", 0, "Seed of the router's weights.")


def main(argv):
  if len(argv) != 2:
    print("rlax: upcycle: give one dense HF model directory (python -m launch.upcycle DIR --out=DIR)",
          file=sys.stderr)
    sys.exit(2)
  logging.set_verbosity(logging.WARNING)  # JAX's backend probing is not the user's business
  import jax  # pylint: disable=g-import-not-at-top
  from rlax import export  # pylint: disable=g-import-not-at-top
  from rlax.models import hf, moe  # pylint: disable=g-import-not-at-top
  try:
    cfg, params = hf.load_checkpoint(argv[1])
    cfg, params = moe.upcycle(cfg, params, n_experts=EXPERTS.value, top_k=TOP_K.value,
                              key=jax.random.key(ROUTER_SEED.value), router_std=ROUTER_STD.value)
    out = os.path.abspath(os.path.expanduser(OUT.value))  # --out=~/dir: the shell leaves that ~ alone
    export.export_hf(params, cfg, out, tokenizer_dir=argv[1])
  except (ValueError, FileNotFoundError) as e:
    print(f"rlax: upcycle: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps({"model_dir": out, "arch": cfg.arch, "n_experts": cfg.moe.n_experts,
                    "top_k": cfg.moe.top_k, "params": cfg.num_params()}))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
