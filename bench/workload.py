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


def matmul_flops_per_s(n: int = 2048, reps: int = 7) -> float:
  """This machine's f32 matmul rate: median FLOP/s of a jitted [n, n] @ [n, n] (the compute limit figures are
  reported against, measured in the same run)."""
  import statistics
  import time
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
  f = jax.jit(jnp.dot)
  f(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n ** 3 / statistics.median(times)


def median_time(fn, reps: int):
  """(seconds, fn's result) of the median of `reps` timed calls of `fn`, after one warm-up call that compiles."""
  import time
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    extra = fn()
    times.append((time.perf_counter() - t0, extra))
  times.sort(key=lambda x: x[0])
  return times[len(times) // 2]


def matmul_params(cfg) -> int:
  """Weights used in matmuls per token: every layer's (ModelConfig.layer_matmul_weights) + the lm head."""
  return cfg.n_layers * cfg.layer_matmul_weights() + cfg.d_model * cfg.vocab_size


def w4_limits(n: int, seed: int = 0):
  """Per-request max new tokens: log-normal, median 64, sigma 1, clipped to [8, 1024] (W4's and W7's)."""
  import numpy as np
  x = np.random.default_rng(seed).lognormal(mean=np.log(64), sigma=1.0, size=n)
  return np.clip(np.round(x), 8, 1024).astype(np.int64)


W5 = dict(vocab=49152, d_model=576, layers=30, heads=9, kv_heads=3, head_dim=64, mlp=1536, prompts=8, samples=8)


def use_w5() -> None:
  """The W5 workload: the SmolLM2-135M shape (random weights), 8 prompts x 8 samples; explicit flags win."""
  for name, value in W5.items():
    if not FLAGS[name].present:
      FLAGS[name].value = value
