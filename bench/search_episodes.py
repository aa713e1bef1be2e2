"""Search episodes (workload W8): 64 episodes of --searches searches each on the W1 model over a BM25 index of
--passages passages, with retrieval overlapped against a blocking retriever.

    python bench/search_episodes.py             # W8: the W1 model, 16 prompts x 4 samples = 64 episodes

Every episode has --searches + 1 policy turns; turn k of episode e samples limits[e, k] tokens (seed 0, uniform
in [--turn_min, --turn_max]). Each turn but the last is a search: its query is the turn's first 8 token ids as
corpus words, and the top --top_k passages come back as appended tokens (each passage's words as ids, at most
--passage_tokens of them). Useful tokens are the sampled ones. Timed, in turn, --reps rounds (medians), after
warm-ups that compile what the calls use:
  overlapped  the run's path: the environment awaits rlax's RetrievalService (one retriever call per window of
              concurrent searches) on the episode loop while the other rows decode;
  blocking    a search calls the retriever itself, one query at a time, and decoding waits for every answer
              (EpisodeStream sync=True): what a rollout loop that runs tools inline does;
  instant     the same passages precomputed (no retrieval at all): the ceiling.
retrieval_hidden = (blocking - overlapped) / (blocking - instant). The run's f32 matmul rate is reported with
it (workload.matmul_flops_per_s). The last output line is one JSON object.
"""

import json
import os
import sys
import tempfile

from absl import app, flags
import numpy as np

import episodes as w6
import retrieval as retrieval_bench
import workload

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

flags.DEFINE_integer("searches", 2, "searches per episode")
flags.DEFINE_integer("top_k", 3, "passages per search")
flags.DEFINE_integer("passage_tokens", 24, "tokens of a passage in the tool turn")
flags.DEFINE_integer("search_passages", 100_000, "passages in the corpus")
FLAGS = flags.FLAGS


def main(_):
  from rlax.allocator import set_up, using_tcmalloc
  set_up()
  import jax
  from rlax import envs
  from rlax import sampler as S
  from rlax.envs import retrieval

  K, V, A = FLAGS.searches + 1, FLAGS.vocab, FLAGS.top_k * FLAGS.passage_tokens
  cfg, params, rng, prompts, limits = w6.episodes_setup(K)
  P, G, L = FLAGS.prompts, FLAGS.samples, FLAGS.prompt_len
  E = P * G
  useful = int(limits.sum())
  budget = FLAGS.turn_max * K + A * (K - 1)

  tmp = tempfile.mkdtemp()
  path = os.path.join(tmp, "corpus.jsonl")
  retrieval_bench.corpus(path, FLAGS.search_passages, rng)
  bm25 = retrieval.BM25Retriever(path, index_dir=os.path.join(tmp, "index"))
  service = retrieval.RetrievalService(bm25)
  query = lambda tokens: " ".join(f"w{int(t) % 2000}" for t in tokens[:8])  # frequent words: real postings

  def answer(hits) -> list[int]:
    ids = [3 + int(w[1:]) % (V - 3) for p in hits for w in p.text.split()[:FLAGS.passage_tokens]]
    return (ids + [2] * A)[:A]  # a fixed width: every variant appends the same number of tokens

  class Search(envs.Environment):
    """Episode e: turn k samples limits[e, k] tokens; turns before the last search (how: `mode`)."""

    def __init__(self, e, mode):
      self.e, self.mode = e, mode

    async def reset(self, record):
      return envs.Observation(prompts[record], max_new_tokens=int(limits[self.e, 0]))

    async def step(self, turn):
      k = turn.index
      if k + 1 == K:
        return envs.StepResult(reward=1.0, done=True, stop_reason="final_answer")
      q = query(turn.tokens)
      if self.mode == "overlapped":
        hits = await service.search(q, FLAGS.top_k)
      elif self.mode == "blocking":
        hits = bm25.search([q], FLAGS.top_k)[0]
      else:  # the overlapped call before it drew the same tokens (same seed), so asked the same queries
        hits = seen.get(q)
        if hits is None:
          misses[0] += 1
          hits = bm25.search([q], FLAGS.top_k)[0]
      seen[q] = hits
      return envs.StepResult(tokens=answer(hits), max_new_tokens=int(limits[self.e, k + 1]), calls=("ok",))

  slots = S.Sampler(cfg, max_prompt_len=L, max_new_tokens=budget, slots=E, decode_chunk=16, params=params)
  state, seen, misses = {"seed": 0}, {}, [0]

  def run(mode):
    def call():
      state["seed"] += mode != "instant"  # instant replays the overlapped call before it
      made = []

      def make():
        made.append(Search(len(made), mode))
        return made[-1]
      with envs.EpisodeStream(slots.stream(S.Temperature(1.0)), make, sync=mode == "blocking") as eps:
        done = eps.run(list(range(P)), samples_per_prompt=G, seed=state["seed"])
      assert sum(int(f.out.sampled.sum()) for f in done) == useful
    return call

  fns = {"overlapped": run("overlapped"), "instant": run("instant"), "blocking": run("blocking")}
  for fn in fns.values():
    w6.warm(fn, slots)
  runs = w6.timed(fns, FLAGS.reps)
  t_over, t_inst, t_block = (float(np.median(runs[k])) for k in fns)
  peak = workload.matmul_flops_per_s()
  flops = 2.0 * workload.matmul_params(cfg) * useful
  result = dict(workload="w8", episodes=E, searches=FLAGS.searches, passages=FLAGS.search_passages,
                useful_tokens=useful, appended_tokens=int(E * (K - 1) * A), retriever_batches=service.batches,
                retriever_queries=service.queries, instant_misses=misses[0], **{f"{k}_s": float(np.median(v)) for k, v in runs.items()},
                **{f"{k}_runs": v for k, v in runs.items()},
                **{f"{k}_tokens_per_s": useful / float(np.median(v)) for k, v in runs.items()},
                overlapped_vs_blocking=t_block / t_over,
                retrieval_hidden=(t_block - t_over) / max(t_block - t_inst, 1e-9), matmul_flops_per_s=peak,
                overlapped_share_of_matmul=flops / t_over / peak, jax=jax.__version__, tcmalloc=using_tcmalloc())
  service.close()
  print(f"overlapped {t_over:.2f} s ({useful / t_over:,.0f} useful tok/s), blocking {t_block:.2f} s "
        f"({useful / t_block:,.0f}), instant {t_inst:.2f} s: {t_block / t_over:.2f}x, "
        f"{result['retrieval_hidden']:.0%} of the retrieval stall hidden", flush=True)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
