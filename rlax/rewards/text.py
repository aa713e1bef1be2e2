"""Text rewards: answer extraction, exact/normalized match, format, arithmetic, Countdown, and the
DAPO overlong length penalty.

Every reward has the registry signature `reward_fn(completion, record) -> (reward, info)`; `info`
says what was extracted and why the reward is what it is, so failures can be audited.

Final answers in free model text are found by an answer mode (`ANSWER_MODES`, see
`extract_final`): 'boxed' (the last `\\boxed{...}`), 'last_number', 'answer_tag', or 'auto' (tag,
else box, else last number). The exact and arithmetic rewards take `answer=`; their default 'auto'
keeps the original extraction (tag, else last number) so existing configs grade as before.
"""

from __future__ import annotations

import fractions
import re
import unicodedata

import numpy as np

from rlax.data import expr

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

ANSWER_MODES = ("auto", "boxed", "last_number", "answer_tag")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number in prose: a LaTeX fraction, or a signed integer (thousands groups `1,234` or plain digits)
# with an optional decimal part or `/denominator`. A '-' is a sign only where it cannot be a binary
# minus (not after a word character or a closing bracket), so "10-3" yields 10 and 3; "1,2345" and
# "1,234,5" are not thousands groups.
_SIGN = r"(?:(?<![\w)\]}])[-\u2212])?"
_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)"
_LATEX_FRAC = r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}"
_NUM = re.compile(_SIGN + r"(?:" + _LATEX_FRAC + r"|" + _INT + r"(?:\.\d+|/\d+)?)")
_FULL_NUM = re.compile(r"([-\u2212]?)(?:" + _LATEX_FRAC + r"|(" + _INT + r")(?:\.(\d+)|/(\d+))?)")


def check_answer_mode(mode: str) -> str:
  """Returns `mode` if it is one of ANSWER_MODES, else one ValueError naming the config field."""
  if mode not in ANSWER_MODES:
    raise ValueError(f"reward.answer={mode!r} is not an answer mode; choose from {list(ANSWER_MODES)}")
  return mode


_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)  # `\{` and `\}` are literal braces, not grouping


def _closing_braces(text: str) -> dict[int, int]:
  """Index of each `{` -> index of its matching `}`; unclosed ones are absent. One pass: policies
  write thousands of unclosed boxes, and scanning from each one to the end would be quadratic."""
  close, stack = {}, []
  for m in _BRACE.finditer(text):
    c = m.group()
    if c == "{":
      stack.append(m.start())
    elif c == "}" and stack:
      close[stack.pop()] = m.start()
  return close


def _boxes(text: str, close: dict[int, int]) -> list[tuple[int, int, int]]:
  """(start, end, content start) of each complete top-level box, braces matched (`close` from
  `_closing_braces(text)`); unclosed ones skipped, and a later box inside one still counts."""
  out, pos = [], 0
  for m in _BOX.finditer(text):
    end = close.get(m.end() - 1)
    if m.start() < pos or end is None:
      continue
    out.append((m.start(), end + 1, m.end()))
    pos = end + 1
  return out


def extract_boxed(completion: str) -> str | None:
  """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`), stripped; None if none or empty.

  Braces nest (`\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`); a box inside a box is part of the outer
  one, except that a box whose whole content is one box is unwrapped (`\\boxed{\\boxed{3}}` gives 3).
  An unclosed box (a truncated completion) is ignored. Linear in the length of the completion.
  """
  close = _closing_braces(completion)
  boxes = _boxes(completion, close)
  if not boxes:
    return None
  _, end, start = boxes[-1]
  end -= 1  # the content is completion[start:end]
  while True:
    while start < end and completion[start].isspace():
      start += 1
    while end > start and completion[end - 1].isspace():
      end -= 1
    inner = _BOX.match(completion, start)
    if start == end or inner is None or close.get(inner.end() - 1) != end - 1:
      break
    start = inner.end()
    end -= 1
  return completion[start:end] or None


def extract_last_number(completion: str) -> str | None:
  """The last number in the text, as written: `42`, `-3.5`, `1,234`, `3/4`, `\\frac{3}{4}`; or None."""
  found = [m.group(0) for m in _NUM.finditer(completion)]
  return found[-1] if found else None


def parse_number(text: str) -> fractions.Fraction | None:
  """The exact value of `text` if the whole of it is one number (forms as in `extract_last_number`;
  surrounding `$`, spaces and a final period allowed), else None."""
  text = text.strip().rstrip(".").strip().strip("$").strip().rstrip(".")
  m = _FULL_NUM.fullmatch(text)
  if m is None:
    return None
  sign, fnum, fden, whole, dec, den = m.groups()
  if fnum is not None:
    num, div = int(fnum), int(fden)
  else:
    num, div = int(whole.replace(",", "") + (dec or "")), int(den) if den else 10 ** len(dec or "")
  if div == 0:
    return None
  value = fractions.Fraction(num, div)
  return -value if sign else value


def extract_final(completion: str, mode: str = "auto") -> tuple[str | None, str | None]:
  """(answer, where it was found) under an answer mode; (None, None) if there is none.

  'answer_tag': the last `<answer>` content; 'boxed': the last box (`extract_boxed`);
  'last_number': `extract_last_number`; 'auto': the first of those three that is present. An empty
  tag or box counts as absent.
  """
  order = {"auto": ("answer_tag", "boxed", "last_number")}.get(check_answer_mode(mode), (mode,))
  for where in order:
    found = {"answer_tag": extract_tag, "boxed": extract_boxed,
             "last_number": extract_last_number}[where](completion)
    if found:
      return found, where
  return None, None


def has_answer_format(completion: str, mode: str = "auto") -> bool:
  """Whether the completion states a final answer the way `mode` asks: a non-empty `<answer>` tag
  ('answer_tag'), a complete non-empty box ('boxed'), a number ('last_number'), or any of them
  ('auto')."""
  return extract_final(completion, mode)[0] is not None


def extract_tag(completion: str) -> str | None:
  """Content of the last `<answer>...</answer>`, stripped, or None.

  Tags pair as a non-greedy regex would pair them (each `<answer>` with the first `</answer>` after
  it, scanning on from there), found with `str.find` so that thousands of unclosed tags cost one pass
  instead of a regex scan to the end from each of them.
  """
  found, pos = None, 0
  while (start := completion.find("<answer>", pos)) >= 0:
    end = completion.find("</answer>", start + 8)
    if end < 0:
      break  # no later tag can close either
    found, pos = (start + 8, end), end + 9
  return None if found is None else completion[found[0]:found[1]].strip()


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


_MISSING = {"auto": "no answer tag, box or number", "boxed": "no complete non-empty \\boxed{}",
            "last_number": "no number", "answer_tag": "no non-empty <answer> tag"}


def missing_reason(mode: str) -> str:
  """Why `extract_final(completion, mode)` found nothing, for info dicts."""
  return _MISSING[check_answer_mode(mode)]


def _extract(completion: str, answer: str) -> tuple[str | None, str | None]:
  """Original extraction (tag, else last number) for 'auto', else `extract_final`."""
  if check_answer_mode(answer) != "auto":
    return extract_final(completion, answer)
  tag = extract_tag(completion)
  if tag is not None:
    return tag, "answer_tag"
  pred = extract_answer(completion)
  return pred, None if pred is None else "last_number"


def exact_reward(completion: str, record, answer: str = "auto") -> tuple[float, dict]:
  """1.0 if the extracted answer equals the reference after `normalize_answer`.

  `answer` is the answer mode (`extract_final`); the default 'auto' keeps the original extraction:
  the `<answer>` content, else the last number.
  """
  ref = _need_answer(record)
  pred, where = _extract(completion, answer)
  if pred is None:
    return 0.0, {"extracted": None, "mode": answer, "reason": missing_reason(answer)}
  ok = normalize_answer(pred) == normalize_answer(ref)
  return float(ok), {"extracted": pred, "mode": answer, "found_by": where,
                     "reason": "match" if ok else "mismatch"}


def format_reward(completion: str, record=None) -> tuple[float, dict]:
  """1.0 if the completion is (optional `<think>…</think>`) text ending in one non-empty
  `<answer>…</answer>`."""
  n_tags = completion.count("<answer>")
  # What `^\s*(<think>.*?</think>\s*)?.*?<answer>.+?</answer>\s*$` (DOTALL) accepts, without its
  # quadratic backtracking: the one tag has content and its last closing tag ends the text.
  start, end = completion.find("<answer>"), completion.rfind("</answer>")
  ok = n_tags == 1 and end >= start + 9 and not completion[end + 9:].strip()
  return float(ok), {"reason": "ok" if ok else f"bad format ({n_tags} answer tags)"}


def arithmetic_reward(completion: str, record, answer: str = "auto") -> tuple[float, dict]:
  """1.0 if the extracted answer is the reference number.

  With the default answer mode 'auto' (original behaviour): the `<answer>` content, else the last
  number, must be the reference integer (thousands separators allowed). With another mode, the
  extracted text must be one number (integer, decimal, `a/b` or `\\frac{a}{b}`) exactly equal to
  the reference's value, so `\\boxed{12.0}` matches 12 and `\\boxed{x=12}` does not.
  """
  if check_answer_mode(answer) == "auto":
    pred = extract_answer(completion)
    try:
      ok = pred is not None and int(normalize_answer(pred)) == int(_need_answer(record))
    except ValueError:
      return 0.0, {"extracted": pred, "mode": answer, "reason": "answer is not an integer"}
    return float(ok), {"extracted": pred, "mode": answer, "reason": "correct" if ok else "wrong value"}
  ref = parse_number(_need_answer(record))
  if ref is None:
    raise ValueError(f"record {record.id}: reference answer {record.answer!r} is not a number")
  pred, where = extract_final(completion, answer)
  if pred is None:
    return 0.0, {"extracted": None, "mode": answer, "reason": missing_reason(answer)}
  value = parse_number(pred)
  if value is None:
    return 0.0, {"extracted": pred, "mode": answer, "found_by": where,
                 "reason": "answer is not a number"}
  ok = value == ref
  return float(ok), {"extracted": pred, "mode": answer, "found_by": where, "value": str(value),
                     "reason": "correct" if ok else "wrong value"}


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
