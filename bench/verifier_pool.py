"""Gradings per second of the verifier pool, for math-verify and sandboxed code graders.

  python bench/verifier_pool.py [--workers=4] [--math_n=400] [--code_n=48] [--repeats=3]

Each figure is the median over `repeats` runs; a 1-worker pool is measured in the same run, so
the speedup ratio is meaningful on a shared, noisy machine. The last line is JSON.
"""

import json
import os
import statistics
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlax import rewards  # pylint: disable=g-import-not-at-top,wrong-import-position
from rlax.data import synthetic  # pylint: disable=g-import-not-at-top,wrong-import-position
from rlax.data.records import Record  # pylint: disable=g-import-not-at-top,wrong-import-position

_WORKERS = flags.DEFINE_integer("workers", 4, "Pool worker processes.")
_MATH_N = flags.DEFINE_integer("math_n", 400, "Math gradings per run.")
_CODE_N = flags.DEFINE_integer("code_n", 48, "Code gradings per run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per figure (median reported).")


def _math_items(n):
  golds = [r"\frac{1}{2}", r"2\sqrt{2}", "x^2+2x+1", "1000", r"\pi/2", "7"]
  comps = [r"so \boxed{0.5}", r"\boxed{\sqrt{8}}", r"\boxed{(x+1)^2}", "<answer>1,000</answer>",
           r"$\frac{\pi}{2}$", r"\boxed{8}"]
  recs = [Record(id=str(i), prompt="p", answer=golds[i % 6]) for i in range(n)]
  return [comps[i % 6] for i in range(n)], recs


def _code_items(n):
  recs = synthetic.program(n, difficulty=3, seed=0)
  return [f"```python\n{r.metadata['solution']}```" for r in recs], recs


def _rate(fn, comps, recs, workers, repeats):
  rates = []
  with rewards.VerifierPool(num_workers=workers, timeout_s=60) as pool:
    pool.grade(fn, comps[:4], recs[:4])  # warm-up: imports, first sandbox
    for _ in range(repeats):
      start = time.perf_counter()
      out = pool.grade(fn, comps, recs)
      rates.append(len(out) / (time.perf_counter() - start))
      assert len(out) == len(comps)
  return statistics.median(rates), sum(r for r, _ in out) / len(out)


def main(argv):
  del argv
  res = {"workers": _WORKERS.value, "cpus": os.cpu_count(), "sandbox": rewards.isolation_mode()}
  for name, fn, items in (("math", rewards.math_reward, _math_items(_MATH_N.value)),
                          ("code", rewards.code_reward, _code_items(_CODE_N.value))):
    one, acc = _rate(fn, *items, 1, _REPEATS.value)
    many, _ = _rate(fn, *items, _WORKERS.value, _REPEATS.value)
    res[f"{name}_per_s_1worker"] = round(one, 1)
    res[f"{name}_per_s"] = round(many, 1)
    res[f"{name}_speedup"] = round(many / one, 2)
    res[f"{name}_mean_reward"] = round(acc, 3)
    print(f"{name}: {one:.1f}/s with 1 worker, {many:.1f}/s with {_WORKERS.value}", flush=True)
  print(json.dumps(res))


if __name__ == "__main__":
  app.run(main)
