"""Runtime test configs: the demo config with dotted overrides, and a tiny variant (small model, no SFT)."""

from configs import demo

TINY = {
    "model.overrides": dict(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                            mlp_dim=64),
    "init.sft_steps": 0, "rollout.prompts_per_step": 4, "rollout.samples_per_prompt": 4,
    "rollout.max_new_tokens": 4, "controller.steps": 4, "data.n_train": 256, "data.n_eval": 4,
    "eval.n_samples": 2, "checkpoint.every_steps": 2,
}


def demo_config(workdir, **over):
  """The demo config in `workdir` with `{"a.b": value}` overrides applied."""
  c = demo.get_config()
  c.workdir = str(workdir)
  for k, v in over.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c


def tiny_config(workdir, **over):
  return demo_config(workdir, **{**TINY, **over})
