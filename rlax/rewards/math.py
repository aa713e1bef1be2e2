"""Math answers graded by math-verify: LaTeX, fractions, equivalent forms, `\\boxed{}` extraction.

The reference is parsed as LaTeX-or-expression (a bare `1/2` or `\\frac12` both work). Which part
of the completion is graded is the answer mode (`text.ANSWER_MODES`):

* 'auto' (default, the original behaviour): the `<answer>` content if present, otherwise the whole
  completion, read by math-verify's own final-answer search (the last `\\boxed{}`, then phrases
  like "the answer is 7", then the last expression). This is a superset of "tag, else box, else last
  number" that also reads `$\\frac{\\pi}{2}$` at the end of a sentence, so it stays the default.
* 'boxed' / 'last_number' / 'answer_tag': only that part (`text.extract_final`); nothing else in
  the completion can earn the reward.

math-verify's own timeouts use SIGALRM, which only works on the main thread and cannot interrupt
one long C-level operation (`9^{9^{9^{9}}}` is a bigint power) — so both are disabled here, and the
verifier pool's per-item deadline, which kills the grading process, bounds a pathological input.
"""

from __future__ import annotations

import logging

import math_verify

from rlax.rewards import text as text_rewards


class _QuietDisabledTimeout(logging.Filter):
  """Drops math-verify's "Timeout is disabled" warning: disabling it is deliberate (see above)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_name).addFilter(_QuietDisabledTimeout())


def _parse(s: str):
  return math_verify.parse(s, parsing_timeout=None)


def _as_latex(extracted: str, where: str) -> str:
  """The extracted answer as text math-verify reads as one expression."""
  if where == "boxed":
    return f"\\boxed{{{extracted}}}"
  if where == "last_number":  # thousands commas would read as a tuple outside a box
    return "$" + extracted.replace(",", "").replace("\u2212", "-") + "$"
  return extracted if "\\boxed" in extracted or "$" in extracted else f"${extracted}$"


def math_reward(completion: str, record, answer: str = "auto") -> tuple[float, dict]:
  """1.0 if the completion's final answer (found per `answer`, see module docstring) is
  mathematically equal to `record.answer`."""
  text_rewards.check_answer_mode(answer)
  if record.answer is None:
    raise ValueError(f"record {record.id} has no reference answer for the math reward")
  # As LaTeX first: a bare parse reads `2\sqrt{2}` as just `2`.
  gold = _parse(f"${record.answer}$") or _parse(record.answer)
  if not gold:
    raise ValueError(f"record {record.id}: math-verify cannot parse the reference {record.answer!r}")
  if answer == "auto":
    tag = text_rewards.extract_tag(completion)
    where = "math-verify" if tag is None else "answer_tag"
    extracted, pred_text = tag, completion if tag is None else _as_latex(tag, where)
  else:
    extracted, where = text_rewards.extract_final(completion, answer)
    if extracted is None:
      return 0.0, {"extracted": None, "mode": answer, "reason": text_rewards.missing_reason(answer)}
    pred_text = _as_latex(extracted, where)
  pred = _parse(pred_text)
  if not pred:
    return 0.0, {"extracted": extracted, "mode": answer, "found_by": where,
                 "reason": "no parseable answer"}
  ok = math_verify.verify(gold, pred, timeout_seconds=None)
  # `extracted`: the text graded (what math-verify found, for 'auto' without a tag); `parsed`: its value.
  return float(ok), {"extracted": str(pred[-1]) if extracted is None else extracted,
                     "parsed": str(pred[-1]), "mode": answer, "found_by": where,
                     "reason": "equivalent" if ok else "not equivalent"}
