"""Post-train SmolLM2-135M-Instruct (a real pretrained HF model) with GRPO on held-out arithmetic.

  python -m launch.fetch_model smollm2 --out=~/.cache/smollm2-135m-instruct   # the model, once
  python -m launch.main --config=configs/smollm2.py
  python -m launch.main --config=configs/smollm2.py --config.model.hf_checkpoint=/path/to/any/llama-or-qwen
  python -m launch.main --config=configs/smollm2.py:smoke   # 2 RL steps, 8 eval prompts: does it all run?
  python -m launch.main --config=configs/smollm2.py:lora    # the same with LoRA adapters (rank 8, lr 2e-4)

The policy and the reference come from the HF directory (config.json, safetensors), and so do the tokenizer,
chat template and stop tokens. Problems: one-digit addition/subtraction from rlax's generator
(`data.task=arithmetic`, difficulty 1), rendered with the model's chat template; the final answer is the
`<answer>` tag's content or else the last number in the reply. No SFT warm start. On this 2-core CPU the
compute dtype is float32 (XLA:CPU runs bf16 matmuls no faster); on accelerators drop the override to get
the HF default, bf16 compute over f32 master weights. The final policy is exported as an HF directory to
<workdir>/export.
"""

import os

from configs import base


def get_config(arg: str | None = None):
  c = base.get_config()
  c.workdir = "runs/smollm2"
  c.model.hf_checkpoint = os.path.expanduser("~/.cache/smollm2-135m-instruct")
  c.model.overrides = dict(dtype="float32")
  # One CPU device trains, one samples; weights cross by device-to-device copy.
  c.topology.update(slice_size=1, trainer_slices=1, sampler_slices=1,
                    trainer_mesh=dict(data=1, fsdp=-1, tensor=1), sampler_mesh=dict(data=-1, fsdp=1, tensor=1))
  c.algorithm.update(name="grpo", kl_coef=0.0)
  # One 640-token packed row per micro-batch: a third of the activations of three, at the same step time.
  c.optimizer.update(lr=2e-5, warmup_steps=0, clip_norm=1.0, micro_batch_tokens=1024)
  c.rollout.update(prompts_per_step=8, samples_per_prompt=8, max_prompt_len=48, max_new_tokens=64, temperature=1.0)
  c.controller.update(steps=20, max_staleness=1, queue_size=1)
  c.data.update(task="arithmetic", difficulty=1, n_train=2048, n_eval=128,
                system_prompt="You are a calculator. Reply with the result only.")
  c.reward.update(name="arithmetic", answer="auto")
  c.eval.update(n_samples=8, temperature=1.0)
  c.checkpoint.update(every_steps=10)
  if arg == "smoke":
    c.workdir = "runs/smollm2_smoke"
    c.controller.steps = 2
    c.data.n_eval = 8
    c.eval.n_samples = 2
  elif arg == "lora":  # the same task and budget with rank-8 adapters on every linear layer
    c.workdir = "runs/smollm2_lora"
    c.model.lora.update(rank=8, alpha=16.0, targets="all")
    c.optimizer.lr = 2e-4  # adapters want ~10x the full fine-tuning rate
  elif arg:
    raise ValueError(f"configs/smollm2.py: unknown argument {arg!r}; use 'smoke' or 'lora'")
  return c
