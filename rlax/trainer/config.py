"""The trainer's config sections: `init` (the supervised warm start) and `optimizer`."""

from __future__ import annotations

import dataclasses

from rlax.trainer.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class InitConfig:
  """Supervised warm start before RL: `sft_steps` updates of `sft_batch` rows at `sft_lr` (0: none)."""
  sft_steps: int = 0
  sft_batch: int = 64
  sft_lr: float = 1e-3

  def validate(self) -> "InitConfig":
    if self.sft_steps < 0:
      raise ValueError(f"init.sft_steps={self.sft_steps} must be >= 0")
    if self.sft_batch < 1:
      raise ValueError(f"init.sft_batch={self.sft_batch} must be >= 1")
    return self


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
  """AdamW + schedule + clipping, and how a batch splits into micro-batches on the trainer."""
  lr: float = 1e-5
  warmup_steps: int = 0
  schedule: str = "constant"
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  clip_norm: float = 1.0
  micro_batches: int = 1
  micro_batch_tokens: int = 0
  # Rows of packed real tokens the trainer computes on (rlax.rollout.packing.pack_tokens): -1 = per batch the
  # cheaper of the padded row length and a whole group's (packing.auto_row_lens), 0 = padded rows.
  pack_tokens: int = -1
  share_prompts: bool = True     # a group's responses attend to one copy of their prompt

  def optimizer(self, total_steps: int) -> OptimizerConfig:
    return OptimizerConfig(lr=self.lr, schedule=self.schedule, warmup_steps=self.warmup_steps,
                           total_steps=total_steps if self.schedule == "cosine" else None, b1=self.b1, b2=self.b2,
                           weight_decay=self.weight_decay, max_grad_norm=self.clip_norm or None)

  def validate(self) -> "OptimizerSection":
    # micro_batches and pack_tokens are checked against the rollout's rows and lengths (rlax.config).
    for ok, msg in (
        (self.micro_batch_tokens >= 0, f"optimizer.micro_batch_tokens={self.micro_batch_tokens} must be >= 0"),
        (self.schedule in ("constant", "cosine"), f"optimizer.schedule={self.schedule!r}: use 'constant' or 'cosine'"),
        (self.lr > 0, f"optimizer.lr={self.lr} must be > 0")):
      if not ok:
        raise ValueError(msg)
    return self
