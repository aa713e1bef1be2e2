"""W2 benchmark: one GRPO update (k3 KL, beta 0.04) = reference log-probs + forward/backward + AdamW.

    python bench/trainer.py                      # W2: W1 model, 16 prompts x 8 samples, 32 + 64 tokens
    python bench/trainer.py --d_model 1024 --mlp 4096 --heads 16 --kv_heads 8 --vocab 8192   # compute-bound
    python bench/trainer.py --workload=w7        # long-tailed responses: packed vs padded rows, same run
    python bench/trainer.py --workload=chat      # SmolLM2-135M shape, 8 x 8, prompts ~156, answers ~24

W7: 8 prompts x 8 samples, 32-token prompts, responses with W4's lengths (log-normal, median 64, sigma 1,
clipped to [8, 1024]), padded to 1024. chat: the W5 shape, prompts of 120-192 tokens (mean 156, padded to
192), answers of 16-32 tokens (mean 24, padded to 32), micro_batch_tokens 2048. Both time the packed step
(optimizer.pack_tokens, the padded row length; a group's responses share one prompt copy) and, alternating
in the same run, the padded step (--compare_padded); `real_tokens` counts prompt + response tokens.

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
import numpy as np
from absl import app, flags

import workload

from rlax import models as M
from rlax.allocator import set_up, using_tcmalloc
from rlax.algorithms import get_algorithm
from rlax.rollout import packing
from rlax.trainer import OptimizerConfig, RolloutBatch, Trainer, response_loss_mask

flags.DEFINE_integer("reps", 5, "timed repetitions (after one warm-up)")
flags.DEFINE_integer("micro_batches", 1, "gradient-accumulation micro-batches (at least)")
flags.DEFINE_integer("micro_batch_tokens", 4096, "more micro-batches until each device holds at most this many "
                     "tokens per micro-batch (0: off)")
flags.DEFINE_integer("chunk", 256, "sequence chunk of the log-prob computation")
flags.DEFINE_integer("matmul_n", 2048, "size of the square f32 matmul that measures the machine's peak")
flags.DEFINE_integer("devices", 1, "CPU devices of a data-parallel trainer mesh (batch rows split over them)")
flags.DEFINE_enum("workload", "w2", ["w2", "w7", "chat"], "w2: fixed lengths; w7: long-tailed responses; chat: "
                  "SmolLM2-shape multi-turn prompts (see the module doc)")
flags.DEFINE_bool("pack", False, "w2: train on packed rows (w7 and chat always time them)")
flags.DEFINE_integer("pack_tokens", -1, "packed row length (-1: as the runtime chooses, "
                     "rlax.rollout.packing.auto_row_lens)")
flags.DEFINE_bool("share_prompts", True, "packed rows: a group's responses attend to one copy of its prompt")
flags.DEFINE_bool("compare_padded", True, "w7/chat: also time the padded step, alternating in the same run")
FLAGS = flags.FLAGS


def step_flops(cfg: M.ModelConfig, batch: int, seq: int, prompt_len: int = 0) -> float:
  """Analytic matmul FLOPs of ref forward + policy forward/backward (formula in the module doc).

  With prompt_len P the step computes the last layer's queries, output projection and MLP, and the
  logits, only from position s = P-1 on; the count follows what is computed.
  """
  d, h, k, dh, f, v, l = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.active_mlp_dim,
                          cfg.vocab_size, cfg.n_layers)
  s = max(prompt_len - 1, 0)
  q_rows = seq - s
  layer = lambda rows: rows * 2 * (2 * d * h * dh + 2 * d * k * dh + 3 * d * f) + 4 * rows * seq * h * dh
  last = seq * 2 * (2 * d * k * dh) + q_rows * 2 * (2 * d * h * dh + 3 * d * f) + 4 * q_rows * seq * h * dh
  fwd = (l - 1) * layer(seq) + last + 2 * d * v * (seq - 1 - s)
  return 4.0 * fwd * batch


def real_token_flops(cfg: M.ModelConfig, batch: RolloutBatch, shared: bool) -> float:
  """Matmul FLOPs of ref forward + policy forward/backward on the real tokens only (each shared prompt once when
  `shared`): 2 N_mm per token minus the lm head, plus the lm head on scored tokens, times 4 (module doc)."""
  mask = np.asarray(batch.input_mask)
  P = batch.prompt_len
  prompt = mask[:, :P].sum(1)
  resp = mask[:, P:].sum(1)
  groups = np.asarray(batch.group_ids)
  n_prompt = sum(prompt[groups == g][0] for g in np.unique(groups)) if shared else prompt.sum()
  tokens = n_prompt + resp.sum()
  trunk = workload.matmul_params(cfg) - cfg.d_model * cfg.vocab_size
  return 4.0 * (2 * trunk * tokens + 2 * cfg.d_model * cfg.vocab_size * resp.sum())


def make_batch(cfg, params, prompts, prompt_len, samples, new_tokens, prompt_lens=None, resp_lens=None):
  """W2's batch (every row full, distinct random prompts), or with per-prompt prompt lengths and per-row
  response lengths: a group's rows then share their prompt, left-padded, responses right-padded (numpy)."""
  rng = np.random.default_rng(0)
  B, T = prompts * samples, prompt_len + new_tokens
  tokens = rng.integers(3, cfg.vocab_size, (B, T)).astype(np.int32)
  tokens[:, 0] = 1
  input_mask = np.ones((B, T), bool)
  if prompt_lens is not None:
    for g, p in enumerate(prompt_lens):
      rows = slice(g * samples, (g + 1) * samples)
      tokens[rows, :prompt_len] = tokens[g * samples, :prompt_len]
      input_mask[rows, :prompt_len - p] = False
      tokens[rows, prompt_len - p] = 1
  if resp_lens is not None:
    for b, n in enumerate(resp_lens):
      input_mask[b, prompt_len + n:] = False
  tokens[~input_mask] = 0
  lp = jax.jit(lambda p, t, m: M.token_logprobs(p, cfg, t, input_mask=m, start=prompt_len - 1))
  loss_mask = response_loss_mask(input_mask, prompt_len)
  behaviour = np.asarray(lp(params, tokens, input_mask)) * loss_mask
  return RolloutBatch(tokens=tokens, input_mask=input_mask, loss_mask=loss_mask, behaviour_logprobs=behaviour,
                      rewards=rng.integers(0, 2, B).astype(np.float32), versions=np.zeros(B, np.int32),
                      group_ids=(np.arange(B) // samples).astype(np.int32), prompt_len=prompt_len)


def workload_batch(cfg, params):
  """The flags' batch: W2's, or W7's / chat's lengths (module doc)."""
  F = FLAGS
  if F.workload == "w2":
    return make_batch(cfg, params, F.prompts, F.prompt_len, F.samples, F.new_tokens)
  rng = np.random.default_rng(1)
  if F.workload == "w7":
    resp = workload.w4_limits(F.prompts * F.samples)
    return make_batch(cfg, params, F.prompts, F.prompt_len, F.samples, 1024, prompt_lens=[F.prompt_len] * F.prompts,
                      resp_lens=resp)
  return make_batch(cfg, params, F.prompts, F.prompt_len, F.samples, F.new_tokens,
                    prompt_lens=rng.integers(120, 193, F.prompts), resp_lens=rng.integers(16, 33, F.prompts * F.samples))


def _defaults() -> None:
  """W7's and chat's shapes and batch, unless given on the command line."""
  F = FLAGS
  if F.workload == "w2":
    return
  if F.workload == "chat":
    workload.use_w5()
  want = dict(prompts=8, samples=8) if F.workload == "w7" else dict(prompts=8, samples=8, prompt_len=192,
                                                                    new_tokens=32, micro_batch_tokens=2048)
  for name, value in want.items():
    if not F[name].present:
      F[name].value = value


def main(_):
  set_up()
  _defaults()
  if FLAGS.devices > 1:
    jax.config.update("jax_num_cpu_devices", FLAGS.devices)  # before the first JAX operation
  mesh = (M.make_mesh(jax.devices()[:FLAGS.devices], data=FLAGS.devices, fsdp=1, tensor=1)
          if FLAGS.devices > 1 else None)
  cfg = workload.model_config()
  params = M.create_params(cfg, seed=0)
  ref_params = M.create_params(cfg, mesh, seed=0)
  padded = workload_batch(cfg, params)
  B, T = padded.tokens.shape
  trainer = Trainer(cfg, get_algorithm("grpo", kl_coef=0.04, kl_estimator="k3"), OptimizerConfig(lr=1e-5),
                    mesh, group_size=FLAGS.samples, micro_batches=FLAGS.micro_batches,
                    micro_batch_tokens=FLAGS.micro_batch_tokens, logprob_chunk=FLAGS.chunk)
  state = trainer.init_state(params)
  row_lens = (packing.auto_row_lens(cfg, FLAGS.prompt_len, T - FLAGS.prompt_len, FLAGS.samples, FLAGS.share_prompts)
              if FLAGS.pack_tokens == -1 else FLAGS.pack_tokens)
  packed = packing.for_trainer(padded, trainer, row_lens, FLAGS.share_prompts)
  real = int(np.asarray(padded.input_mask).sum())
  kept = isinstance(packed, RolloutBatch)  # nothing to drop: the runtime keeps such a batch padded
  layouts = {"packed": packed} if (FLAGS.workload != "w2" or FLAGS.pack) and not kept else {}
  if FLAGS.workload == "w2" or FLAGS.compare_padded:
    layouts["padded"] = padded

  def one(state, host_batch):
    b = trainer.place(host_batch)  # the one host -> device crossing, timed as the runtime pays it
    b = b.replace(ref_logprobs=trainer.ref_logprobs(ref_params, b))
    state, metrics = trainer.step(state, b)
    jax.block_until_ready((state, metrics))
    return state, metrics

  first, times, loss = {}, {k: [] for k in layouts}, {}
  for k, b in layouts.items():
    t = time.perf_counter()
    state, metrics = one(state, b)
    first[k] = time.perf_counter() - t
  for rep in range(FLAGS.reps):
    for k, b in layouts.items():  # alternating: both layouts see the same host conditions
      t = time.perf_counter()
      state, metrics = one(state, b)
      times[k].append(time.perf_counter() - t)
      loss[k] = float(metrics["loss"])
      print(f"rep {rep + 1} {k}: {times[k][-1]:.3f} s  loss {loss[k]:.5f}  kl {float(metrics['kl']):.2e}")
  peak = workload.matmul_flops_per_s(FLAGS.matmul_n)
  med = {k: statistics.median(v) for k, v in times.items()}
  step_s = med.get("padded", med.get("packed"))
  out = {"workload": FLAGS.workload, "params": cfg.num_params(), "batch": B, "seq": T, "real_tokens": real,
         "step_s": round(step_s, 4), "first_step_s": round(first.get("padded", first.get("packed")), 3),
         "tokens_per_s": round(B * T / step_s, 1), "matmul_peak_flops_per_s": round(peak, 1),
         "micro_batches": trainer.num_micro_batches(B, T), "devices": FLAGS.devices, "tcmalloc": using_tcmalloc(),
         "backend": jax.default_backend(), "packing": "kept padded" if kept else "packed"}
  if "padded" in med:
    flops = step_flops(cfg, B, T, FLAGS.prompt_len)
    out.update(padded_step_s=round(med["padded"], 4), flops_per_step=flops, flops_per_s=round(flops / med["padded"], 1),
               flops_ratio=round(flops / med["padded"] / peak, 4))
  if "packed" in med:
    R, L = packed.tokens.shape
    real_flops = real_token_flops(cfg, padded, FLAGS.share_prompts)
    out.update(packed_step_s=round(med["packed"], 4), packed_first_step_s=round(first["packed"], 3),
               packed_rows=R, packed_row_len=L, packed_slots=int(packed.score_index.shape[1]),
               packed_fill=round(int((np.asarray(packed.segment_ids) > 0).sum()) / (R * L), 4),
               packed_micro_batches=trainer.num_micro_batches(R, L), real_token_flops=real_flops,
               packed_real_flops_ratio=round(real_flops / med["packed"] / peak, 4))
  if len(med) == 2:
    out["packed_over_padded"] = round(med["packed"] / med["padded"], 4)
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
