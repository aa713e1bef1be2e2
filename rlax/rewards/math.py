"""Math answers graded by math-verify: LaTeX, fractions, equivalent forms, `\\boxed{}` extraction.

The reference is parsed as LaTeX-or-expression (a bare `1/2` or `\\frac12` both work); the
completion's `<answer>` content is graded if present, otherwise the whole completion (math-verify
then prefers the last `\\boxed{}`). math-verify's own timeouts use SIGALRM, which only works on the
main thread, and graders run in the verifier pool's threads — so both are disabled here and the
pool's per-call timeout bounds a pathological input instead.
"""

from __future__ import annotations

import math_verify

from rlax.rewards import text as text_rewards


def _parse(s: str):
  return math_verify.parse(s, parsing_timeout=None)


def math_reward(completion: str, record) -> tuple[float, dict]:
  """1.0 if the completion's final answer is mathematically equal to `record.answer`."""
  if record.answer is None:
    raise ValueError(f"record {record.id} has no reference answer for the math reward")
  # As LaTeX first: a bare parse reads `2\sqrt{2}` as just `2`.
  gold = _parse(f"${record.answer}$") or _parse(record.answer)
  if not gold:
    raise ValueError(f"record {record.id}: math-verify cannot parse the reference {record.answer!r}")
  tag = text_rewards.extract_tag(completion)
  pred_text = completion if tag is None else (tag if "\\boxed" in tag or "$" in tag else f"${tag}$")
  pred = _parse(pred_text)
  if not pred:
    return 0.0, {"reason": "no parseable answer", "extracted": None}
  ok = math_verify.verify(gold, pred, timeout_seconds=None)
  return float(ok), {"extracted": str(pred[-1]), "reason": "equivalent" if ok else "not equivalent"}
