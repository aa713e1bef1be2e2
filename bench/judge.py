"""A generative judge's throughput (replies judged per second) vs transformers generating the same verdicts, and
against this machine's matmul rate, measured in the same run.

    python bench/judge.py                 # SmolLM2-135M-Instruct as the judge, configs/smollm2_judge.py's rubric
    python bench/judge.py --replies=64 --reps=3

Replies: --replies answers to one-digit additions (half right), graded by configs/smollm2_judge.py's judge
(`rlax.judges.Judge.grade`, one batch, greedy, its verdict budget). Timed: the median of --reps calls after the
warm-up (whose compile time is reported apart). The peer: `AutoModelForCausalLM.generate(do_sample=False)` on the
same prompt ids, left-padded into one batch, the same eos ids and budget, torch.set_num_threads(2).
useful_flops counts 2 x the matmul weights per prompt token (unpadded) and per verdict token;
share_of_matmul = useful_flops / seconds over the f32 matmul rate measured in the same run. The last output line
is one JSON object.
"""

import json
import os
import random
import time

from absl import app, flags

import workload

flags.DEFINE_string("model", "~/.cache/smollm2-135m-instruct", "the judge's HF directory")
flags.DEFINE_integer("replies", 64, "replies judged per call (the judge's slots)")
flags.DEFINE_integer("reps", 3, "timed calls after the warm-up")
flags.DEFINE_boolean("baseline", True, "also time transformers generate()")
FLAGS = flags.FLAGS


def _replies(n: int):
  from rlax.data.records import Record
  rng = random.Random(0)
  recs, texts = [], []
  for i in range(n):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    r = a + b if i % 2 == 0 else a + b + rng.choice([-2, -1, 1, 2])
    recs.append(Record(id=str(i), prompt=f"What is {a} + {b}?", answer=str(a + b)))
    texts.append(rng.choice([str(r), f"{a} + {b} = {r}", f"The answer is {r}."]))
  return texts, recs


def main(_):
  from configs import smollm2_judge
  from rlax import builders
  from rlax import config as config_lib
  c = smollm2_judge.get_config()
  c.judge.hf_checkpoint = os.path.expanduser(FLAGS.model)
  c.judge.slots = FLAGS.replies
  c.workdir = "/tmp/rlax_bench_judge"
  run = config_lib.load(c)
  rate = workload.matmul_flops_per_s()
  t0 = time.perf_counter()
  judge = builders.judge(run, None)
  judge.warm_up()
  warmup_s = time.perf_counter() - t0
  texts, recs = _replies(FLAGS.replies)
  secs, graded = workload.median_time(lambda: judge.grade(None, texts, recs), FLAGS.reps)
  prompts = [judge.prompt(t, r)[0] for t, r in zip(texts, recs)]
  said = [judge.tokenizer.encode(i["judge"], add_special_tokens=False) for _, i in graded]
  per_token = 2 * workload.matmul_params(judge.engine.cfg)
  useful = per_token * (sum(map(len, prompts)) + sum(len(s) + 1 for s in said))
  out = {"replies": FLAGS.replies, "warmup_s": round(warmup_s, 1), "judge_s": round(secs, 3),
         "judged_per_s": round(FLAGS.replies / secs, 3), "mean_prompt_tokens": round(sum(map(len, prompts)) /
                                                                                     len(prompts), 1),
         "max_prompt_len": run.judge.max_prompt_len, "failed": sum(i["metrics"]["judge_failed"] for _, i in graded),
         "matmul_flops_per_s": round(rate / 1e9, 1) * 1e9,
         "share_of_matmul": round(useful / secs / rate, 3)}
  if FLAGS.baseline:
    import torch
    import transformers
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(run.judge.hf_checkpoint, torch_dtype=torch.float32)
    L = max(map(len, prompts))
    pad = judge.tokenizer.pad_id
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    gen = lambda: model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=run.judge.max_new_tokens,
                                 eos_token_id=list(judge.tokenizer.eos_ids), pad_token_id=pad)
    with torch.no_grad():
      peer_s, _ = workload.median_time(gen, FLAGS.reps)
    out.update(peer_s=round(peer_s, 3), peer_judged_per_s=round(FLAGS.replies / peer_s, 3),
               speedup_vs_peer=round(peer_s / secs, 3))
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
