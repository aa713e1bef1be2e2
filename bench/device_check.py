"""Accelerator check: SmolLM2-135M-Instruct in bf16 on one device; the last output line is one JSON object.

    bash bench/device_check.sh                                    # installs, finds the model, runs this
    python bench/device_check.py --model_dir=~/.cache/smollm2-135m-instruct
    python bench/device_check.py --small                          # the W1 shape, random weights (CPU's default)

Decode: the Sampler generates --prompts x --samples rows of --new_tokens tokens (no EOS, so every row runs to
the limit); decode time = a whole `generate` minus one whose rows stop after 1 token (prefill), medians of
--reps (`workload.median_time`). Its HBM traffic per step is the matmul weights (`workload.matmul_params`)
plus the KV cache filled so far, averaged over the steps; hbm_bw_share = that x steps/s / the peak bandwidth.
Train: one GRPO update (k3 KL, as bench/trainer.py: reference log-probs + step) on the sampled rows;
train_mfu = `trainer.step_flops` (6 N per token for the policy's forward and backward, 2 N for the reference
forward, attention as computed) / step time / peak bf16 FLOP/s. logp_diff_mean / max: |sampler behaviour
log-prob - trainer log-prob| per response token, from the first update, at the sampler's weights.
Peaks are per device kind (PEAKS); an unknown kind (or CPU) reports null shares.
"""

import json
import os

from absl import app, flags

import trainer as bench_trainer  # bench/trainer.py: its flags (reps, chunk, micro_batch_tokens) and step_flops
import workload

flags.DEFINE_string("model_dir", "~/.cache/smollm2-135m-instruct", "HF directory of SmolLM2-135M-Instruct; "
                    "missing: a random init of its shape")
flags.DEFINE_bool("small", None, "the W1 shape with random weights and a small batch (default: on CPU only)")
FLAGS = flags.FLAGS

# Peak HBM bytes/s and dense bf16 FLOP/s per device kind (first match of a lower-cased substring wins).
PEAKS = (("h200", 4.8e12, 989e12), ("h100", 3.35e12, 989e12), ("a100-sxm4-80gb", 2.0e12, 312e12),
         ("a100 80gb", 2.0e12, 312e12), ("tpu v5p", 2.76e12, 459e12), ("tpu v5 lite", 0.82e12, 197e12),
         ("tpu v5e", 0.82e12, 197e12), ("tpu v6 lite", 1.64e12, 918e12), ("tpu v6e", 1.64e12, 918e12))
ACCEL = dict(prompts=8, samples=8, prompt_len=64, new_tokens=128, reps=3)   # 64 rows x 128 new tokens
SMALL = dict(prompts=4, samples=4, prompt_len=16, new_tokens=16, reps=2)


def peaks(kind: str):
  """(HBM bytes/s, bf16 FLOP/s) of a device kind, or (None, None)."""
  kind = kind.lower()
  return next(((bw, fl) for key, bw, fl in PEAKS if key in kind), (None, None))


def _defaults(small: bool) -> None:
  for name, value in (SMALL if small else ACCEL).items():
    if not FLAGS[name].present:
      FLAGS[name].value = value


def load_model(small: bool):
  """(ModelConfig, params, where they come from), bf16 params and compute."""
  from rlax import models as M
  from rlax.models import hf
  model_dir = os.path.expanduser(FLAGS.model_dir or "")
  if not small and model_dir and os.path.isfile(os.path.join(model_dir, "config.json")):
    cfg, params = hf.load_checkpoint(model_dir, dtype="bfloat16")
    return cfg, params, model_dir
  if small:
    source = "random init, W1 shape (--small)"
  else:
    workload.use_w5()  # SmolLM2's shape; it ties its embeddings
    source = f"random init, SmolLM2-135M shape (no model at {model_dir or '--model_dir'})"
  cfg = workload.model_config().replace(param_dtype="bfloat16", dtype="bfloat16", tie_embeddings=not small)
  return cfg, M.create_params(cfg, seed=0), source


def kv_bytes_per_step(cfg, rows: int, prompt_len: int, new_tokens: int) -> float:
  """KV cache bytes a decode step reads, averaged over the steps: K and V of every filled position."""
  import numpy as np
  mean_pos = prompt_len + (new_tokens - 1) / 2
  per_pos = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize
  return rows * mean_pos * per_pos


def decode(cfg, params, prompts):
  """(SampleOutput of one timed call, generate seconds, prefill seconds) of the median runs."""
  import jax
  from rlax import sampler as S
  rows, n_new = len(prompts) * FLAGS.samples, FLAGS.new_tokens
  engine = S.Sampler(cfg, max_prompt_len=FLAGS.prompt_len, max_new_tokens=n_new, slots=rows, decode_chunk=n_new,
                     params=params)
  seed = iter(range(1, 1 << 20))

  def run(limit):
    def call():
      out = engine.generate(prompts, samples_per_prompt=FLAGS.samples, strategy=S.Temperature(1.0), seed=next(seed),
                            max_new_tokens=limit)
      jax.block_until_ready(out.tokens)
      assert int(out.lengths.min()) == limit
      return out
    return call

  total, out = workload.median_time(run(n_new), FLAGS.reps)
  prefill, _ = workload.median_time(run(1), FLAGS.reps)
  return out, total, prefill


def train(cfg, params, out):
  """(first update's metrics, median seconds of ref log-probs + update, the batch) on the sampled rows."""
  import jax
  import numpy as np
  from rlax.algorithms import get_algorithm
  from rlax.rollout import packing
  from rlax.trainer import OptimizerConfig, Trainer
  rewards = np.random.default_rng(0).integers(0, 2, out.tokens.shape[0]).astype(np.float32)
  batch = packing.pack(jax.device_get(out), rewards, FLAGS.prompt_len)
  trainer = Trainer(cfg, get_algorithm("grpo", kl_coef=0.04, kl_estimator="k3"), OptimizerConfig(lr=1e-5), None,
                    group_size=FLAGS.samples, micro_batches=FLAGS.micro_batches,
                    micro_batch_tokens=FLAGS.micro_batch_tokens, logprob_chunk=FLAGS.chunk)
  ref = jax.tree.map(lambda x: x.copy(), params)  # the update donates its state, which may alias `params`
  box = {"state": trainer.init_state(params), "metrics": []}

  def one():
    b = trainer.place(batch)
    b = b.replace(ref_logprobs=trainer.ref_logprobs(ref, b))
    box["state"], metrics = trainer.step(box["state"], b)
    jax.block_until_ready((box["state"], metrics))
    box["metrics"].append(jax.device_get(metrics))

  step_s, _ = workload.median_time(one, FLAGS.reps)
  return box["metrics"][0], step_s, batch


def main(_):
  import jax
  import numpy as np
  dev = jax.devices()[0]
  small = FLAGS.small if FLAGS.small is not None else jax.default_backend() == "cpu"
  _defaults(small)
  cfg, params, source = load_model(small)
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, cfg.vocab_size, FLAGS.prompt_len - 1).tolist() for _ in range(FLAGS.prompts)]
  rows, n_new = FLAGS.prompts * FLAGS.samples, FLAGS.new_tokens
  out, total, prefill = decode(cfg, params, prompts)
  decode_s = max(total - prefill, 1e-9)
  steps_per_s = (n_new - 1) / decode_s
  weight_bytes = workload.matmul_params(cfg) * np.dtype(cfg.jnp_param_dtype).itemsize
  step_bytes = weight_bytes + kv_bytes_per_step(cfg, rows, FLAGS.prompt_len, n_new)
  metrics, step_s, batch = train(cfg, params, out)
  B, T = batch.tokens.shape
  flops = bench_trainer.step_flops(cfg, B, T, FLAGS.prompt_len)
  bw, peak = peaks(dev.device_kind)
  share = lambda x, p: None if p is None else round(x / p, 4)
  print(json.dumps({
      "device_kind": dev.device_kind, "backend": jax.default_backend(), "jax": jax.__version__, "model": source,
      "params": cfg.num_params(), "dtype": cfg.dtype, "small": small, "rows": rows, "prompt_len": FLAGS.prompt_len,
      "new_tokens": n_new, "decode_tokens_per_s": round(rows * steps_per_s, 1),
      "decode_step_ms": round(1e3 / steps_per_s, 3), "generate_tokens_per_s": round(rows * n_new / total, 1),
      "decode_bytes_per_step": round(step_bytes), "peak_hbm_bytes_per_s": bw,
      "hbm_bw_share": share(step_bytes * steps_per_s, bw), "train_step_s": round(step_s, 4),
      "train_tokens_per_s": round(B * T / step_s, 1), "train_flops_per_step": flops, "peak_bf16_flops_per_s": peak,
      "train_mfu": share(flops / step_s, peak), "logp_diff_mean": round(float(metrics["logp_diff_mean"]), 6),
      "logp_diff_max": round(float(metrics["logp_diff_max"]), 6)}))


if __name__ == "__main__":
  app.run(main)
