"""Curation: exact and near-duplicate removal, decontamination, difficulty filtering, curriculum.

Every step returns (kept records, counts) and logs what it removed and why, so a data report can
be assembled from the return values. Near-duplicates use MinHash over word n-grams of normalized
text with LSH banding (numpy, no extra dependency); decontamination drops any training prompt that
shares an n-gram with the eval set; difficulty is the pass rate of the current policy over k
samples per prompt, and the band filter keeps prompts the policy sometimes, but not always, solves.
"""

from __future__ import annotations

import collections
import re
import unicodedata
import hashlib
from typing import Callable, Iterable, Optional, Sequence

from absl import logging
import numpy as np

from rlax.data.records import Record

GenerateFn = Callable[[list[Record], int], list[list[str]]]  # (records, k) → k completions each
RewardFn = Callable[[str, Record], tuple[float, dict]]


def normalize_text(text: str) -> str:
  """NFKC, lower case, punctuation to spaces, whitespace collapsed."""
  text = unicodedata.normalize("NFKC", text).lower()
  text = re.sub(r"[^\w\s+\-*/=]", " ", text)
  return " ".join(text.split())


def ngrams(text: str, n: int) -> set[str]:
  """Word n-grams of the normalized text; a text shorter than n words is one gram."""
  words = normalize_text(text).split()
  if len(words) < n:
    return {" ".join(words)} if words else set()
  return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def exact_dedup(records: Sequence[Record]) -> tuple[list[Record], dict]:
  """Keeps the first record of each normalized prompt."""
  seen, kept, removed = set(), [], []
  for r in records:
    key = normalize_text(r.prompt)
    if key in seen:
      removed.append(r.id)
    else:
      seen.add(key)
      kept.append(r)
  logging.info("exact dedup: removed %d of %d (identical normalized prompt): %s", len(removed),
               len(records), removed[:10])
  return kept, {"exact_duplicates": len(removed), "removed_ids": removed}


class MinHasher:
  """MinHash signatures with multiply-add permutations h_i(x) = (a_i x + b_i) mod 2^64.

  x is a 64-bit blake2b hash of the gram and a_i is odd, so each h_i is a bijection; the product
  wraps around 2^64 many times, which is what mixes the high bits that decide the minimum (an
  affine map mod a 61-bit prime over 32-bit inputs barely wraps and keeps the order of x).
  """

  def __init__(self, num_perm: int = 128, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.a = rng.integers(0, np.iinfo(np.uint64).max, size=num_perm, dtype=np.uint64) | np.uint64(1)
    self.b = rng.integers(0, np.iinfo(np.uint64).max, size=num_perm, dtype=np.uint64)
    self.num_perm = num_perm

  def signature(self, grams: Iterable[str]) -> np.ndarray:
    """[num_perm] uint64 signature of a set of grams (all-max for the empty set)."""
    x = np.array([int.from_bytes(hashlib.blake2b(g.encode("utf-8"), digest_size=8).digest(), "little")
                  for g in grams], dtype=np.uint64)
    if x.size == 0:
      return np.full(self.num_perm, np.iinfo(np.uint64).max, dtype=np.uint64)
    with np.errstate(over="ignore"):
      h = x[:, None] * self.a[None, :] + self.b[None, :]  # wraps mod 2^64 by design
    return h.min(axis=0)


def jaccard(a: set, b: set) -> float:
  """Exact Jaccard similarity of two sets (1.0 for two empty sets)."""
  return 1.0 if not a and not b else len(a & b) / len(a | b)


def near_dedup(records: Sequence[Record], threshold: float = 0.8, n: int = 3, num_perm: int = 128,
               bands: int = 32, seed: int = 0) -> tuple[list[Record], dict]:
  """Drops records whose prompt's n-gram Jaccard similarity to an earlier kept one is ≥ threshold.

  LSH with `bands` bands of num_perm/bands rows proposes candidate pairs; each candidate is then
  confirmed with the exact Jaccard of the gram sets, so LSH only costs recall, never precision.
  """
  if num_perm % bands:
    raise ValueError(f"num_perm={num_perm} must be a multiple of bands={bands}")
  hasher, rows = MinHasher(num_perm, seed), num_perm // bands
  grams = [ngrams(r.prompt, n) for r in records]
  buckets: dict[tuple, list[int]] = collections.defaultdict(list)
  kept, removed = [], []
  for i, (r, g) in enumerate(zip(records, grams)):
    sig = hasher.signature(g)
    keys = [(b, sig[b * rows:(b + 1) * rows].tobytes()) for b in range(bands)]
    candidates = {j for k in keys for j in buckets.get(k, ())}
    match = next((j for j in sorted(candidates) if jaccard(g, grams[j]) >= threshold), None)
    if match is not None:
      removed.append((r.id, records[match].id))
      continue
    kept.append(r)
    for k in keys:
      buckets[k].append(i)
  logging.info("near dedup: removed %d of %d (Jaccard >= %.2f on %d-grams), e.g. %s", len(removed),
               len(records), threshold, n, removed[:5])
  return kept, {"near_duplicates": len(removed), "removed": removed}


def decontaminate(records: Sequence[Record], eval_texts: Iterable[str], n: int = 8
                  ) -> tuple[list[Record], dict]:
  """Drops training records sharing any word n-gram with an eval prompt (short texts: whole text)."""
  banned = set()
  for t in eval_texts:
    banned |= ngrams(t, n)
  kept, removed = [], []
  for r in records:
    hit = ngrams(r.prompt, n) & banned
    if hit:
      removed.append((r.id, next(iter(hit))))
    else:
      kept.append(r)
  logging.info("decontamination: removed %d of %d (shared %d-gram with the eval set), e.g. %s",
               len(removed), len(records), n, removed[:5])
  return kept, {"contaminated": len(removed), "removed": removed}


def estimate_pass_rates(records: Sequence[Record], generate_fn: GenerateFn, reward_fn: RewardFn,
                        k: int = 8, batch_size: int = 64, success: float = 0.5) -> np.ndarray:
  """Pass rate [N] of the policy: the fraction of k samples per prompt with reward > `success`.

  `generate_fn(records, k)` returns k completions per record (the controller plugs in the sampler).
  """
  rates = np.zeros(len(records), dtype=np.float64)
  for start in range(0, len(records), batch_size):
    chunk = records[start:start + batch_size]
    outs = generate_fn(chunk, k)
    if len(outs) != len(chunk) or any(len(o) != k for o in outs):
      raise ValueError(f"generate_fn returned {[len(o) for o in outs]} completions for "
                       f"{len(chunk)} prompts x k={k}")
    for i, (r, comps) in enumerate(zip(chunk, outs)):
      rates[start + i] = np.mean([reward_fn(c, r)[0] > success for c in comps])
  return rates


def filter_by_pass_rate(records: Sequence[Record], pass_rates, lo: float = 0.05, hi: float = 0.95
                        ) -> tuple[list[Record], dict]:
  """Keeps records with lo ≤ pass rate ≤ hi (defaults drop never- and always-solved prompts)."""
  pass_rates = np.asarray(pass_rates, dtype=np.float64)
  if pass_rates.shape != (len(records),):
    raise ValueError(f"pass_rates shape {pass_rates.shape} != ({len(records)},)")
  if not 0.0 <= lo <= hi <= 1.0:
    raise ValueError(f"need 0 <= lo <= hi <= 1, got lo={lo} hi={hi}")
  keep = (pass_rates >= lo) & (pass_rates <= hi)
  too_easy = int(np.sum(pass_rates > hi))
  too_hard = int(np.sum(pass_rates < lo))
  logging.info("difficulty band [%.2f, %.2f]: removed %d too easy, %d too hard, kept %d of %d",
               lo, hi, too_easy, too_hard, int(keep.sum()), len(records))
  kept = [r for r, m in zip(records, keep) if m]
  return kept, {"too_easy": too_easy, "too_hard": too_hard, "kept": len(kept)}


class Curriculum:
  """Raises the synthetic difficulty when the policy's smoothed pass rate exceeds `raise_at` and
  lowers it below `lower_at`, keeping the policy where its rewards still vary.

  The pass rate is an exponential moving average (`ema`), reset at each level change so the new
  level is judged on its own samples. State is JSON-able for the controller's checkpoint.
  """

  def __init__(self, level: int = 1, min_level: int = 1, max_level: int = 10,
               raise_at: float = 0.8, lower_at: float = 0.2, ema: float = 0.9,
               min_updates: int = 5):
    if not 0.0 <= lower_at < raise_at <= 1.0:
      raise ValueError(f"need 0 <= lower_at < raise_at <= 1, got {lower_at}, {raise_at}")
    if not min_level <= level <= max_level:
      raise ValueError(f"level {level} outside [{min_level}, {max_level}]")
    self.level, self.min_level, self.max_level = level, min_level, max_level
    self.raise_at, self.lower_at, self.ema, self.min_updates = raise_at, lower_at, ema, min_updates
    self.pass_rate: Optional[float] = None
    self.updates = 0

  def update(self, batch_pass_rate: float) -> int:
    """Feeds one batch's pass rate; returns the (possibly new) level."""
    p = float(batch_pass_rate)
    self.pass_rate = p if self.pass_rate is None else self.ema * self.pass_rate + (1 - self.ema) * p
    self.updates += 1
    if self.updates >= self.min_updates:
      new = self.level
      if self.pass_rate > self.raise_at and self.level < self.max_level:
        new = self.level + 1
      elif self.pass_rate < self.lower_at and self.level > self.min_level:
        new = self.level - 1
      if new != self.level:
        logging.info("curriculum: pass rate %.3f -> level %d -> %d", self.pass_rate, self.level, new)
        self.level, self.pass_rate, self.updates = new, None, 0
    return self.level

  def get_state(self) -> dict:
    return {"level": self.level, "pass_rate": self.pass_rate, "updates": self.updates}

  def set_state(self, state: dict) -> None:
    self.level, self.pass_rate, self.updates = (int(state["level"]), state["pass_rate"],
                                                int(state["updates"]))
