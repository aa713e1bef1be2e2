"""W3 benchmark: full GRPO iterations of the rlax controller (generate, reward, reference log-probs, update, push).

    python bench/iteration.py                       # W3 on the W1 model, synchronous (k=0)
    python bench/iteration.py --max_staleness=1     # pipelined: batch s+1 generates while step s trains

Workload (shared/bench-peers README, W3): random W1-shape model; per iteration 16 new prompts
(BOS + 31 ids in [3, 1024)) x 8 samples, up to 64 new tokens at temperature 1 with EOS (id 2) live,
reward = fraction of even completion token ids, group-normalized GRPO advantages, k3 KL to the
reference (beta 0.04), one AdamW update (lr 1e-5), then the weight push to the sampler. It runs the
real `Controller` on `--cpu_devices` fake CPU devices split into a trainer and a sampler submesh.
The iteration time is the controller's step time; we report the median over the iterations after
the first `--warmup` (compiles), with the per-role time split. The last output line is one JSON object.
"""

import json
import os
import statistics
import sys
import tempfile

from absl import app, flags

import workload

flags.DEFINE_integer("iters", 6, "timed iterations")
flags.DEFINE_integer("warmup", 2, "untimed first iterations (compilation)")
flags.DEFINE_integer("max_staleness", 0, "k: 0 = synchronous on-policy, 1 = one-step pipelined")
flags.DEFINE_integer("cpu_devices", 2, "fake CPU devices (half trainer, half sampler)")
flags.DEFINE_boolean("colocated", False, "trainer and sampler time-share all --cpu_devices (data-parallel) "
                     "instead of half each")
flags.DEFINE_integer("decode_chunk", 16, "rollout.decode_chunk (decode steps between admissions)")
flags.DEFINE_integer("micro_batch_tokens", 4096, "optimizer.micro_batch_tokens (per-device token budget of a "
                     "micro-batch; 0: one micro-batch)")
FLAGS = flags.FLAGS


def _tokenizer(vocab: int):
  """Token id i is the word 't<i>' (as the peers' benchmarks do); ids 0-2 are pad, bos, eos; BOS first."""
  import tokenizers
  from tokenizers import models, pre_tokenizers, processors
  from rlax.models.hf_tokenizer import Tokenizer
  words = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
  words.update({f"t{i}": i for i in range(3, vocab)})
  tok = tokenizers.Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
  return Tokenizer.from_backend(tok, bos="<bos>", eos="<eos>", pad="<pad>")


def _even_fraction(completion: str, record):
  ids = [int(w[1:]) for w in completion.split() if w.startswith("t") and w[1:].isdigit()]
  return (sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0), {}


def main(argv):
  del argv
  from rlax.allocator import set_up, using_tcmalloc
  set_up()
  import jax
  jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  import numpy as np
  from configs import base
  from rlax.runtime import Controller
  from rlax.data.records import Record

  n_iter = FLAGS.warmup + FLAGS.iters
  c = base.get_config()
  c.workdir = tempfile.mkdtemp(prefix="rlax_w3_")
  c.model.overrides = workload.model_overrides()
  if FLAGS.colocated:
    c.topology.update(slice_size=FLAGS.cpu_devices, trainer_slices=1, sampler_slices=1, colocated=True,
                      trainer_mesh=dict(data=-1, fsdp=1, tensor=1))
  else:
    c.topology.update(slice_size=FLAGS.cpu_devices // 2, trainer_slices=1, sampler_slices=1)
  c.algorithm.update(name="grpo", kl_coef=0.04, kl_estimator="k3")
  c.optimizer.update(lr=1e-5, micro_batch_tokens=FLAGS.micro_batch_tokens)
  c.rollout.update(prompts_per_step=FLAGS.prompts, samples_per_prompt=FLAGS.samples,
                   max_prompt_len=FLAGS.prompt_len, max_new_tokens=FLAGS.new_tokens, temperature=1.0,
                   decode_chunk=FLAGS.decode_chunk)
  c.controller.update(steps=n_iter, max_staleness=FLAGS.max_staleness, queue_size=max(1, FLAGS.max_staleness))
  c.checkpoint.update(every_steps=0, every_seconds=0.0)
  c.eval.n_samples = 1
  rng = np.random.default_rng(0)
  recs = [Record(id=str(i), prompt=" ".join(f"t{t}" for t in rng.integers(3, FLAGS.vocab, FLAGS.prompt_len - 1)),
                 answer="") for i in range(FLAGS.prompts * n_iter)]
  ctl = Controller(c, progress=False, tokenizer=_tokenizer(FLAGS.vocab), records=(recs, recs[:1]),
                   reward_fn=_even_fraction)
  ctl.run()
  rows = ctl.metrics.history[FLAGS.warmup:]
  med = lambda k: statistics.median(r[k] for r in rows)
  out = {"iter_s": med("step_s"), "gen_s": med("gen_s"), "reward_s": med("reward_s"), "train_s": med("train_s"),
         "sync_s": med("sync_total_s"), "trainer_idle_s": med("trainer_idle_s"),
         "sampler_idle_s": med("sampler_idle_s"), "response_len": med("response_len"),
         "iters": len(rows), "max_staleness": FLAGS.max_staleness, "devices": FLAGS.cpu_devices,
         "colocated": FLAGS.colocated, "decode_chunk": FLAGS.decode_chunk, "tcmalloc": using_tcmalloc()}
  for r in rows:
    print(f"iter {r['step']}: {r['step_s']:.3f}s (gen {r['gen_s']:.3f} train {r['train_s']:.3f} "
          f"sync {r['sync_total_s']:.3f} trainer idle {r['trainer_idle_s']:.3f}; {r.get('train_rows')} rows x "
          f"{r.get('train_row_len')} in {r.get('micro_batches')} micro-batches, {r.get('compiles')} compiles)")
  print(json.dumps(out))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)
