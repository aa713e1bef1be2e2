"""Sampler throughput vs transformers `generate()` on the same weights, measured in the same run.

    python bench/sampler.py                       # workload W1 (see bench-peers/README.md)
    python bench/sampler.py --d_model=512 --layers=8 --prompts=8 --samples=4 --reps=3

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


def main(_):
  from rlax.allocator import reexec_with_tcmalloc, using_tcmalloc
  reexec_with_tcmalloc()
  import jax
  if FLAGS.devices > 1:
    jax.config.update("jax_num_cpu_devices", FLAGS.devices)  # before the first JAX operation
  from rlax import models as M
  from rlax import sampler as S

  cfg = workload.model_config()
  mesh = (M.make_mesh(jax.devices()[:FLAGS.devices], data=FLAGS.devices, fsdp=1, tensor=1)
          if FLAGS.devices > 1 else None)
  params = M.create_params(cfg, mesh=mesh, seed=0)
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, FLAGS.vocab, FLAGS.prompt_len - 1).tolist() for _ in range(FLAGS.prompts)]
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
