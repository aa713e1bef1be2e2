"""Sampler throughput vs transformers on the same weights, and decode against this machine's matmul rate,
measured in the same run.

    python bench/sampler.py                       # workload W1 (see bench-peers/README.md)
    python bench/sampler.py --workload=w5         # the SmolLM2-135M shape (random weights), 8 prompts x 8
    python bench/sampler.py --workload=w4         # long-tailed lengths: rlax vs transformers generate_batch

W1 / W5: every row decodes --new_tokens tokens (random weights never stop early). Timed (median of --reps after
one warm-up that compiles): a whole `generate` call, and the same call with every row's limit 1 (prefill and
admission only); decode_s is the difference. decode_flops counts what the decode steps compute: per fed token
2 x the matmul weights (q, k, v, o, gate, up, down, lm head) + attention 4 x layers x heads x head_dim x (its
position + 1). decode_share_of_matmul = decode_flops / decode_s over the f32 matmul rate measured in the same
run (`workload.matmul_flops_per_s`). The peer is `LlamaForCausalLM.generate(do_sample=True, temperature=1,
top_k=0, top_p=1, eos_token_id=None)` with torch.set_num_threads(2).

W4: the W1 model, 64 prompts x 4 samples, each request's max new tokens drawn (seed 0) from a log-normal with
median 64 and sigma 1, clipped to [8, 1024]. Useful tokens/s = the requested tokens / wall time, for rlax's
engine (`--slots` decode slots) and transformers' continuous batching (`generate_batch`'s manager, one request
per row with its own limit). The last output line is one JSON object.
"""

import json
import time

from absl import app, flags

import workload
import numpy as np

flags.DEFINE_integer("reps", 5, "timed repetitions after one warm-up")
flags.DEFINE_boolean("baseline", True, "also time transformers generate()")
flags.DEFINE_enum("workload", "w1", ["w1", "w4", "w5"], "w1 / w5: fixed lengths; w4: long-tailed per-request "
                  "lengths")
flags.DEFINE_integer("slots", 64, "W4: decode slots")
flags.DEFINE_integer("chunk", 16, "decode steps between admissions (W1 / W5: --new_tokens, one chunk)")
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
  limits = workload.w4_limits(FLAGS.prompts * samples)
  n_new, useful = int(limits.max()), int(limits.sum())
  engine = S.Sampler(cfg, max_prompt_len=FLAGS.prompt_len, max_new_tokens=n_new, slots=FLAGS.slots,
                     decode_chunk=FLAGS.chunk, params=params)
  rows = len(limits)
  state = {"seed": 0, "over_time": None}

  def run():
    state["seed"] += 1
    marks = []
    t0 = time.perf_counter()
    out = engine.generate(prompts, samples_per_prompt=samples, strategy=S.Temperature(1.0), seed=state["seed"],
                          max_new_tokens=limits, on_chunk=lambda i, n: marks.append((time.perf_counter() - t0, n)))
    assert np.array_equal(np.asarray(out.lengths), limits)
    state["over_time"] = marks + [(time.perf_counter() - t0, useful)]
    return dict(engine.last_timings)

  total, tm = workload.median_time(run, FLAGS.reps)
  print(f"rlax: {total:.3f} s ({useful / total:,.0f} useful tok/s, slot utilization "
        f"{tm['slot_utilization']:.2f}, compiles {dict(engine.trace_counts)})", flush=True)
  # Tokens/s over time: finished rows' tokens per second in 10 equal windows of the last run's wall clock.
  marks = state["over_time"]
  edges = np.linspace(0, marks[-1][0], 11)
  done_at = np.interp(edges, [m[0] for m in marks], [m[1] for m in marks])
  over_time = [round(float(x), 1) for x in np.diff(done_at) / np.diff(edges)]
  result = dict(workload="w4", tokens_per_s=useful / total, total_s=total, tokens_per_s_over_time=over_time,
                slot_utilization=tm["slot_utilization"], slots=FLAGS.slots, decode_chunk=FLAGS.chunk,
                requests=rows, useful_tokens=useful, limit_p50=int(np.median(limits)), limit_max=n_new,
                compiles=dict(engine.trace_counts), jax=jax.__version__, tcmalloc=using_tcmalloc())
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


def decode_flops(cfg, rows: int, prompt_len: int, new_tokens: int) -> float:
  """FLOPs of the decode steps of `rows` rows from `prompt_len` to `prompt_len + new_tokens` tokens (see the
  module docstring): token t (t = 1 .. new_tokens - 1) is drawn after feeding position prompt_len + t - 1."""
  pos = np.arange(prompt_len, prompt_len + new_tokens - 1)
  per_token = 2 * workload.matmul_params(cfg) + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * (pos + 1)
  return float(rows * per_token.sum())


def main(_):
  from rlax.allocator import set_up, using_tcmalloc
  set_up()
  import jax
  if FLAGS.devices > 1:
    jax.config.update("jax_num_cpu_devices", FLAGS.devices)  # before the first JAX operation
  from rlax import models as M
  from rlax import sampler as S

  if FLAGS.workload == "w4":  # W4's batch unless given
    FLAGS.prompts = FLAGS.prompts if FLAGS["prompts"].present else 64
    FLAGS.samples = FLAGS.samples if FLAGS["samples"].present else 4
  if FLAGS.workload == "w5":
    workload.use_w5()
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
  engine = S.Sampler(cfg, mesh, max_prompt_len=FLAGS.prompt_len, max_new_tokens=n_new, slots=rows,
                     decode_chunk=n_new if not FLAGS["chunk"].present else FLAGS.chunk, params=params)
  state = {"seed": 0}

  def run(limit):
    def call():
      state["seed"] += 1
      out = engine.generate(prompts, samples_per_prompt=FLAGS.samples, strategy=S.Temperature(1.0),
                            seed=state["seed"], max_new_tokens=limit)
      jax.block_until_ready(out.tokens)
      assert int(out.lengths.min()) == limit
      return dict(engine.last_timings)
    return call

  total, tm = workload.median_time(run(n_new), FLAGS.reps)
  prefill, _ = workload.median_time(run(1), FLAGS.reps)
  decode_s = max(total - prefill, 1e-9)
  flops = decode_flops(cfg, rows, FLAGS.prompt_len, n_new)
  peak = workload.matmul_flops_per_s()
  result = dict(workload=FLAGS.workload, tokens_per_s=n_tok / total, total_s=total, prefill_s=prefill,
                decode_s=decode_s, decode_step_ms=1e3 * decode_s / max(n_new - 1, 1), decode_flops=flops,
                decode_flops_per_s=flops / decode_s, matmul_flops_per_s=peak,
                decode_share_of_matmul=flops / decode_s / peak, rows=rows, new_tokens=n_new,
                params=cfg.num_params(), devices=FLAGS.devices, compiles=dict(engine.trace_counts),
                jax=jax.__version__, tcmalloc=using_tcmalloc())
  print(f"rlax: {total:.3f} s ({result['tokens_per_s']:,.0f} tok/s), prefill {prefill * 1e3:.1f} ms, decode "
        f"{decode_s * 1e3:.1f} ms ({result['decode_step_ms']:.2f} ms/step, {flops / decode_s / 1e9:.1f} GFLOP/s = "
        f"{result['decode_share_of_matmul']:.2f} of the {peak / 1e9:.1f} GFLOP/s matmul rate)")
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

    hf_total, _ = workload.median_time(run_hf, FLAGS.reps)
    result.update(baseline_tokens_per_s=n_tok / hf_total, baseline_s=hf_total, ratio=hf_total / total)
    print(f"transformers generate: {hf_total:.3f} s ({n_tok / hf_total:,.0f} tok/s); "
          f"rlax / transformers = {result['ratio']:.2f}x")
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
