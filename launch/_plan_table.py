"""Human-readable rendering of `rlax.planning.make_plan`'s table."""

GIB = 2 ** 30


def _t(s: float) -> str:
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if s >= scale:
      return f"{s / scale:.3g} {unit}"
  return f"{s * 1e9:.3g} ns" if s else "0"


def format_table(t: dict) -> str:
  """Per-program rows (per-chip memory against HBM, FLOPs, bytes, roofline time, compile time) + estimates."""
  c, a, e = t["config"], t["assumptions"], t["estimates"]
  hbm = a["hbm_gib"]
  w = max([18] + [len(p["name"]) + 1 for p in t["programs"]])  # program names fit their column
  lines = [f"plan: {c['model']} ({c['params'] / 1e9:.3g}B params) on {c['topology']} = {c['devices']} "
           f"{c['chip']} chips; trainer mesh {c['trainer_mesh']}, sampler mesh {c['sampler_mesh']}",
           f"      batch {c['batch_rows']} rows x {c['seq_len']} tokens, {c['micro_batches']} micro-batches; "
           f"sampler {c['sampler_slots']} slots (decode buckets {c['slot_buckets']}); train programs "
           + ", ".join(f"{p['rows']}x{p['length']}/{p['micro_batches']}" for p in c["train_programs"]),
           f"{'program':<{w}}{'mesh':<22}{'args GiB':>9}{'temp GiB':>9}{'out GiB':>9}{'peak GiB':>9}"
           f"{'% HBM':>7}{'TFLOP':>9}{'GB acc':>9}{'roofline':>11}{'analytic':>11}{'compile':>9}"]
  for p in t["programs"]:
    flops = max(p["flops"], p["est_flops"])
    nbytes = max(p["bytes_accessed"], p["est_bytes"])
    lines.append(f"{p['name']:<{w}}{p['mesh']:<22}{p['argument_bytes'] / GIB:>9.2f}{p['temp_bytes'] / GIB:>9.2f}"
                 f"{p['output_bytes'] / GIB:>9.2f}{p['peak_bytes'] / GIB:>9.2f}{100 * p['hbm_frac']:>7.1f}"
                 f"{flops / 1e12:>9.3g} {nbytes / 1e9:>8.3g}{_t(p['roofline_s']):>11}"
                 f"{_t(p['analytic_s']) if p['analytic_s'] else '-':>11}{p['compile_s']:>8.1f} s")
  push = e["push"]
  lines.append(f"per chip, HBM {hbm:g} GiB; peak {a['peak_tflops']:g} TFLOP/s bf16, HBM {a['hbm_tb_s']:g} TB/s, "
               f"ICI {a['ici_gb_s']:g} GB/s, DCN {a['dcn_gb_s']:g} GB/s (assumed)")
  steps = []
  if "train_step_s" in e:
    steps.append(f"train step >= {_t(e['train_step_s'])} ({e['train_tokens_per_s']:.3g} tokens/s)")
  if "prefill_s" in e:
    steps.append(f"prefill >= {_t(e['prefill_s'])}")
  if steps:
    lines.append("; ".join(steps))
  if "decode" in e:
    d = e["decode"]
    how = (f"{d['attention']} attention, pages of {d['page_size']}" if d["layout"] == "paged" else "dense layout")
    lines.append(f"decode step >= {_t(e['decode_token_step_s'])} ({e['sampler_tokens_per_s']:.3g} sampler tokens/s; "
                 f"{how}, {d['slots']} slots x {d['context']} tokens): "
                 f"{d['step_bytes'] / 1e9:.3g} GB/chip = XLA {d['xla_step_bytes'] / 1e9:.3g} GB (layers unrolled, "
                 f"compiled in {d['unrolled_compile_s']:.3g} s) + kernel {d['kernel_bytes'] / 1e9:.3g} GB; "
                 f"{d['ratio']:.3g}x weights {d['weights_bytes'] / 1e9:.3g} GB + KV {d['kv_bytes'] / 1e9:.3g} GB")
  lines += [f"weight push ~ {_t(push['seconds'])}: {push['total_bytes'] / 1e9:.3g} GB, "
            f"{push['per_chip_transport_bytes'] / 1e6:.3g} MB/chip over {push['link'].upper()} "
            f"({_t(push['cross_s'])}), gather to {push['per_chip_sampler_bytes'] / 1e9:.3g} GB/chip over ICI "
            f"({_t(push['gather_s'])})"]
  if "experts" in e:
    x = e["experts"]
    mesh = lambda m: (f"{m['experts_per_chip']} a chip over {'x'.join(m['axes'])} (EP {m['group']})" if m["axes"]
                      else "every expert on every chip (no mesh axis divides them)")
    lines.append(f"experts: trainer {mesh(x['trainer'])}, sampler {mesh(x['sampler'])}; token exchange "
                 f"(all-gather + reduce-scatter) {x['trainer']['bytes'] / 1e9:.3g} GB/chip per train step "
                 f"(~ {_t(x['train_s'])} over ICI), {x['sampler']['bytes'] / 1e6:.3g} MB/chip per decode step "
                 f"(~ {_t(x['decode_s'])})")
  if "lora" in e:
    lo, base = e["lora"], e["push_base_once"]
    lines.append(f"LoRA rank {lo['rank']} ({lo['adapter_params'] / 1e6:.3g} M adapter params): a push is "
                 f"{100 * lo['push_share_of_full']:.2g}% of the weights; the base crosses once "
                 f"({base['total_bytes'] / 1e9:.3g} GB, ~ {_t(base['seconds'])}) and its pristine copy holds "
                 f"{lo['sampler_pristine_bytes_per_chip'] / GIB:.3g} GiB per sampler chip")
  lines.append(f"assumptions: {a['time']}; push: {a['push']}" + (f"; {a['decode']}" if "decode" in e else ""))
  return "\n".join(lines)
