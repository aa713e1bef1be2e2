"""Text rewards: answer extraction, exact/normalized match, format, arithmetic, Countdown, and the
DAPO overlong length penalty.

Every reward has the registry signature `reward_fn(completion, record) -> (reward, info)`; `info`
says what was extracted and why the reward is what it is, so failures can be audited.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

from rlax.data import expr

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FORMAT = re.compile(r"^\s*(?:<think>.*?</think>\s*)?.*?<answer>.+?</answer>\s*$", re.DOTALL)


def extract_tag(completion: str) -> str | None:
  """Content of the last `<answer>...</answer>`, stripped, or None."""
  found = _TAG.findall(completion)
  return found[-1].strip() if found else None


def extract_answer(completion: str) -> str | None:
  """The `<answer>` content if present, else the last number in the text, else None."""
  tag = extract_tag(completion)
  if tag is not None:
    return tag
  nums = _NUMBER.findall(completion)
  return nums[-1] if nums else None


def normalize_answer(text: str) -> str:
  """NFKC, lower case, whitespace removed, trailing period and thousands separators dropped."""
  text = unicodedata.normalize("NFKC", text).strip().lower().rstrip(".")
  text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
  return re.sub(r"\s+", "", text)


def _need_answer(record) -> str:
  if record.answer is None:
    raise ValueError(f"record {record.id} has no reference answer for a match reward")
  return record.answer


def exact_reward(completion: str, record) -> tuple[float, dict]:
  """1.0 if the extracted answer equals the reference after `normalize_answer`."""
  pred = extract_answer(completion)
  ok = pred is not None and normalize_answer(pred) == normalize_answer(_need_answer(record))
  return float(ok), {"extracted": pred, "reason": "match" if ok else "mismatch or no answer"}


def format_reward(completion: str, record=None) -> tuple[float, dict]:
  """1.0 if the completion is (optional `<think>…</think>`) text ending in one non-empty
  `<answer>…</answer>`."""
  n_tags = completion.count("<answer>")
  ok = n_tags == 1 and bool(_FORMAT.match(completion))
  return float(ok), {"reason": "ok" if ok else f"bad format ({n_tags} answer tags)"}


def arithmetic_reward(completion: str, record) -> tuple[float, dict]:
  """1.0 if the extracted answer is the reference integer (thousands separators allowed)."""
  pred = extract_answer(completion)
  try:
    ok = pred is not None and int(normalize_answer(pred)) == int(_need_answer(record))
  except ValueError:
    return 0.0, {"extracted": pred, "reason": "answer is not an integer"}
  return float(ok), {"extracted": pred, "reason": "correct" if ok else "wrong value"}


def countdown_reward(completion: str, record) -> tuple[float, dict]:
  """1.0 if the `<answer>` expression uses exactly the given numbers (as a multiset) and evaluates,
  by the safe parser in `rlax.data.expr`, to the target."""
  meta = record.metadata
  if "numbers" not in meta or "target" not in meta:
    raise ValueError(f"record {record.id}: countdown needs metadata 'numbers' and 'target'")
  text = extract_tag(completion)
  if text is None:
    return 0.0, {"reason": "no <answer> tag"}
  if "=" in text:
    text = text.split("=")[0]  # "expr = target" is a common, harmless form
  try:
    value, used = expr.evaluate(text)
  except expr.ExprError as e:
    return 0.0, {"extracted": text, "reason": f"unparseable: {e}"}
  if sorted(used) != sorted(int(x) for x in meta["numbers"]):
    return 0.0, {"extracted": text, "reason": f"uses {sorted(used)}, must use {sorted(meta['numbers'])}"}
  ok = value == int(meta["target"])
  return float(ok), {"extracted": text, "value": str(value),
                     "reason": "correct" if ok else "wrong value"}


def overlong_penalty(lengths, max_len: int, cache_len: int) -> np.ndarray:
  """DAPO soft overlong punishment per completion length: 0 up to max_len - cache_len, then a
  linear ramp to -1 at max_len, and -1 beyond. `lengths`: [B] ints → [B] float32."""
  if not 0 < cache_len <= max_len:
    raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
  lengths = np.asarray(lengths, dtype=np.float64)
  free = max_len - cache_len
  pen = np.where(lengths <= free, 0.0, (free - lengths) / cache_len)
  return np.where(lengths > max_len, -1.0, pen).astype(np.float32)
