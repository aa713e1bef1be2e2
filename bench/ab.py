"""W1 generation (or W4, W6), this checkout against another, in turns: each side runs in its own process and they take
turns one `generate` call at a time, so a host whose speed drifts from minute to minute (up to 2.7x from day to
day here) slows both sides alike. Separate runs of `bench/sampler.py` a minute apart differ by ±15% on this
host; taking turns, by ~1%.

    python bench/ab.py --other=/path/to/other/checkout          # e.g. `git worktree add /tmp/base <commit>`
    python bench/ab.py --other=... --calls=40 --workload=w4
    python bench/ab.py --other=... --calls=12 --workload=w6   # bench/episodes.py's extend: 64 episodes x 4 turns

Each call is timed whole (W1: 128 rows x 64 tokens, and the same call with every row's limit 1: prefill and
admission; decode per step is their difference / 63), after untimed calls that compile. The workers import
this checkout's `bench/workload.py` and `bench/episodes.py` and each its own `rlax`, of which they use only
`Sampler(...)`, `generate`, (W6) `rlax.envs`' episodes and the engine's `trace_counts`: a turn in which either
side compiled a program is left out of both sides' medians. The last output line is one JSON object: each side's
medians and this / other.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

import episodes  # noqa: F401 (its flags too)
import workload

flags.DEFINE_string("other", None, "the other checkout's root directory")
flags.DEFINE_integer("calls", 30, "timed calls per side and limit")
flags.DEFINE_enum("workload", "w1", ["w1", "w4", "w6"], "w1: fixed lengths (and limit 1); w4: long-tailed "
                  "lengths; w6: multi-turn episodes kept in their slots (bench/episodes.py's extend)")
flags.DEFINE_boolean("worker", False, "internal: serve timed calls on stdin / stdout")
FLAGS = flags.FLAGS


def _worker() -> None:
  """Builds the workload's engine from the checkout on sys.path, then answers each "<limit>" line on stdin
  with "<seconds> <traces>" of one call (traces: programs it compiled; such a call is not steady state)."""
  import numpy as np
  import jax
  from rlax import models as M
  from rlax import sampler as S
  if FLAGS.workload == "w6":
    engine, run = episodes.extend_setup()[-2:]
    episodes.warm(run(), engine)
    print("ready", os.path.abspath(M.__file__), flush=True)
    for _ in sys.stdin:
      n, t = episodes.traces(engine), time.perf_counter()
      run()()
      print(f"{time.perf_counter() - t:.6f} {episodes.traces(engine) - n}", flush=True)
    return
  cfg = workload.model_config()
  params = M.create_params(cfg, seed=0)
  rng = np.random.default_rng(0)
  w4 = FLAGS.workload == "w4"
  n_prompts, samples = (64, 4) if w4 else (FLAGS.prompts, FLAGS.samples)
  prompts = [[1] + rng.integers(3, FLAGS.vocab, FLAGS.prompt_len - 1).tolist() for _ in range(n_prompts)]
  limits = workload.w4_limits(n_prompts * samples) if w4 else None
  n_new = int(limits.max()) if w4 else FLAGS.new_tokens
  engine = S.Sampler(cfg, max_prompt_len=FLAGS.prompt_len, max_new_tokens=n_new,
                     slots=64 if w4 else n_prompts * samples, decode_chunk=16 if w4 else n_new, params=params)
  seed = [0]

  def call(limit: int) -> float:
    seed[0] += 1
    t = time.perf_counter()
    out = engine.generate(prompts, samples_per_prompt=samples, strategy=S.Temperature(1.0), seed=seed[0],
                          max_new_tokens=limits if w4 else limit)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - t

  for limit in ((n_new,) if w4 else (n_new, 1, n_new, 1)):  # compiles
    call(limit)
  print("ready", os.path.abspath(M.__file__), flush=True)
  for line in sys.stdin:
    n = episodes.traces(engine)
    print(f"{call(int(line)):.6f} {episodes.traces(engine) - n}", flush=True)


def _spawn(root: str) -> subprocess.Popen:
  # The worker is this file: `workload` comes from this checkout's bench/, `rlax` from `root` (before site-packages).
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  argv = [sys.executable, os.path.abspath(__file__), "--worker", f"--workload={FLAGS.workload}"]
  argv += [f"--{k}={FLAGS[k].value}" for k in ("vocab", "d_model", "layers", "heads", "kv_heads", "head_dim", "mlp",
                                                "dtype", "prompts", "prompt_len", "samples", "new_tokens")
           if FLAGS[k].present]  # the workload's own defaults otherwise (W6: 16 prompts x 4)
  p = subprocess.Popen(argv, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True)
  word, _, where = p.stdout.readline().strip().partition(" ")
  if word != "ready":
    raise RuntimeError(f"{root}: the worker did not start (run bench/sampler.py there to see why)")
  if not where.startswith(os.path.join(root, "rlax") + os.sep):
    raise RuntimeError(f"{root}: the worker imported rlax from {where}")
  return p


def main(_):
  if FLAGS.worker:
    return _worker()
  if not FLAGS.other or not os.path.isdir(os.path.join(FLAGS.other, "rlax")):
    raise app.UsageError(f"--other={FLAGS.other}: not an rlax checkout")
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sides = {"this": _spawn(here), "other": _spawn(os.path.abspath(FLAGS.other))}
  limits = (FLAGS.new_tokens, 1) if FLAGS.workload == "w1" else (0,)
  times = {(s, n): [] for s in sides for n in limits}
  dropped = {n: 0 for n in limits}  # turns in which either side compiled a program (W6's warm-up can miss one)
  try:
    for i in range(FLAGS.calls):
      order = list(sides) if i % 2 == 0 else list(sides)[::-1]  # who goes first alternates too
      for n in limits:
        turn = {}
        for s in order:
          sides[s].stdin.write(f"{n}\n")
          sides[s].stdin.flush()
          got = sides[s].stdout.readline()
          if not got:
            raise RuntimeError(f"the {s} worker stopped (exit status {sides[s].poll()})")
          turn[s] = [float(x) for x in got.split()]
        if any(traces for _, traces in turn.values()):  # not steady state: both sides' calls left out
          dropped[n] += 1
          continue
        for s, (secs, _) in turn.items():
          times[s, n].append(secs)
  finally:
    for p in sides.values():
      p.stdin.close()
      p.wait()
  if not all(times.values()):
    raise RuntimeError(f"a side compiled in every turn: {dropped}")
  med = {k: statistics.median(v) for k, v in times.items()}
  result = dict(workload=FLAGS.workload, calls=FLAGS.calls, other=os.path.abspath(FLAGS.other),
                turns_left_out=dropped)
  for s in sides:
    result[f"{s}_s"] = med[s, limits[0]]
    if FLAGS.workload == "w1":
      rows = FLAGS.prompts * FLAGS.samples
      result[f"{s}_tokens_per_s"] = rows * FLAGS.new_tokens / med[s, limits[0]]
      result[f"{s}_limit1_s"] = med[s, 1]
      result[f"{s}_decode_step_ms"] = 1e3 * (med[s, limits[0]] - med[s, 1]) / max(FLAGS.new_tokens - 1, 1)
  result["this_over_other_speed"] = med["other", limits[0]] / med["this", limits[0]]
  print(f"this {med['this', limits[0]]:.4f} s, other {med['other', limits[0]]:.4f} s a call (medians of "
        f"{FLAGS.calls} turns less {sum(dropped.values())} in which a side compiled): this is "
        f"{result['this_over_other_speed']:.3f}x as fast")
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
