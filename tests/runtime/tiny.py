"""A tiny runtime config for controller tests: small model, few steps, no SFT."""

from configs import demo


def tiny_config(workdir, **over):
  c = demo.get_config()
  c.workdir = str(workdir)
  c.model.overrides = dict(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                           mlp_dim=64)
  c.init.sft_steps = 0
  c.rollout.prompts_per_step = 4
  c.rollout.samples_per_prompt = 4
  c.rollout.max_new_tokens = 4
  c.controller.steps = 4
  c.data.n_train = 256
  c.data.n_eval = 4
  c.eval.n_samples = 2
  c.checkpoint.every_steps = 2
  for k, v in over.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c
