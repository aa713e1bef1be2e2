"""Base rlax config: every field the runtime reads, with defaults (typed and validated by rlax.config.load).

  python -m launch.main --config=configs/base.py --config.algorithm.name=dapo

Other configs start from `get_config()` here and override what differs.
"""

import ml_collections

def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = "runs/base"
  c.deterministic = False  # fixed staleness schedule ⇒ bitwise-reproducible resume

  # Model: a preset name plus field overrides, or hf_checkpoint: a local HF directory (config.json,
  # safetensors, tokenizer) whose config and weights the policy starts from (overrides still apply).
  # lora: low-rank adapters on the trainer (rank 0: every weight trains); targets "all", "attention", "mlp" or
  # names (q,k,v,o,gate,up,down); adapters commonly want ~10x the full fine-tuning learning rate.
  c.model = ml_collections.ConfigDict(dict(preset="w1", overrides={}, hf_checkpoint="",
                                           lora=dict(rank=0, alpha=16.0, dropout=0.0, targets="all")))
  c.init = ml_collections.ConfigDict(dict(sft_steps=0, sft_batch=64, sft_lr=1e-3))

  # Devices → slices → roles.
  c.topology = ml_collections.ConfigDict(dict(
      slice_size=2,              # simulated slice size on CPU/GPU; TPU uses device.slice_index
      trainer_slices=2,
      sampler_slices=2,
      colocated=False,           # True: trainer and sampler time-share the same slices
      trainer_mesh=dict(data=1, fsdp=-1, tensor=1),
      sampler_mesh=dict(data=-1, fsdp=1, tensor=1),
  ))

  c.algorithm = ml_collections.ConfigDict(dict(name="grpo", kl_coef=0.0, kl_estimator="k3",
                                               entropy_coef=0.0, overrides={}))
  c.optimizer = ml_collections.ConfigDict(dict(lr=1e-5, warmup_steps=0, schedule="constant",
                                               weight_decay=0.0, b1=0.9, b2=0.999, clip_norm=1.0,
                                               micro_batches=1, micro_batch_tokens=0,
                                               pack_tokens=-1, share_prompts=True))

  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=16,
      samples_per_prompt=8,
      max_prompt_len=32,
      max_new_tokens=64,
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      decode_chunk=16,           # decode steps between admissions (and weight swaps)
      inflight_updates=False,    # swap in the newest weights between chunks, not only between batches
      slots=0,                   # decode slots (0: the batch's rows; -1: as many as the free memory holds)
      stream_ahead=-1,           # prompts in flight for the next batch (-1: prompts_per_step)
      on_swap="recompute",       # unfinished rows' KV cache under new weights, or "keep" it
  ))

  c.controller = ml_collections.ConfigDict(dict(
      steps=100,
      max_staleness=1,           # k: a sample is at most k policy versions old
      stale_policy="drop",       # or "importance_weight"
      push_every=1,              # trainer pushes weights every N steps
      queue_size=2,
      dynamic_sampling=False,
      on_nonfinite="skip",       # a non-finite reward, loss or grad norm: "skip" the batch (counted) or "stop"
  ))

  # prompt_style: "instruct" (the task's own prompt, answer in <answer> tags) or "compact"
  # (arithmetic only: "12+34=" → "46"); ops: keep arithmetic problems using only these operators.
  # task: a built-in task, "reasoning_gym:<dataset>" or a mixture "a=2,b=1"; task_options: JSON options.
  # train_files / eval_files: the user's .jsonl / .json / .parquet prompts or datasets directories
  # (comma-separated) instead of the task; prompt_key / messages_key / answer_key: the files' field names
  # (dotted paths); answer_format "gsm8k": the answer after "####". template: "chat" / "plain" / "auto"
  # (chat when the tokenizer has a template); instruction: the user turn around {prompt}.
  c.data = ml_collections.ConfigDict(dict(task="arithmetic", task_options="", difficulty=1, n_train=4096,
                                          n_eval=128, eval_seed=12345, prompt_style="instruct", ops="",
                                          train_files="", eval_files="", prompt_key="", messages_key="",
                                          answer_key="", answer_format="", template="auto", system_prompt="",
                                          instruction="{prompt}"))
  # answer: where the final answer is found ("auto", "boxed", "last_number", "answer_tag");
  # format_weight: reward for stating it in that format. Each grading runs in a process under a deadline
  # (timeout_s), an address-space cap (memory_mb) and a size limit (max_chars: longer completions score 0).
  # sandbox: "auto" runs policy-written code in the jail (bubblewrap + seccomp) and refuses without one;
  # "unsafe" is the explicit opt-in to run it with resource limits only (README: Security).
  c.reward = ml_collections.ConfigDict(dict(name="arithmetic", answer="auto", format_weight=0.0, workers=4,
                                            timeout_s=5.0, memory_mb=4096, max_chars=1 << 20, sandbox="auto"))
  # Multi-turn episodes (rlax.envs): name "" = one-shot rollouts; "calculator", "retry", "single_turn" or
  # "module:Class".
  c.env = ml_collections.ConfigDict(dict(name="", renderer="auto", max_turns=4, max_tool_calls=4, turn_tokens=0,
                                         context_tokens=0, tool_timeout_s=5.0, tool_output_chars=1000,
                                         tools_available=True, examples=2,
                                         retry_message="That is not right. Think again and give the answer."))
  # On data.n_eval held-out prompts; greedy: also greedy accuracy.
  c.eval = ml_collections.ConfigDict(dict(n_samples=8, temperature=1.0, greedy=False))
  # export_every > 0: also write an HF directory every N steps (the final policy always goes to workdir/export).
  c.checkpoint = ml_collections.ConfigDict(dict(every_steps=50, every_seconds=600.0, keep=3,
                                                grace_seconds=30.0, export_every=0))
  # Simulated slice preemption (rlax.runtime.failover): "slice:step,..." loses / restores a slice at a step
  # boundary; kill_in_recovery "phase[:kill|term],..." signals the process inside recovery phases (tests).
  c.faults = ml_collections.ConfigDict(dict(lose_slice_at="", restore_slice_at="", kill_in_recovery=""))
  return c
