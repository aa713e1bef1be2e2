"""A judge's prompt and the reading of its verdict: pure text functions.

    text = fill(template, rubric=..., question=..., reply=..., reference=...)
    reward, ok = Parser("number", "yes=1,no=0", scale=10).parse("... Score: 7")     # (0.7, True)

The judge writes the verdict; the policy wrote the reply the judge read, and may have written a verdict-like
line into it, which a judge that echoes its input would repeat: the parser reads the judge's output only, and the
last verdict in it (a judge states its verdict at the end), and a number only after "score" or standing
alone; a verdict cut at the judge's token budget is a failure (`Judge`). Unparseable output is (0.0, False): a
counted failure, never an exception. Every scan is linear in the output (no backtracking, a bounded JSON scan).
"""

from __future__ import annotations

import json
import math
import re

DEFAULT_TEMPLATE = """You grade a reply to a question against a rubric.

Rubric: {rubric}

Question:
{question}

Reference answer (may be empty): {reference}

Reply:
<reply>
{reply}
</reply>

How well does the reply meet the rubric, from 0 (not at all) to 10 (fully)? End with one line "Score: N"."""

PLACEHOLDERS = ("rubric", "question", "reply", "reference")
_FIELD = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_SCORE = re.compile(r"score", re.I)
_ALONE = re.compile(r"([-+]?\d+(?:\.\d+)?)(?:\s*/\s*\d+)?\.?")
MAX_JSON_SCAN = 64  # '{' positions tried, from the end


def check_template(template: str) -> None:
  """One ValueError when the template cannot show the judge the reply."""
  if "{reply}" not in template:
    raise ValueError("judge.template must contain '{reply}' (and may use {rubric}, {question}, {reference})")


def fill(template: str, **values: str) -> str:
  """`template` with each {placeholder} replaced by its value, once: a value's own braces are never read as
  placeholders, nor are other braces in the template (JSON examples stay as written)."""
  return _FIELD.sub(lambda m: str(values.get(m.group(1), "")), template)


class Parser:
  """Reads a reward in [0, 1] from a judge's output; see the module docstring. mode: "number", "label" or
  "json:<field>"; labels: "word=value,..."; scale: a number verdict's full mark."""

  def __init__(self, mode: str, labels: str = "yes=1,no=0", scale: float = 10.0):
    self.mode, self.scale = mode, float(scale)
    self.field = mode[5:] if mode.startswith("json:") else ""
    if mode not in ("number", "label") and not self.field:
      raise ValueError(f"judge.verdict={mode!r}: use 'number', 'label' or 'json:<field>'")
    self.labels = {}
    for part in (p.strip() for p in labels.split(",") if p.strip()):
      word, _, value = part.partition("=")
      try:
        v = float(value)
      except ValueError:
        v = float("nan")
      if not word.strip() or not 0 <= v <= 1:
        raise ValueError(f"judge.labels={labels!r}: expected word=value pairs with values in [0, 1], e.g. yes=1,no=0")
      self.labels[word.strip().lower()] = v
    if mode == "label" and not self.labels:
      raise ValueError("judge.verdict='label' needs judge.labels, e.g. yes=1,no=0")
    self._label = re.compile(r"\b(" + "|".join(map(re.escape, sorted(self.labels, key=len, reverse=True))) + r")\b",
                             re.I) if self.labels else None

  def parse(self, text: str) -> tuple[float, bool]:
    try:
      if self.mode == "number":
        return self._number(text)
      if self.mode == "label":
        return self._word(text)
      return self._json(text)
    except (ValueError, OverflowError, RecursionError):  # a number too large for a float, and the like
      return 0.0, False

  def _scaled(self, x: float) -> tuple[float, bool]:
    if not math.isfinite(x):
      return 0.0, False
    return min(max(x / self.scale, 0.0), 1.0), True

  def _number(self, text: str) -> tuple[float, bool]:
    marks = [m.end() for m in _SCORE.finditer(text)]
    after = _NUMBER.findall(text[marks[-1]:]) if marks else []
    if after:  # "Score: 7/10": the first number after the last "score"
      return self._scaled(float(after[0]))
    alone = _ALONE.fullmatch(text.strip())  # else only a bare number: a number inside prose may be the reply's
    return self._scaled(float(alone.group(1))) if alone else (0.0, False)

  def _word(self, text: str) -> tuple[float, bool]:
    hits = self._label.findall(text) if self._label else []
    return (self.labels[hits[-1].lower()], True) if hits else (0.0, False)

  def _json(self, text: str) -> tuple[float, bool]:
    decoder, last = json.JSONDecoder(), None
    for i in [i for i, c in enumerate(text) if c == "{"][-MAX_JSON_SCAN:]:
      try:
        obj, end = decoder.raw_decode(text, i)
      except (ValueError, RecursionError):
        continue
      if isinstance(obj, dict) and self.field in obj and (last is None or end > last[0]):
        last = end, obj[self.field]  # the object that ends last (an outer one over those inside it)
    if last is None:
      return 0.0, False
    v = last[1]
    if isinstance(v, bool):
      return float(v), True
    if isinstance(v, (int, float)):
      return self._scaled(float(v))
    if isinstance(v, str) and v.strip().lower() in self.labels:
      return self.labels[v.strip().lower()], True
    return self._scaled(float(v.strip())) if isinstance(v, str) else (0.0, False)
