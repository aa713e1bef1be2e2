"""A tiny RL loop as a 2-process job: the trainer on process 0's devices, the sampler on process 1's.

  python -m launch.multihost --num_processes=2 -- python -m launch._mh_rl --steps=30

The demo task (configs/demo.py): SFT warm start on process 0, then each step process 1 samples and grades
a batch, sends it to process 0 (`broadcast_one_to_all`, a collective: there is no device_put between
processes), process 0 takes one GRPO step and pushes the new weights with `CrossMeshPush`. On-policy
(staleness 0), one step at a time: it shows the multi-process plumbing, not overlap. Process 1 prints one
JSON line per step with the mean reward and a last line with the first/last 5-step means.
"""

import json
import time

from absl import app, flags

STEPS = flags.DEFINE_integer("steps", 30, "RL steps.")
SFT_STEPS = flags.DEFINE_integer("sft_steps", 150, "Supervised warm-start steps on process 0.")
CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 4, "Fake CPU devices per process.")


def main(argv):
  del argv
  from rlax import multihost
  pid, _ = multihost.init_from_env(cpu_devices=CPU_DEVICES.value)
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from configs import demo
  from rlax import builders, models as M, rewards, rollout as R
  from rlax.data import tokenizer as tok_lib
  from rlax.data.pipeline import RecordIterator
  from rlax.topology import build_topology
  from rlax.trainer import OptimizerConfig, Trainer

  c = demo.get_config()
  r = c.rollout
  cfg, algo = builders.model_config(c), builders.algorithm(c)
  topo = build_topology(dict(slice_size=CPU_DEVICES.value, trainer_slices=1, sampler_slices=1,
                             trainer_mesh=dict(fsdp=-1), sampler_mesh=dict(data=-1)))
  push = multihost.CrossMeshPush(topo.trainer_mesh, topo.sampler_mesh, M.param_shardings(cfg, topo.sampler_mesh),
                                 dtype=cfg.dtype)
  shapes = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
  tokenizer = tok_lib.load_demo_tokenizer()
  train, _ = builders.datasets(c)
  P, G = r.prompts_per_step, r.samples_per_prompt
  state = None
  if pid == 0:
    trainer = Trainer(cfg, algo, builders.optimizer(c, STEPS.value), topo.trainer_mesh, group_size=G,
                      temperature=r.temperature)
    sft = Trainer(cfg, algo, OptimizerConfig(lr=c.init.sft_lr, warmup_steps=10), topo.trainer_mesh, group_size=1)
    state = R.sft_warm_start(sft, sft.init_state(M.create_params(cfg, topo.trainer_mesh, seed=c.seed)), tokenizer,
                             train, steps=SFT_STEPS.value, batch=c.init.sft_batch, style=c.data.prompt_style,
                             prompt_len=r.max_prompt_len, response_len=r.max_new_tokens)
    state = trainer.init_state(state.params)
  else:
    sampler = R.make_sampler(c, cfg, topo.sampler_mesh)
    method = R.strategy(r.temperature, r.top_k, r.top_p)
    reward_fn, data = rewards.get(c.reward.name), RecordIterator(train, seed=c.seed)
  template = R.empty_batch(P * G, r.max_prompt_len, r.max_new_tokens)
  means = []
  for step in range(STEPS.value + 1):
    t0 = time.perf_counter()
    pushed = push(state.params if pid == 0 else None, shapes=shapes)
    if step == STEPS.value:
      break
    batch = template
    if pid == 1:
      sampler.update_weights(pushed, version=step)
      records = data.next_batch(P)
      out = sampler.generate(R.encode_prompts(tokenizer, records), samples_per_prompt=G, strategy=method,
                             seed=c.seed, step=step, prompt_ids=[step * P + i for i in range(P)])
      texts = R.completions(tokenizer, out)
      rew = np.array([reward_fn(t, rec)[0] for t, rec in zip(texts, [x for x in records for _ in range(G)])],
                     np.float32)
      batch = R.pack(out, rew, sampler.max_prompt_len)
      means.append(float(rew.mean()))
    multihost.barrier(f"rollout_{step}")  # generation takes longer than gloo waits for a peer
    batch = multihost_utils.broadcast_one_to_all(jax.tree.map(np.asarray, batch), is_source=pid == 1)
    if pid == 0:
      state, metrics = trainer.step(state, jax.tree.map(np.asarray, batch))
    else:
      print(json.dumps({"step": step, "reward": means[-1], "s": round(time.perf_counter() - t0, 2)}), flush=True)
  if pid == 1:
    k = min(5, len(means))
    print(json.dumps({"first_reward": float(np.mean(means[:k])), "last_reward": float(np.mean(means[-k:])),
                      "steps": len(means)}), flush=True)


if __name__ == "__main__":
  app.run(main)
