"""Sampler throughput vs transformers on the same weights, measured in the same run.

    python bench/sampler.py                       # workload W1 (see bench-peers/README.md)
    python bench/sampler.py --d_model=512 --layers=8 --prompts=8 --samples=4 --reps=3
    python bench/sampler.py --workload=w4         # long-tailed lengths: continuous vs static vs generate_batch

W4: the W1 model, 64 prompts x 4 samples, each request's max new tokens drawn (seed 0) from a log-normal
with median 64 and sigma 1, clipped to [8, 1024] (random weights never stop early, so the limit sets each
length). Useful tokens/s = the requested tokens / wall time, for rlax's continuous engine (`--slots` decode
slots), rlax's static engine (one batch decoded to the longest limit; its useful tokens are the same) and
transformers' continuous batching (`generate_batch`'s manager, one request per row with its own limit).

Reports prefill / decode time and tokens/s (median of --reps after one warm-up
run that includes compilation) for rlax and for `LlamaForCausalLM.generate(
do_sample=True, temperature=1, top_k=0, top_p=1, eos_token_id=None)` with
torch.set_num_threads(2); the last line is one JSON object.
"""

import json
import time

from absl import app, flags

import workload
import numpy as np

flags.DEFINE_integer("reps", 5, "timed repetitions after one warm-up")
flags.DEFINE_boolean("baseline", True, "also time transformers generate()")
flags.DEFINE_enum("workload", "w1", ["w1", "w4"], "w1: fixed lengths; w4: long-tailed per-request lengths")
flags.DEFINE_integer("slots", 64, "W4: decode slots of the continuous engine")
flags.DEFINE_integer("static_reps", -1, "W4: timed runs of the static engine (-1: --reps; one takes minutes on "
                     "2 CPU cores; 0 skips it and its keys)")
flags.DEFINE_integer("chunk", 16, "W4: decode steps between admissions")
flags.DEFINE_integer("devices", 1, "CPU devices for a data-parallel sampler mesh (XLA:CPU runs a small "
                     "matmul on one core; N devices run N row shards concurrently)")
FLAGS = flags.FLAGS


def to_hf_state_dict(params, cfg):
  """rlax params → LlamaForCausalLM state_dict (torch tensors, [out, in] linear weights)."""
  import torch
  t = lambda x: torch.from_numpy(np.array(x, np.float32))  # a writable host copy
  D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  lay = params["layers"]
  sd = {"model.embed_tokens.weight": t(params["embed"]), "model.norm.weight": t(params["final_norm"]),
        "lm_head.weight": t(np.asarray(params["lm_head"]).T)}
  for l in range(cfg.n_layers):
    p = f"model.layers.{l}."
    sd[p + "input_layernorm.weight"] = t(lay["attn_norm"][l])
    sd[p + "post_attention_layernorm.weight"] = t(lay["mlp_norm"][l])
    sd[p + "self_attn.q_proj.weight"] = t(np.asarray(lay["q"][l]).reshape(D, H * Dh).T)
    sd[p + "self_attn.k_proj.weight"] = t(np.asarray(lay["k"][l]).reshape(D, K * Dh).T)
    sd[p + "self_attn.v_proj.weight"] = t(np.asarray(lay["v"][l]).reshape(D, K * Dh).T)
    sd[p + "self_attn.o_proj.weight"] = t(np.asarray(lay["o"][l]).reshape(H * Dh, D).T)
    sd[p + "mlp.gate_proj.weight"] = t(np.asarray(lay["gate"][l]).T)
    sd[p + "mlp.up_proj.weight"] = t(np.asarray(lay["up"][l]).T)
    sd[p + "mlp.down_proj.weight"] = t(np.asarray(lay["down"][l]).T)
  return sd


def hf_model(params, cfg):
  import transformers
  hcfg = transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
      max_position_embeddings=cfg.max_position, tie_word_embeddings=False, attention_bias=False,
      mlp_bias=False, torch_dtype="float32", attn_implementation="sdpa")
  model = transformers.LlamaForCausalLM(hcfg)
  model.load_state_dict(to_hf_state_dict(params, cfg), strict=True)
  return model.eval()


def median_time(fn, reps):
  fn()  # warm-up (compiles)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    extra = fn()
    times.append((time.perf_counter() - t0, extra))
  times.sort(key=lambda x: x[0])
  return times[len(times) // 2]


def w4_limits(n: int, seed: int = 0) -> np.ndarray:
  """Per-request max new tokens: log-normal, median 64, sigma 1, clipped to [8, 1024]."""
  x = np.random.default_rng(seed).lognormal(mean=np.log(64), sigma=1.0, size=n)
  return np.clip(np.round(x), 8, 1024).astype(np.int64)


def hf_continuous(model, prompts, samples, limits):
  """transformers' continuous batching over one request per row (prompt-major) with its own limit → seconds."""
  import transformers
  try:
    from transformers.generation.continuous_batching import WorkloadHints
  except ImportError:  # transformers >= 5.2x keeps it in the utils module
    from transformers.generation.continuous_batching.utils import WorkloadHints
  cfg = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                                      pad_token_id=0, max_new_tokens=int(limits.max()))
  hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=int(limits.max()),
                        num_requests=len(limits))
  t0 = time.perf_counter()
  with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5,
                                                 workload_hints=hints) as manager:
    ids = [manager.add_request(list(prompts[r // samples]), request_id=f"r{r}", max_new_tokens=int(n))
           for r, n in enumerate(limits)]
    done = {}
    while len(done) < len(ids):
      res = manager.get_result(timeout=1)
      if res is None:
        if not manager.is_running():
          raise RuntimeError("transformers continuous batching stopped before every request finished")
        continue
      if res.is_finished():
        done[res.request_id] = len(res.generated_tokens)
  elapsed = time.perf_counter() - t0
  got = np.asarray([done[f"r{r}"] for r in range(len(limits))])
  if not np.array_equal(got, limits):
    raise RuntimeError(f"generate_batch produced {got.sum()} tokens, {limits.sum()} requested")
  return elapsed


def main_w4(params, cfg, prompts, S, jax, using_tcmalloc):
  samples = FLAGS.samples
  limits = w4_limits(FLAGS.prompts * samples)
  n_new, useful = int(limits.max()), int(limits.sum())
  cont = S.ContinuousSampler(cfg, max_prompt_len=FLAGS.prompt_len, max_new_tokens=n_new, slots=FLAGS.slots,
                             decode_chunk=FLAGS.chunk, params=params)
  rows = len(limits)
  static = S.Sampler(cfg, max_prompt_len=FLAGS.prompt_len, max_new_tokens=n_new, batch_size=rows,
                     batch_buckets=[rows], prompt_buckets=[FLAGS.prompt_len], params=params)
  state = {"seed": 0, "over_time": None}

  def run_cont():
    state["seed"] += 1
    marks = []
    t0 = time.perf_counter()
    out = cont.generate(prompts, samples_per_prompt=samples, strategy=S.Temperature(1.0), seed=state["seed"],
                        max_new_tokens=limits, on_chunk=lambda i, n: marks.append((time.perf_counter() - t0, n)))
    assert np.array_equal(np.asarray(out.lengths), limits)
    state["over_time"] = marks + [(time.perf_counter() - t0, useful)]
    return dict(cont.last_timings)

  def run_static():
    state["seed"] += 1
    out = static.generate(prompts, samples_per_prompt=samples, strategy=S.Temperature(1.0), seed=state["seed"])
    assert int(out.lengths.min()) == n_new  # the static batch decodes every row to the longest limit
    return {}

  total, tm = median_time(run_cont, FLAGS.reps)
  print(f"rlax continuous: {total:.3f} s ({useful / total:,.0f} useful tok/s, slot utilization "
        f"{tm['slot_utilization']:.2f}, compiles {dict(cont.trace_counts)})", flush=True)
  static_reps = FLAGS.reps if FLAGS.static_reps < 0 else FLAGS.static_reps
  static_total = median_time(run_static, static_reps)[0] if static_reps else None
  # Tokens/s over time: finished rows' tokens per second in 10 equal windows of the last run's wall clock.
  marks = state["over_time"]
  edges = np.linspace(0, marks[-1][0], 11)
  done_at = np.interp(edges, [m[0] for m in marks], [m[1] for m in marks])
  over_time = [round(float(x), 1) for x in np.diff(done_at) / np.diff(edges)]
  result = dict(workload="w4", tokens_per_s=useful / total, total_s=total, tokens_per_s_over_time=over_time,
                slot_utilization=tm["slot_utilization"], slots=FLAGS.slots, decode_chunk=FLAGS.chunk,
                requests=rows, useful_tokens=useful, limit_p50=int(np.median(limits)), limit_max=n_new,
                compiles=dict(cont.trace_counts), jax=jax.__version__, tcmalloc=using_tcmalloc())
  if static_total is not None:
    result.update(static_tokens_per_s=useful / static_total, static_s=static_total,
                  static_ratio=static_total / total, static_reps=static_reps)
    print(f"rlax static: {static_total:.3f} s ({useful / static_total:,.0f} tok/s); "
          f"continuous / static = {result['static_ratio']:.2f}x", flush=True)
  if FLAGS.baseline:
    import torch
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = hf_model(params, cfg)
    hf_continuous(model, prompts, samples, limits[:8])  # warm-up
    times = sorted(hf_continuous(model, prompts, samples, limits) for _ in range(FLAGS.reps))
    hf_total = times[len(times) // 2]
    result.update(baseline_tokens_per_s=useful / hf_total, baseline_s=hf_total, ratio=hf_total / total)
    print(f"transformers generate_batch: {hf_total:.3f} s ({useful / hf_total:,.0f} tok/s); "
          f"rlax / transformers = {result['ratio']:.2f}x")
  print(json.dumps(result))


def main(_):
  from rlax.allocator import reexec_with_tcmalloc, using_tcmalloc
  reexec_with_tcmalloc()
  import jax
  if FLAGS.devices > 1:
    jax.config.update("jax_num_cpu_devices", FLAGS.devices)  # before the first JAX operation
  from rlax import models as M
  from rlax import sampler as S

  if FLAGS.workload == "w4":  # W4's batch unless given
    FLAGS.prompts = FLAGS.prompts if FLAGS["prompts"].present else 64
    FLAGS.samples = FLAGS.samples if FLAGS["samples"].present else 4
  cfg = workload.model_config()
  mesh = (M.make_mesh(jax.devices()[:FLAGS.devices], data=FLAGS.devices, fsdp=1, tensor=1)
          if FLAGS.devices > 1 else None)
  params = M.create_params(cfg, mesh=mesh, seed=0)
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, FLAGS.vocab, FLAGS.prompt_len - 1).tolist() for _ in range(FLAGS.prompts)]
  if FLAGS.workload == "w4":
    return main_w4(params, cfg, prompts, S, jax, using_tcmalloc)
  rows, n_new = FLAGS.prompts * FLAGS.samples, FLAGS.new_tokens
  n_tok = rows * n_new
  sampler = S.Sampler(cfg, mesh, max_prompt_len=FLAGS.prompt_len, max_new_tokens=n_new, batch_size=rows,
                      batch_buckets=[rows], prompt_buckets=[FLAGS.prompt_len], params=params)
  state = {"seed": 0}

  def run_rlax():
    state["seed"] += 1
    out = sampler.generate(prompts, samples_per_prompt=FLAGS.samples, strategy=S.Temperature(1.0),
                           seed=state["seed"])
    assert int(out.lengths.min()) == n_new
    return dict(sampler.last_timings)

  total, tm = median_time(run_rlax, FLAGS.reps)
  result = dict(tokens_per_s=n_tok / total, total_s=total, prefill_s=tm["prefill_s"], decode_s=tm["decode_s"],
                rows=rows, new_tokens=n_new, devices=FLAGS.devices, compiles=dict(sampler.trace_counts),
                jax=jax.__version__, tcmalloc=using_tcmalloc())
  print(f"rlax: {total:.3f} s ({result['tokens_per_s']:,.0f} tok/s), prefill {tm['prefill_s'] * 1e3:.1f} ms, "
        f"decode {tm['decode_s'] * 1e3:.1f} ms ({tm['decode_s'] / max(n_new - 1, 1) * 1e3:.2f} ms/token)")
  if FLAGS.baseline:
    import torch
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = hf_model(params, cfg)
    ids = torch.tensor(prompts)

    def run_hf():
      with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0, max_new_tokens=n_new,
                             min_new_tokens=n_new, num_return_sequences=FLAGS.samples)
      assert out.shape == (rows, FLAGS.prompt_len + n_new)

    hf_total, _ = median_time(run_hf, FLAGS.reps)
    result.update(baseline_tokens_per_s=n_tok / hf_total, baseline_s=hf_total, ratio=hf_total / total)
    print(f"transformers generate: {hf_total:.3f} s ({n_tok / hf_total:,.0f} tok/s); "
          f"rlax / transformers = {result['ratio']:.2f}x")
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
