"""The reasoning-gym reward: the completion's final answer scored by the record's dataset's own scorer
(`score_answer`, in [0, 1]). The answer is the last `<answer>` tag (or box); without one, the last number
for a numeric reference, else the last non-empty line."""

from __future__ import annotations

from rlax.data import gym
from rlax.rewards import text


def _answer(completion: str, reference: str, mode: str) -> tuple[str | None, str | None]:
  if mode != "auto":
    return text.extract_final(completion, mode)
  for where in ("answer_tag", "boxed"):
    found, _ = text.extract_final(completion, where)
    if found:
      return found, where
  if text.parse_number(reference) is not None:
    return text.extract_final(completion, "last_number")
  lines = [ln.strip() for ln in completion.strip().splitlines() if ln.strip()]
  return (lines[-1], "last_line") if lines else (None, None)


def reasoning_gym_reward(completion: str, record, answer: str = "auto") -> tuple[float, dict]:
  found, where = _answer(completion, record.answer or "", answer)
  if found is None:
    return 0.0, {"reason": text.missing_reason(answer)}
  return gym.score(record, found), {"pred": found[:200], "where": where}
