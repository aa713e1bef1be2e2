"""Supervised warm start before RL: prompt + reference answer batches and the update loop."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from absl import logging
import numpy as np

from rlax.data.prompts import PromptRenderer, response_ids
from rlax.data.records import Record
from rlax.trainer.batch import SFTBatch, response_loss_mask


def sft_target(record: Record, style: str) -> str:
  """The supervised response for a record: the bare answer ('compact') or inside <answer> tags."""
  if record.answer is None:
    raise ValueError(f"record {record.id} has no reference answer to warm-start on")
  return record.answer if style == "compact" else f"<answer>{record.answer}</answer>"


def sft_batch(render: PromptRenderer, records: Sequence[Record], style: str, prompt_len: int, response_len: int) -> SFTBatch:
  """Prompt (left-padded to prompt_len) + target + EOS (right-padded to response_len); loss on the target."""
  B, T = len(records), prompt_len + response_len
  toks = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), bool)
  for i, r in enumerate(records):
    p = render.encode(r)
    if len(p) > prompt_len:  # never train on a cut prompt (the controller drops those before the warm start)
      raise ValueError(f"record {r.id}: its prompt has {len(p)} tokens, more than rollout.max_prompt_len={prompt_len}")
    a = response_ids(render.tokenizer, sft_target(r, style))[:response_len]
    toks[i, prompt_len - len(p):prompt_len] = p
    toks[i, prompt_len:prompt_len + len(a)] = a
    mask[i, prompt_len - len(p):prompt_len + len(a)] = True
  return SFTBatch(toks, mask, response_loss_mask(mask, prompt_len))


def sft_warm_start(trainer, state, render: PromptRenderer, records: Sequence[Record], *, steps: int, batch: int, style: str,
                   prompt_len: int, response_len: int, log_every: int = 50, start: int = 0,
                   should_stop: Callable[[], bool] = lambda: False) -> tuple[Any, int]:
  """Supervised updates `start`..`steps`-1 over `records` (in order, wrapping) → (state, steps done).

  Stops early, between updates, once `should_stop()` (a preemption notice): the caller checkpoints the
  state with the count so that a restart continues from there. A non-finite loss or gradient leaves the
  state unchanged (trainer.state.apply_gradients) and is logged.
  """
  skipped = 0.0
  for s in range(start, steps):
    if should_stop():
      logging.warning("sft warm start stopped after %d/%d steps", s, steps)
      return state, s
    lo = (s * batch) % max(1, len(records) - batch)
    state, m = trainer.sft_step(state, sft_batch(render, records[lo:lo + batch], style, prompt_len,
                                                 response_len))
    skipped = skipped + (1.0 - m["finite"])  # on the device: no host sync per update
    if s % log_every == 0 or s == steps - 1:
      logging.info("sft step %d/%d: loss %.4f", s + 1, steps, float(m["loss"]))
      if float(skipped):
        logging.warning("sft: %d non-finite updates skipped so far", int(skipped))
  return state, steps
