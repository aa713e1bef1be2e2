"""The sampler's text side, on the host: the sampling method a config asks for, sampler output fetched and
decoded, and a text `generate_fn` over the sampler (for evaluation and curation)."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from rlax.data.prompts import PromptRenderer
from rlax.data.records import Record
from rlax.rollout import stats as rollout_stats
from rlax.sampler import SampleOutput, strategies


def strategy(temperature: float, top_k: int = 0, top_p: float = 1.0) -> strategies.SamplingMethod:
  """The sampling method a config asks for (temperature, then optional top-k or top-p truncation)."""
  if top_k and top_p < 1.0:
    raise ValueError("rollout.top_k and rollout.top_p are exclusive; set one of them")
  if top_k:
    return strategies.TopK(top_k, temperature)
  if top_p < 1.0:
    return strategies.TopP(top_p, temperature)
  return strategies.Temperature(temperature)


def to_host(out: SampleOutput) -> SampleOutput:
  """The sampler output with every array fetched to the host in one transfer."""
  return jax.device_get(out)


def completions(tokenizer, out: SampleOutput) -> list[str]:
  """Decoded response text of every row (EOS and padding dropped); `out` on the host."""
  toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
  return [tokenizer.decode(t[:n]) for t, n in zip(toks, lens)]


def text_generate_fn(sampler, render: PromptRenderer, method: strategies.SamplingMethod, seed: int, step: int,
                     weights=None):
  """A `generate_fn(records, n) -> list[list[str]]` over the sampler (for eval and curation); weights: the
  source the sampler reads (default its own). `generate.lengths` collects every completion's (tokens,
  truncated: it hit max_new_tokens)."""
  calls = [0]

  def generate(records: Sequence[Record], n: int) -> list[list[str]]:
    if not records:
      return []
    ids = render.encode_all(records)  # one stream: the engine queues any number of prompts
    out = sampler.generate(ids, samples_per_prompt=n, strategy=method, seed=seed, step=step,
                           prompt_ids=list(range(calls[0], calls[0] + len(ids))), weights=weights)
    calls[0] += len(ids)
    out = to_host(out)
    texts = completions(render.tokenizer, out)
    cut = rollout_stats.truncated_from_finish_reason(out.finish_reason)
    generate.lengths += [(int(t), bool(c)) for t, c in zip(np.asarray(out.lengths), cut)]
    return [texts[i * n:(i + 1) * n] for i in range(len(records))]

  generate.lengths = []
  return generate
