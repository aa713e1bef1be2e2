"""Short-answer QA grading as search-agent papers grade it (Search-R1, R1-Searcher): the answer is the last
`<answer>` tag's content, else the completion's last non-empty line; it is compared with the gold answer (and
any `record.metadata["aliases"]`) after SQuAD's normalization (lower case, punctuation and the articles
a/an/the removed, whitespace collapsed) by exact match or token F1, the best over the golds. The completion
is the model's last turn: retrieved passages never reach the grader.
"""

from __future__ import annotations

import collections
import re
import string
import unicodedata

from rlax.rewards.text import extract_tag

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
  """SQuAD's answer normalization (after NFKC)."""
  text = unicodedata.normalize("NFKC", text).lower().translate(_PUNCT)
  return " ".join(_ARTICLES.sub(" ", text).split())


def final_answer(completion: str) -> str | None:
  """The last `<answer>` content, else the last non-empty line (a model that answers without the tag still
  answers), else None."""
  tag = extract_tag(completion)
  if tag is not None:
    return tag
  lines = [line.strip() for line in completion.splitlines() if line.strip()]
  return lines[-1] if lines else None


def token_f1(pred: str, gold: str) -> float:
  """SQuAD token F1 of two normalized strings."""
  p, g = pred.split(), gold.split()
  common = sum((collections.Counter(p) & collections.Counter(g)).values())
  if not p or not g or not common:
    return float(p == g)
  precision, recall = common / len(p), common / len(g)
  return 2 * precision * recall / (precision + recall)


def golds(record) -> list[str]:
  if record.answer is None:
    raise ValueError("QA reward: the record has no answer")
  aliases = (record.metadata or {}).get("aliases") or []
  return [str(record.answer)] + [str(a) for a in aliases]


def _grade(completion: str, record, metric: str) -> tuple[float, dict]:
  answer = final_answer(completion)
  if answer is None:
    return 0.0, {"reason": "no answer", "em": 0.0, "f1": 0.0}
  pred = normalize(answer)
  if not pred:  # "<answer>a</answer>" normalizes to nothing: no answer (it would equal a gold that does too)
    return 0.0, {"reason": "empty answer", "em": 0.0, "f1": 0.0}
  em = max(float(pred == normalize(g)) for g in golds(record))
  f1 = max(token_f1(pred, normalize(g)) for g in golds(record))
  return (em if metric == "em" else f1), {"reason": "match" if em else "mismatch", "em": em, "f1": f1,
                                          "extracted": answer[:200]}


def qa_em_reward(completion: str, record) -> tuple[float, dict]:
  """1 when the normalized answer equals a normalized gold, else 0."""
  return _grade(completion, record, "em")


def qa_f1_reward(completion: str, record) -> tuple[float, dict]:
  """The best token F1 of the normalized answer against the golds."""
  return _grade(completion, record, "f1")
