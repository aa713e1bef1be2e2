"""Multi-turn episodes (workload W6): keeping each row's KV cache between turns (`Stream.extend`) against
re-prefilling the whole conversation every turn, and how much of a slow tool's latency the episode stream hides.

    python bench/episodes.py                    # W6: the W1 model, 16 prompts x 4 samples = 64 episodes

Every episode has --turns policy turns; turn k of episode e samples limits[e, k] tokens (drawn once, seed 0,
uniform in [--turn_min, --turn_max]: rows stop at different times, as real turns do); between turns the tool
answers with --tool_tokens tokens (random ids). Useful tokens are the sampled ones. Timed: the four variants in
turn, --reps rounds (medians), after warm-ups that compile everything the calls use:
  extend      EpisodeStream over one stream: a row keeps its slot and cache, the tool's tokens are appended.
  reprefill   the same episodes as --turns `generate` calls, each on every conversation so far (prompt, earlier
              turns and tool answers re-prefilled), with the same per-row limits.
  tool_<ms>   extend with a tool that answers after --tool_ms (asyncio.sleep): `async` (other rows decode while
              a row waits) and `sync` (every answer awaited before the next chunk: the tool stalls decoding).
tool_latency_hidden = (sync - async) / (sync - extend): the share of the stall the stream hides (null where sync is not
slower than extend: the stall is within the run's noise). The run's
f32 matmul rate is reported with it (workload.matmul_flops_per_s). The last output line is one JSON object.
"""

import asyncio
import json
import sys
import time

from absl import app, flags

import workload
import numpy as np

flags.DEFINE_integer("reps", 5, "timed repetitions after one warm-up")
flags.DEFINE_integer("turns", 4, "policy turns per episode")
flags.DEFINE_integer("turn_min", 8, "fewest tokens of a turn")
flags.DEFINE_integer("turn_max", 56, "most tokens of a turn")
flags.DEFINE_integer("tool_tokens", 8, "tokens of a tool's answer")
flags.DEFINE_float("tool_ms", 50.0, "latency of the slow tool")
FLAGS = flags.FLAGS


def warm(fn, engine):
  """Calls fn until two calls in a row compile nothing new (which rows extend together depends on when the
  environment's answers arrive, so one call need not see every bucket; timed calls that compile are still
  possible: `bench/ab.py` leaves them out)."""
  seen, quiet = -1, 0
  for _ in range(10):
    fn()
    n = traces(engine)
    quiet = quiet + 1 if n == seen else 0
    if quiet == 2:
      return
    seen = n
  print("warm-up: calls still compiled after 10 of them; timed calls may compile too", file=sys.stderr)


def traces(engine) -> int:
  """Programs `engine` has traced (compiled) so far; 0 for a checkout without the counter. Callers: warm,
  bench/ab.py."""
  return sum(getattr(engine, "trace_counts", {}).values())


def timed(fns: dict, reps: int) -> dict:
  """{name: [seconds]}: the calls in turn, `reps` rounds (the same window for every variant)."""
  out = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      out[k].append(time.perf_counter() - t0)
  return out


def episodes_setup(turns: int):
  """The W1 model and the episodes' prompts and per-turn token limits (W6, W8): (cfg, params, rng, prompts
  [P lists], limits [P*G, turns]); 16 prompts x 4 samples unless --prompts/--samples say otherwise."""
  from rlax import models as M
  FLAGS.prompts = FLAGS.prompts if FLAGS["prompts"].present else 16
  FLAGS.samples = FLAGS.samples if FLAGS["samples"].present else 4
  cfg = workload.model_config()
  rng = np.random.default_rng(0)
  L = FLAGS.prompt_len
  prompts = [[1] + rng.integers(3, FLAGS.vocab, L - 1).tolist() for _ in range(FLAGS.prompts)]
  limits = rng.integers(FLAGS.turn_min, FLAGS.turn_max + 1, (FLAGS.prompts * FLAGS.samples, turns))
  return cfg, M.create_params(cfg, seed=0), rng, prompts, limits


def extend_calls(engine, prompts, limits, answers):
  """W6's `extend` variant on `engine` (a Sampler of the checkout on sys.path): extend(delay, sync) -> call()
  runs the episodes once (len(prompts) x samples, limits [E, turns], tool answers [E, turns, A]); each call a
  new seed. Callers: main, bench/ab.py."""
  from rlax import envs
  from rlax import sampler as S
  P, (E, K) = len(prompts), limits.shape
  useful, state = int(limits.sum()), {"seed": 0}

  class Tool(envs.Environment):
    """Episode e: turn k samples limits[e, k] tokens; the tool answers answers[e, k] (after `delay` s)."""

    def __init__(self, e, delay):
      self.e, self.delay = e, delay

    async def reset(self, record):
      return envs.Observation(prompts[record], max_new_tokens=int(limits[self.e, 0]))

    async def step(self, turn):
      k = turn.index
      assert len(turn.tokens) == limits[self.e, k]
      if k + 1 == K:
        return envs.StepResult(reward=1.0, done=True, stop_reason="final_answer")
      if self.delay:
        await asyncio.sleep(self.delay)
      return envs.StepResult(tokens=answers[self.e, k].tolist(), max_new_tokens=int(limits[self.e, k + 1]),
                             calls=("ok",))

  def extend(delay=0.0, sync=False):
    def call():
      state["seed"] += 1
      made = []

      def make():
        made.append(Tool(len(made), delay))
        return made[-1]
      # make_env is called G times per record, in record order: episode e = record * G + sample.
      with envs.EpisodeStream(engine.stream(S.Temperature(1.0)), make, sync=sync) as eps:
        done = eps.run(list(range(P)), samples_per_prompt=E // P, seed=state["seed"])
      n = sum(int(f.out.sampled.sum()) for f in done)
      assert n == useful, (n, useful)
    return call
  return extend


def extend_setup():
  """W6's extend variant from the flags: (cfg, params, prompts, limits, answers, budget, engine, extend) with
  `extend` as `extend_calls` gives it. Callers: main, bench/ab.py."""
  from rlax import sampler as S
  K, A = FLAGS.turns, FLAGS.tool_tokens
  cfg, params, rng, prompts, limits = episodes_setup(K)
  answers = rng.integers(3, FLAGS.vocab, (limits.shape[0], K, A))
  budget = FLAGS.turn_max * K + A * (K - 1)
  engine = S.Sampler(cfg, max_prompt_len=FLAGS.prompt_len, max_new_tokens=budget, slots=limits.shape[0],
                     decode_chunk=16, params=params)
  return cfg, params, prompts, limits, answers, budget, engine, extend_calls(engine, prompts, limits, answers)


def main(_):
  from rlax.allocator import set_up, using_tcmalloc
  set_up()
  import jax
  from rlax import sampler as S

  cfg, params, prompts, limits, answers, budget, slots, extend = extend_setup()
  (E, K), G, L = limits.shape, FLAGS.samples, FLAGS.prompt_len
  useful = int(limits.sum())
  state = {"seed": 0}

  again = S.Sampler(cfg, max_prompt_len=L + budget, max_new_tokens=FLAGS.turn_max, slots=E, decode_chunk=16,
                    params=params)

  def reprefill():
    state["seed"] += 1
    convo = [list(prompts[e // G]) for e in range(E)]
    for k in range(K):
      out = again.generate(convo, samples_per_prompt=1, strategy=S.Temperature(1.0), seed=state["seed"], step=k,
                           max_new_tokens=limits[:, k])
      toks, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
      assert np.array_equal(lengths, limits[:, k])
      for e in range(E):
        convo[e] += toks[e, :lengths[e]].tolist() + (answers[e, k].tolist() if k + 1 < K else [])

  delay = FLAGS.tool_ms / 1e3
  fns = {"extend": extend(), "reprefill": reprefill, "async": extend(delay), "sync": extend(delay, sync=True)}
  for k, fn in fns.items():
    warm(fn, again if k == "reprefill" else slots)
  runs = timed(fns, FLAGS.reps)
  t_ext, t_re, t_async, t_sync = (float(np.median(runs[k])) for k in fns)
  ext_runs, re_runs = runs["extend"], runs["reprefill"]
  peak = workload.matmul_flops_per_s()
  # What the sampled tokens' decode steps compute (2 x matmul weights per fed token): a floor on the work.
  flops = 2.0 * workload.matmul_params(cfg) * useful
  # The stall a blocking tool adds; where the run's noise exceeds it the share is not measured (None).
  hidden = (t_sync - t_async) / (t_sync - t_ext) if t_sync > t_ext else None
  appended = int(E * (K - 1) * FLAGS.tool_tokens)
  result = dict(workload="w6", episodes=E, turns=K, useful_tokens=useful, appended_tokens=appended,
                extend_s=t_ext, extend_runs=ext_runs, extend_tokens_per_s=useful / t_ext,
                reprefill_s=t_re, reprefill_runs=re_runs, reprefill_tokens_per_s=useful / t_re,
                extend_vs_reprefill=t_re / t_ext, tool_ms=FLAGS.tool_ms, tool_async_s=t_async, tool_sync_s=t_sync,
                tool_async_runs=runs["async"], tool_sync_runs=runs["sync"], tool_latency_hidden=hidden,
                matmul_flops_per_s=peak,
                extend_share_of_matmul=flops / t_ext / peak, compiles_extend=sum(slots.trace_counts.values()),
                compiles_reprefill=sum(again.trace_counts.values()), jax=jax.__version__, tcmalloc=using_tcmalloc())
  print(f"extend {t_ext:.2f} s ({useful / t_ext:,.0f} useful tok/s) vs re-prefill {t_re:.2f} s "
        f"({useful / t_re:,.0f}): {t_re / t_ext:.2f}x; {FLAGS.tool_ms:g} ms tool: async {t_async:.2f} s, "
        f"sync {t_sync:.2f} s, " + (f"{hidden:.0%} of the stall hidden" if hidden is not None else
                                     "the stall is within the noise"), flush=True)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
