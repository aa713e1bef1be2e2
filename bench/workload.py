"""The model-shape and batch flags every benchmark shares (defaults: workload W1/W2/W3's model and batch).

Benchmarks run as `python bench/<name>.py`, so this module imports as `workload`.
"""

from absl import flags

flags.DEFINE_integer("vocab", 1024, "vocabulary size")
flags.DEFINE_integer("d_model", 256, "model width")
flags.DEFINE_integer("layers", 4, "transformer layers")
flags.DEFINE_integer("heads", 4, "query heads")
flags.DEFINE_integer("kv_heads", 2, "key/value heads")
flags.DEFINE_integer("head_dim", 64, "head dimension")
flags.DEFINE_integer("mlp", 1024, "MLP hidden size")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype (parameters stay float32); "
                  "the peers' workloads are float32")
flags.DEFINE_integer("prompts", 16, "distinct prompts per batch")
flags.DEFINE_integer("prompt_len", 32, "tokens per prompt (BOS + random ids)")
flags.DEFINE_integer("samples", 8, "samples per prompt (group size)")
flags.DEFINE_integer("new_tokens", 64, "tokens generated per sequence")
FLAGS = flags.FLAGS


def model_overrides() -> dict:
  """ModelConfig fields from the shape flags."""
  return dict(vocab_size=FLAGS.vocab, d_model=FLAGS.d_model, n_layers=FLAGS.layers, n_heads=FLAGS.heads,
              n_kv_heads=FLAGS.kv_heads, head_dim=FLAGS.head_dim, mlp_dim=FLAGS.mlp, dtype=FLAGS.dtype)


def model_config():
  from rlax import models as M
  return M.ModelConfig(**model_overrides())
