"""Optimizer: AdamW with linear warm-up then constant or cosine decay, after global-norm clipping."""

from __future__ import annotations

import dataclasses
from typing import Optional

import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW hyper-parameters. `total_steps` is needed by the cosine schedule (decay to min_lr_ratio * lr)."""
  lr: float = 1e-6
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: Optional[int] = None
  min_lr_ratio: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: Optional[float] = 1.0

  def __post_init__(self):
    if self.schedule not in ("constant", "cosine"):
      raise ValueError(f"OptimizerConfig.schedule={self.schedule!r}; expected 'constant' or 'cosine'")
    if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
      raise ValueError(f"cosine schedule needs total_steps > warmup_steps={self.warmup_steps}, "
                       f"got {self.total_steps}")
    if self.lr <= 0 or self.warmup_steps < 0:
      raise ValueError(f"need lr > 0 and warmup_steps >= 0, got lr={self.lr}, warmup_steps={self.warmup_steps}")
    if self.max_grad_norm is not None and self.max_grad_norm <= 0:
      raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0 (or None for no clipping)")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """Learning rate per step: linear 0 -> lr over warmup_steps, then constant or cosine to min_lr_ratio * lr."""
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.total_steps,
                                              end_value=cfg.lr * cfg.min_lr_ratio)
  if cfg.warmup_steps:
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps),
                                 optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])
  return optax.constant_schedule(cfg.lr)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """clip_by_global_norm(max_grad_norm) then AdamW with `make_schedule(cfg)`."""
  adamw = optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
  if cfg.max_grad_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
