"""Sampler/trainer mismatch of a mixture-of-experts policy, with rollout routing replay and without.

    python bench/moe_replay.py --model=~/.cache/smollm2-moe-4x2 --dense=~/.cache/smollm2-135m-instruct \
      --expert_noise=0.05

The sampler (rlax's engine, compute dtype --sampler_dtype: bfloat16 and float32 by default) draws
--samples answers to each of --prompts arithmetic prompts (the SmolLM2 task's, with the model's chat
template); the trainer's forward (float32, the padded layout the trainer runs) scores every sampled token,
replaying the sampler's recorded routes or routing by its own router. Per sampler dtype:

  expert_set_mismatch_tokens: share of fed tokens whose top-k expert set differs between the sampler's
    record and the f32 trainer's own routing in at least one layer; _layer_tokens: the share of
    (token, layer) pairs that differ.
  logp_gap_{replay,none}: mean |trainer log-prob - behaviour log-prob| over sampled tokens;
  kl_{replay,none}: KL(sampler || trainer) on them, the k3 estimator mean(r - 1 - log r), r = p_trainer / p_sampler.
  dense_logp_gap, dense_kl: the same for --dense (a dense model: nothing to replay), the floor replay aims at.
  *_se: standard errors from resampling whole sequences; logp_gap_replay_minus_{none,dense}: the differences
  (paired for none: the same sequences) and theirs.

With replay the trainer's experts are the sampler's by construction: the table measures what remains.

    python bench/moe_replay.py --timing   # what recording and replaying routes cost, on a random small MoE

--timing: a random Qwen3-MoE (d 256, 4 layers, 8 experts top-2, expert MLP 256, vocab 4096): the sampler's
generate with routes recorded against routing_replay="none", and the trainer's forward + backward of the
log-probs with the routes replayed against without, medians of --reps. The last output line is one JSON object.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "~/.cache/smollm2-moe-4x2", "HF directory of the MoE policy")
flags.DEFINE_string("dense", "", "HF directory of a dense model to compare (e.g. the one upcycled)")
flags.DEFINE_list("sampler_dtype", ["bfloat16", "float32"], "sampler compute dtypes to measure")
flags.DEFINE_integer("prompts", 16, "prompts")
flags.DEFINE_integer("samples", 4, "samples per prompt")
flags.DEFINE_integer("new_tokens", 48, "new tokens per sample at most")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_float("expert_noise", 0.0, "multiply each expert's weights by 1 + N(0, this^2) noise (an upcycled "
                   "model's experts are copies: noise makes them differ, as training does)")
flags.DEFINE_boolean("timing", False, "time recording and replay on a random small MoE instead")
flags.DEFINE_integer("reps", 5, "--timing: timed repetitions (median) after a warm-up")
FLAGS = flags.FLAGS
PROMPT_LEN = 48


def _prompts(tok):
  from rlax.data import synthetic
  from rlax.data.prompts import PromptRenderer
  render = PromptRenderer(tok, template="auto", system_prompt="You are a calculator. Reply with the result only.",
                          instruction="{prompt}")
  return render.encode_all(synthetic.generate("arithmetic", FLAGS.prompts, difficulty=1, seed=FLAGS.seed + 1))


def _own_routes(params, cfg, batch):
  """The f32 trainer's own top-k experts [B, T, L, k] at the batch's real tokens (else NO_ROUTE): a forward of
  each row's real tokens."""
  from rlax.models import moe
  from rlax.sampler import step
  from rlax.sampler.params import fuse
  mask = np.asarray(batch.input_mask)
  B, T = mask.shape
  n = mask.sum(1)
  seq = np.zeros((B, int(n.max())), np.int32)
  for b in range(B):
    seq[b, :n[b]] = np.asarray(batch.tokens[b])[mask[b]]
  fwd = jax.jit(lambda p, s, c: step.forward(fuse(p, cfg, stacked=False), cfg, s, jnp.zeros_like(c), c)[3])
  chosen = np.moveaxis(np.asarray(fwd(params, jnp.asarray(seq), jnp.asarray(n, jnp.int32))), 0, 2)  # [B, Tc, L, k]
  out = np.full((B, T, *chosen.shape[2:]), moe.NO_ROUTE, np.uint8)
  for b in range(B):
    out[b, mask[b]] = chosen[b, :n[b]]
  return out


def _gap(params, cfg, batch, replay: bool) -> tuple[np.ndarray, np.ndarray]:
  """Per sampled sequence, the sums over its sampled tokens of |Δ log-prob| and of the k3 KL term, f32 trainer
  against the behaviour log-probs ([2, B]), and its token counts [B]."""
  from rlax.trainer import layouts
  b = batch if replay else batch.replace(routes=None)
  layout = layouts.of(b)
  lp = jax.jit(lambda p, x: layout.logprobs(p, cfg, x, chunk=128, temperature=1.0))(
      params, layout.inputs(jax.tree.map(jnp.asarray, b)))
  m = np.asarray(batch.loss_mask) > 0
  d = np.where(m, np.asarray(lp) - np.asarray(batch.behaviour_logprobs), 0.0)
  return np.stack([np.abs(d).sum(1), (np.exp(d) - 1 - d).sum(1)]), m.sum(1)


def _mean_se(sums: np.ndarray, counts: np.ndarray, seed: int = 0, draws: int = 2000) -> tuple[float, float]:
  """Token-weighted mean of per-sequence `sums` / `counts`, and its standard error from resampling the
  sequences (a sequence's tokens are not independent draws)."""
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(counts), (draws, len(counts)))
  boot = sums[idx].sum(1) / np.maximum(counts[idx].sum(1), 1)
  return float(sums.sum() / max(counts.sum(), 1)), float(boot.std())


def _rollouts(params, cfg, dtype, prompts):
  from rlax import sampler as S
  from rlax.rollout import packing
  sm = S.Sampler(cfg.replace(dtype=dtype), max_prompt_len=PROMPT_LEN, max_new_tokens=FLAGS.new_tokens,
                 slots=FLAGS.prompts * FLAGS.samples, decode_chunk=FLAGS.new_tokens, params=params)
  out = jax.device_get(sm.generate(prompts, samples_per_prompt=FLAGS.samples, strategy=S.Temperature(1.0),
                                   seed=FLAGS.seed))
  return packing.pack(out, np.zeros(out.tokens.shape[0], np.float32), PROMPT_LEN)


def _medians_s(fns: dict, reps: int) -> dict:
  """Median seconds of each callable, timed in turns (a b a b ...) after one warm-up each, so drift in the
  machine's speed falls on all of them alike."""
  import statistics
  import time
  times = {k: [] for k in fns}
  for fn in fns.values():
    fn()
  for _ in range(reps):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def _timing():
  """Sampler generate with routes recorded vs not, and the trainer's log-prob forward + backward with routes
  replayed vs not, on a random small MoE: what replay costs."""
  from rlax import models as M
  from rlax import sampler as S
  from rlax.models.config import MoEConfig
  from rlax.rollout import packing
  from rlax.trainer import layouts
  cfg = M.ModelConfig(4096, 256, 4, 4, 2, 64, 1024, arch="qwen3_moe", qk_norm=True,
                      moe=MoEConfig(n_experts=8, top_k=2, expert_mlp_dim=256))
  params = M.create_params(cfg, seed=0)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, 4096, 32)) for _ in range(16)]
  gens, steps, samplers = {}, {}, {}
  for mode in ("rollout", "none"):
    c = cfg.replace(moe=dataclasses.replace(cfg.moe, routing_replay=mode))
    sm = samplers[mode] = S.Sampler(c, max_prompt_len=32, max_new_tokens=32, slots=64, decode_chunk=32,
                                    params=params)
    gens[f"generate_s_{mode}"] = (lambda sm=sm: jax.block_until_ready(
        sm.generate(prompts, samples_per_prompt=4, strategy=S.Temperature(1.0))))
  batch = packing.pack(jax.device_get(samplers["rollout"].generate(prompts, samples_per_prompt=4)),
                       np.zeros(64, np.float32), 32)
  for replay in (True, False):
    b = jax.tree.map(jnp.asarray, batch if replay else batch.replace(routes=None))
    layout = layouts.of(b)
    loss = lambda p, x, layout=layout: jnp.sum(layout.logprobs(p, cfg, x, chunk=64, temperature=1.0))
    step, x = jax.jit(jax.value_and_grad(loss)), layout.inputs(b)
    steps[f"train_fwd_bwd_s_{'replay' if replay else 'none'}"] = (
        lambda step=step, x=x: jax.block_until_ready(step(params, x)))
  out = {**_medians_s(gens, FLAGS.reps), **_medians_s(steps, FLAGS.reps)}
  out["generate_ratio"] = out["generate_s_rollout"] / out["generate_s_none"]
  out["train_ratio"] = out["train_fwd_bwd_s_replay"] / out["train_fwd_bwd_s_none"]
  out["route_bytes_per_token"] = cfg.n_layers * cfg.moe.top_k
  print(json.dumps(out))


def main(_):
  if FLAGS.timing:
    return _timing()
  from rlax.models import hf, moe
  path = os.path.expanduser(FLAGS.model)
  cfg, params = hf.load_checkpoint(path)
  cfg = cfg.replace(dtype="float32", param_dtype="float32",
                    moe=dataclasses.replace(cfg.moe, routing_replay="rollout"))
  if FLAGS.expert_noise:
    keys = iter(jax.random.split(jax.random.key(FLAGS.seed + 7), 3))
    lay = dict(params["layers"])
    for name in ("experts_gate", "experts_up", "experts_down"):
      lay[name] = lay[name] * (1 + FLAGS.expert_noise * jax.random.normal(next(keys), lay[name].shape))
    params = {**params, "layers": lay}
  prompts = _prompts(hf.load_tokenizer(path))
  dense = None
  if FLAGS.dense:
    dense = hf.load_checkpoint(os.path.expanduser(FLAGS.dense))
    dense = (dense[0].replace(dtype="float32", param_dtype="float32"), dense[1])
  result = {"model": path, "params": cfg.num_params(), "experts": cfg.moe.n_experts, "top_k": cfg.moe.top_k,
            "layers": cfg.n_layers, "route_bytes_per_token": int(np.prod(moe.replayed_routes(cfg))),
            "prompts": FLAGS.prompts, "samples": FLAGS.samples, "expert_noise": FLAGS.expert_noise}
  for dt in FLAGS.sampler_dtype:
    batch = _rollouts(params, cfg, dt, prompts)
    rec = np.asarray(batch.routes)
    own = _own_routes(params, cfg, batch)
    fed = np.all(rec != moe.NO_ROUTE, axis=(2, 3))
    differ = np.any(np.sort(rec, -1) != np.sort(own, -1), axis=-1)[fed]  # [tokens, L]
    row = {"sampled_tokens": int(np.asarray(batch.loss_mask).sum()), "fed_tokens": int(fed.sum()),
           "expert_set_mismatch_tokens": float(differ.any(-1).mean()),
           "expert_set_mismatch_layer_tokens": float(differ.mean())}
    runs = {key: _gap(params, cfg, batch, key == "replay") for key in ("replay", "none")}
    if dense is not None:
      runs["dense"] = _gap(dense[1], dense[0], _rollouts(dense[1], dense[0], dt, prompts), True)
    for key, (sums, counts) in runs.items():
      (gap, gap_se), (kl, kl_se) = _mean_se(sums[0], counts), _mean_se(sums[1], counts)
      name = "dense_" if key == "dense" else ""
      suffix = "" if key == "dense" else f"_{key}"
      row.update({f"{name}logp_gap{suffix}": gap, f"{name}logp_gap{suffix}_se": gap_se,
                  f"{name}kl{suffix}": kl, f"{name}kl{suffix}_se": kl_se})
    # replay and none score the same sequences: their difference is paired
    diff = runs["replay"][0][0] - runs["none"][0][0]
    row["logp_gap_replay_minus_none"], row["logp_gap_replay_minus_none_se"] = _mean_se(diff, runs["replay"][1])
    if dense is not None:  # different sequences: independent errors
      row["logp_gap_replay_minus_dense"] = row["logp_gap_replay"] - row["dense_logp_gap"]
      row["logp_gap_replay_minus_dense_se"] = float(np.hypot(row["logp_gap_replay_se"], row["dense_logp_gap_se"]))
    result[dt] = row
    print(f"sampler {dt}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in row.items()), flush=True)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
