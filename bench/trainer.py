"""W2 benchmark: one GRPO update (k3 KL, beta 0.04) = reference log-probs + forward/backward + AdamW.

    python bench/trainer.py                      # W2: W1 model, 16 prompts x 8 samples, 32 + 64 tokens
    python bench/trainer.py --d_model 1024 --mlp 4096 --heads 16 --kv_heads 8 --vocab 8192   # compute-bound

Timed per rep: `Trainer.ref_logprobs` + `Trainer.step` (median of --reps after one warm-up that compiles).
In the same run it measures the machine's f32 matmul rate (jnp.dot of --matmul_n cubed, median) and
reports the step's achieved FLOP/s, counting matmul FLOPs analytically:
  F_tok = 2 * N_mm + 4 * L * T * H * Dh        forward FLOPs per token (N_mm: weights used in matmuls =
                                               q,k,v,o,gate,up,down of every layer + lm_head; attention
                                               scores and values over all T positions, as computed)
  flops = 4 * F_tok * B * T                    1x reference forward + 3x policy forward/backward
minus what the step skips: the last layer's q/o/MLP and the logits of the prompt positions before
P-1, which no loss term reads (RolloutBatch.prompt_len; `step_flops` has the exact count).
Micro-batches (--micro_batch_tokens) and tcmalloc (rlax.allocator) are on by default.
The last output line is one JSON object.
"""

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import workload

from rlax import models as M
from rlax.allocator import reexec_with_tcmalloc, using_tcmalloc
from rlax.algorithms import get_algorithm
from rlax.trainer import OptimizerConfig, RolloutBatch, Trainer, response_loss_mask

flags.DEFINE_integer("reps", 5, "timed repetitions (after one warm-up)")
flags.DEFINE_integer("micro_batches", 1, "gradient-accumulation micro-batches (at least)")
flags.DEFINE_integer("micro_batch_tokens", 4096, "more micro-batches until each device holds at most this many "
                     "tokens per micro-batch (0: off)")
flags.DEFINE_integer("chunk", 256, "sequence chunk of the log-prob computation")
flags.DEFINE_integer("matmul_n", 2048, "size of the square f32 matmul that measures the machine's peak")
flags.DEFINE_integer("devices", 1, "CPU devices of a data-parallel trainer mesh (batch rows split over them)")
FLAGS = flags.FLAGS


def step_flops(cfg: M.ModelConfig, batch: int, seq: int, prompt_len: int = 0) -> float:
  """Analytic matmul FLOPs of ref forward + policy forward/backward (formula in the module doc).

  With prompt_len P the step computes the last layer's queries, output projection and MLP, and the
  logits, only from position s = P-1 on; the count follows what is computed.
  """
  d, h, k, dh, f, v, l = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size,
                          cfg.n_layers)
  s = max(prompt_len - 1, 0)
  q_rows = seq - s
  layer = lambda rows: rows * 2 * (2 * d * h * dh + 2 * d * k * dh + 3 * d * f) + 4 * rows * seq * h * dh
  last = seq * 2 * (2 * d * k * dh) + q_rows * 2 * (2 * d * h * dh + 3 * d * f) + 4 * q_rows * seq * h * dh
  fwd = (l - 1) * layer(seq) + last + 2 * d * v * (seq - 1 - s)
  return 4.0 * fwd * batch


def make_batch(cfg, params, prompts, prompt_len, samples, new_tokens):
  rng = np.random.default_rng(0)
  B, T = prompts * samples, prompt_len + new_tokens
  tokens = rng.integers(3, cfg.vocab_size, (B, T)).astype(np.int32)
  tokens[:, 0] = 1
  input_mask = np.ones((B, T), bool)
  tokens = jnp.asarray(tokens)
  behaviour = jax.jit(lambda p, t: M.token_logprobs(p, cfg, t))(params, tokens)
  return RolloutBatch(tokens=tokens, input_mask=jnp.asarray(input_mask),
                      loss_mask=jnp.asarray(response_loss_mask(input_mask, prompt_len)),
                      behaviour_logprobs=behaviour,
                      rewards=jnp.asarray(rng.integers(0, 2, B).astype(np.float32)),
                      versions=jnp.zeros(B, jnp.int32), group_ids=jnp.asarray(np.arange(B) // samples, jnp.int32),
                      prompt_len=prompt_len)


def main(_):
  reexec_with_tcmalloc()
  if FLAGS.devices > 1:
    jax.config.update("jax_num_cpu_devices", FLAGS.devices)  # before the first JAX operation
  mesh = (M.make_mesh(jax.devices()[:FLAGS.devices], data=FLAGS.devices, fsdp=1, tensor=1)
          if FLAGS.devices > 1 else None)
  cfg = workload.model_config()
  params = M.create_params(cfg, seed=0)
  ref_params = M.create_params(cfg, mesh, seed=0)
  batch = make_batch(cfg, params, FLAGS.prompts, FLAGS.prompt_len, FLAGS.samples, FLAGS.new_tokens)
  B, T = batch.tokens.shape
  trainer = Trainer(cfg, get_algorithm("grpo", kl_coef=0.04, kl_estimator="k3"), OptimizerConfig(lr=1e-5),
                    mesh, group_size=FLAGS.samples, micro_batches=FLAGS.micro_batches,
                    micro_batch_tokens=FLAGS.micro_batch_tokens, logprob_chunk=FLAGS.chunk)
  state = trainer.init_state(params)

  def one(state):
    b = batch.replace(ref_logprobs=trainer.ref_logprobs(ref_params, batch))
    state, metrics = trainer.step(state, b)
    jax.block_until_ready((state, metrics))
    return state, metrics

  t = time.perf_counter()
  state, metrics = one(state)
  compile_s = time.perf_counter() - t
  times = []
  for _ in range(FLAGS.reps):
    t = time.perf_counter()
    state, metrics = one(state)
    times.append(time.perf_counter() - t)
    print(f"step {len(times)}: {times[-1]:.3f} s  loss {float(metrics['loss']):.5f}  kl {float(metrics['kl']):.2e}")
  peak = workload.matmul_flops_per_s(FLAGS.matmul_n)
  step_s = statistics.median(times)
  flops = step_flops(cfg, B, T, FLAGS.prompt_len)
  out = {"workload": "w2", "params": cfg.num_params(), "batch": B, "seq": T, "step_s": round(step_s, 4),
         "first_step_s": round(compile_s, 3), "tokens_per_s": round(B * T / step_s, 1),
         "flops_per_step": flops, "flops_per_s": round(flops / step_s, 1),
         "matmul_peak_flops_per_s": round(peak, 1), "flops_ratio": round(flops / step_s / peak, 4),
         "micro_batches": trainer.num_micro_batches(B, T), "devices": FLAGS.devices, "tcmalloc": using_tcmalloc(),
         "backend": jax.default_backend()}
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
