"""LoRA vs full fine-tuning: one GRPO update on the same batch, both ways, alternating in one run.

    python bench/lora.py                 # W2: the W1 model, 16 prompts x 8 samples, 32 + 64 tokens
    python bench/lora.py --w5            # the SmolLM2-135M shape (random weights), 8 x 8
    python bench/lora.py --rank 64 --targets attention

Timed per rep: `Trainer.step` (no KL reference: kl_coef 0, as configs/smollm2.py), full then LoRA, after one
warm-up of each that compiles; medians of --reps. In the same run it measures the machine's f32 matmul
rate. The adapters cut the weight-gradient matmuls (x^T dy for every frozen W) and the AdamW update of
every weight, so the step's matmul FLOPs fall from ~3x forward to ~2x forward.

`--decode`: the sampler's decode with the base's weights against the same engine with a LoRA version merged
into them (B random, so every weight changes), alternating, medians of --reps: the merged weights have the
base's shapes and dtype, so they run the same compiled program; the figure checks they run at its speed.
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
from rlax.algorithms import get_algorithm
from rlax.models import lora as L
from rlax.trainer import OptimizerConfig, RolloutBatch, Trainer, response_loss_mask

flags.DEFINE_integer("reps", 5, "timed repetitions of each (after one warm-up)")
flags.DEFINE_integer("rank", 8, "adapter rank")
flags.DEFINE_string("targets", "all", "adapted layers: all, attention, mlp or names")
flags.DEFINE_integer("micro_batch_tokens", 2048, "tokens per device per micro-batch (0: one micro-batch)")
flags.DEFINE_bool("w5", False, "the SmolLM2-135M shape, 8 prompts x 8 samples")
flags.DEFINE_bool("decode", False, "time the sampler's decode on the base vs merged weights instead")
FLAGS = flags.FLAGS


def _batch(cfg, rng) -> RolloutBatch:
  P, G, T0, N = FLAGS.prompts, FLAGS.samples, FLAGS.prompt_len, FLAGS.new_tokens
  B, T = P * G, T0 + N
  tokens = rng.integers(3, cfg.vocab_size, (B, T)).astype(np.int32)
  for p in range(P):
    tokens[p * G:(p + 1) * G, :T0] = tokens[p * G, :T0]
  mask = np.ones((B, T), bool)
  lm = response_loss_mask(mask, T0)
  return RolloutBatch(tokens=tokens, input_mask=mask, loss_mask=lm, behaviour_logprobs=(-2.0 * lm).astype(np.float32),
                      rewards=rng.integers(0, 2, B).astype(np.float32), versions=np.zeros(B, np.int32),
                      group_ids=(np.arange(B) // G).astype(np.int32), prompt_len=T0)


def _alternate(one, keys) -> tuple[dict, dict]:
  """`one(k)` for each key once (warm-up: compiles), then --reps rounds alternating the keys:
  (times per key, their medians)."""
  for k in keys:
    one(k)
  times = {k: [] for k in keys}
  for _ in range(FLAGS.reps):
    for k in keys:
      times[k].append(one(k))
  return times, {k: statistics.median(v) for k, v in times.items()}


def decode_main(cfg, lora):
  """Tokens/s of one `generate` call on the base's weights and on a merged LoRA version, alternating."""
  from rlax import sampler as S
  base = M.create_params(cfg, seed=0)
  adapters = {"layers": {t: {"a": ab["a"], "b": 0.02 * jax.random.normal(jax.random.key(2), ab["b"].shape)}
                         for t, ab in L.init(cfg, lora, jax.random.key(1))["layers"].items()}}  # B != 0
  merged = jax.jit(lambda b, a: L.merge_to(b, a, lora, cfg.jnp_dtype))(base, adapters)
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, cfg.vocab_size, FLAGS.prompt_len - 1).tolist() for _ in range(FLAGS.prompts)]
  rows, n_new = FLAGS.prompts * FLAGS.samples, FLAGS.new_tokens
  engine = S.Sampler(cfg, max_prompt_len=FLAGS.prompt_len, max_new_tokens=n_new, slots=rows, decode_chunk=n_new,
                     params=base)
  weights = {"base": base, "merged": merged}
  seed = iter(range(1, 1000))

  def one(k):
    t0 = time.perf_counter()
    out = engine.generate(prompts, samples_per_prompt=FLAGS.samples, strategy=S.Temperature(1.0), seed=next(seed),
                          max_new_tokens=n_new, weights=(weights[k], 0 if k == "base" else 1))
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - t0

  times, med = _alternate(one, weights)
  peak = workload.matmul_flops_per_s()
  flops = 2.0 * workload.matmul_params(cfg) * rows * n_new  # the matmul weights once per generated token
  print(json.dumps({
      "workload": "w5" if FLAGS.w5 else "w1", "mode": "decode", "rank": FLAGS.rank, "rows": rows,
      "new_tokens": n_new, "compiles": dict(engine.trace_counts),
      "base_tokens_per_s": round(rows * n_new / med["base"], 1),
      "merged_tokens_per_s": round(rows * n_new / med["merged"], 1),
      "merged_over_base_time": round(med["merged"] / med["base"], 3),
      "base_s_all": [round(x, 4) for x in times["base"]], "merged_s_all": [round(x, 4) for x in times["merged"]],
      "matmul_flops_per_s": peak, "base_share_of_matmul_rate": round(flops / med["base"] / peak, 3),
      "merged_share_of_matmul_rate": round(flops / med["merged"] / peak, 3)}))


def main(argv):
  del argv
  if FLAGS.w5:
    workload.use_w5()
  cfg = workload.model_config()
  lora = L.LoraConfig(rank=FLAGS.rank, alpha=2.0 * FLAGS.rank, targets=L.parse_targets(FLAGS.targets))
  if FLAGS.decode:
    return decode_main(cfg, lora)
  algo = get_algorithm("grpo", kl_coef=0.0)
  batch = _batch(cfg, np.random.default_rng(0))
  params = M.create_params(cfg, seed=0)
  kw = dict(group_size=FLAGS.samples, micro_batch_tokens=FLAGS.micro_batch_tokens)
  trainers = {"full": Trainer(cfg, algo, OptimizerConfig(lr=1e-5), **kw),
              "lora": Trainer(cfg, algo, OptimizerConfig(lr=1e-4), lora=lora, **kw)}
  states = {k: t.init_state(jax.tree.map(jnp.copy, params)) for k, t in trainers.items()}
  placed = trainers["full"].place(batch)

  def one(k):
    t0 = time.perf_counter()
    states[k], m = trainers[k].step(states[k], placed)
    jax.block_until_ready((states[k], m))
    return time.perf_counter() - t0

  times, med = _alternate(one, trainers)
  peak = workload.matmul_flops_per_s()
  fwd = 2.0 * workload.matmul_params(cfg) * batch.tokens.size  # matmul FLOPs of one forward
  print(json.dumps({
      "workload": "w5" if FLAGS.w5 else "w2", "rank": FLAGS.rank, "targets": list(lora.targets),
      "adapter_params": L.count(states["lora"].params),
      "full_step_s": round(med["full"], 4), "lora_step_s": round(med["lora"], 4),
      "lora_over_full": round(med["lora"] / med["full"], 3),
      "full_step_s_all": [round(x, 4) for x in times["full"]], "lora_step_s_all": [round(x, 4) for x in times["lora"]],
      "matmul_flops_per_s": peak, "full_share_of_matmul_rate": round(3 * fwd / med["full"] / peak, 3),
      "lora_share_of_matmul_rate": round(2 * fwd / med["lora"] / peak, 3)}))


if __name__ == "__main__":
  app.run(main)
