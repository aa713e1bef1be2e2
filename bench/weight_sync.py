r"""The parameter server's move (`rlax.weights.reshard`) vs a plain device-to-device `jax.device_put`, on 8
fake CPU devices.

The trainer submesh is devices 0-3 (fsdp=4), the sampler submesh devices 4-7 (data=2, tensor=2).
Each repetition times, back to back on the same arrays, (a) a plain `jax.device_put` of the f32
trainer params onto the sampler shardings and (b) `reshard` (cast to --dtype on the trainer mesh, then
move per --transport: 'auto' is the host transport on these CPU devices, 'device' the accelerators' cast
+ device_put). Medians over --reps; GB/s counts the bytes that arrive on the sampler (bf16 for the push,
f32 for the copy), so `ratio` is per-byte throughput and `time_speedup` is how much sooner the sampler has
its weights; `nocast_ratio` repeats the push in f32 (same bytes as the copy) to isolate the transport's
overhead. The plain copy is flattered: a cross-mesh `device_put` with a layout change goes through the
array's host copy, which jax caches on the array, so reusing the same params skips the gather a trainer's
fresh params pay every step. Last line: JSON.

  python bench/weight_sync.py                          # ~640 MB f32 model
  python bench/weight_sync.py --transport=device       # the accelerator path, on CPU
"""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)  # before any JAX operation

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

from rlax import models as M  # noqa: E402
from rlax.weights.reshard import reshard  # noqa: E402

flags.DEFINE_integer("vocab", 32000, "vocabulary size")
flags.DEFINE_integer("d_model", 1024, "model width")
flags.DEFINE_integer("layers", 8, "number of layers")
flags.DEFINE_integer("heads", 16, "query heads")
flags.DEFINE_integer("kv_heads", 8, "key/value heads")
flags.DEFINE_integer("head_dim", 64, "head dimension")
flags.DEFINE_integer("mlp", 2816, "MLP hidden size")
flags.DEFINE_integer("reps", 5, "timed repetitions (after one warm-up)")
flags.DEFINE_enum("transport", "auto", ["auto", "device", "host"], "reshard transport")
flags.DEFINE_string("dtype", "bfloat16", "sampler dtype")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  cfg = M.ModelConfig(FLAGS.vocab, FLAGS.d_model, FLAGS.layers, FLAGS.heads, FLAGS.kv_heads,
                      FLAGS.head_dim, FLAGS.mlp)
  devs = jax.devices()
  trainer_mesh = M.make_mesh(devs[:4], fsdp=4)
  sampler_mesh = M.make_mesh(devs[4:], data=2, tensor=2)
  params = M.create_params(cfg, trainer_mesh)
  targets = M.param_shardings(cfg, sampler_mesh)
  jax.block_until_ready(params)
  src_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

  def copy():
    t0 = time.perf_counter()
    jax.block_until_ready(jax.device_put(params, targets))
    return time.perf_counter() - t0

  copy()  # warm-up: compiles the cast programs, allocates
  _, stats = reshard(params, targets, FLAGS.dtype, transport=FLAGS.transport)
  reshard(params, targets, None, transport=FLAGS.transport)
  copy_s, sync_s, sync32_s = [], [], []
  for _ in range(FLAGS.reps):
    copy_s.append(copy())  # interleaved so all see the same background load
    sync_s.append(reshard(params, targets, FLAGS.dtype, transport=FLAGS.transport)[1].seconds)
    # The same move without the cast: isolates the transport's own overhead from the halved byte count.
    sync32_s.append(reshard(params, targets, None, transport=FLAGS.transport)[1].seconds)
  sync_bytes = stats.bytes
  c, s, s32 = statistics.median(copy_s), statistics.median(sync_s), statistics.median(sync32_s)
  result = {
      "transport": stats.transport, "dtype": FLAGS.dtype,
      "bytes": sync_bytes, "source_bytes": src_bytes,
      "sync_s": round(s, 4), "copy_s": round(c, 4),
      "sync_gb_per_s": round(sync_bytes / s / 1e9, 3), "copy_gb_per_s": round(src_bytes / c / 1e9, 3),
      "ratio": round((sync_bytes / s) / (src_bytes / c), 3), "time_speedup": round(c / s, 3),
      "nocast_sync_s": round(s32, 4), "nocast_ratio": round(c / s32, 3),
  }
  print(f"model {src_bytes / 1e6:.0f} MB f32 -> {sync_bytes / 1e6:.0f} MB {FLAGS.dtype}; "
        f"push {s:.3f}s ({result['sync_gb_per_s']} GB/s, {result['transport']}) vs "
        f"device_put {c:.3f}s ({result['copy_gb_per_s']} GB/s): ratio {result['ratio']}, "
        f"weights arrive {result['time_speedup']}x sooner; same push without the cast {s32:.3f}s "
        f"(ratio {result['nocast_ratio']})")
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
