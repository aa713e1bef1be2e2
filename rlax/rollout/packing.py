"""Between the sampler and the trainer, on the host: prompts → token ids, sampler output → `RolloutBatch`.

Everything here is numpy: the sampler's output is fetched to the host once (`jax.device_get` of the
whole `SampleOutput`), decoded for grading and packed here, and the trainer places the packed batch on
its mesh with one `device_put` — one host→device crossing per rollout.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from rlax.data.prompts import PromptRenderer
from rlax.data.records import Record
from rlax.sampler import SampleOutput, strategies
from rlax.trainer.batch import RolloutBatch, response_loss_mask


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


def pack(out: SampleOutput, rewards: np.ndarray, prompt_len: int) -> RolloutBatch:
  """Sampler output on the host (prompt-major rows) + rewards → the trainer's RolloutBatch, in numpy.

  tokens = [prompt left-padded to `prompt_len` | right-padded response], so every
  batch has the same static shape (no trainer recompiles, fixed checkpoint
  shapes); the behaviour log-prob of response token j sits at index P-1+j,
  where token_logprobs scores it. Tokens the policy did not sample (appended by `Stream.extend`) get loss
  mask 0.
  """
  prompt, pmask = np.asarray(out.prompt_tokens), np.asarray(out.prompt_mask)
  if prompt.shape[1] > prompt_len:
    raise ValueError(f"prompt bucket {prompt.shape[1]} exceeds the batch prompt length {prompt_len}")
  extra = prompt_len - prompt.shape[1]
  prompt = np.pad(prompt, ((0, 0), (extra, 0)))
  pmask = np.pad(pmask, ((0, 0), (extra, 0)))
  resp, lens = np.asarray(out.tokens), np.asarray(out.lengths)
  B, P = prompt.shape
  N = resp.shape[1]
  rmask = np.arange(N)[None, :] < lens[:, None]
  tokens = np.concatenate([prompt, np.where(rmask, resp, 0)], axis=1).astype(np.int32)
  input_mask = np.concatenate([pmask, rmask], axis=1)
  blp = np.zeros((B, P + N - 1), np.float32)
  blp[:, P - 1:] = np.where(rmask, np.asarray(out.logprobs), 0.0)
  versions = np.asarray(out.versions)
  row_version = np.where(rmask, versions, np.iinfo(np.int32).max).min(axis=1)
  row_version = np.where(lens > 0, row_version, out.version).astype(np.int32)
  loss_mask = response_loss_mask(input_mask, P)
  loss_mask[:, P - 1:] *= np.asarray(out.sampled) & rmask
  return RolloutBatch(tokens=tokens, input_mask=input_mask, loss_mask=loss_mask,
                      behaviour_logprobs=blp, rewards=np.asarray(rewards, np.float32), versions=row_version,
                      group_ids=np.asarray(out.prompt_ids, np.int32), prompt_len=P)


def take_rows(batch: RolloutBatch, rows: np.ndarray) -> RolloutBatch:
  """The batch restricted to `rows` (numpy indices), same prompt_len."""
  return jax.tree.map(lambda x: x[rows], batch)


def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
  """Row-wise concatenation of numpy batches with the same prompt_len."""
  return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


def empty_batch(batch: int, prompt_len: int, new_tokens: int) -> RolloutBatch:
  """An all-zero numpy RolloutBatch of the static shape `pack` produces (a checkpoint restore template)."""
  T = prompt_len + new_tokens
  z = lambda *s, d=np.float32: np.zeros(s, d)
  return RolloutBatch(tokens=z(batch, T, d=np.int32), input_mask=z(batch, T, d=bool), loss_mask=z(batch, T - 1),
                      behaviour_logprobs=z(batch, T - 1), rewards=z(batch), versions=z(batch, d=np.int32),
                      group_ids=z(batch, d=np.int32), prompt_len=prompt_len)


def text_generate_fn(sampler, render: PromptRenderer, method: strategies.SamplingMethod, seed: int, step: int,
                     weights=None):
  """A `generate_fn(records, n) -> list[list[str]]` over the sampler (for eval and curation); weights: the
  source the sampler reads (default its own)."""
  calls = [0]

  def generate(records: Sequence[Record], n: int) -> list[list[str]]:
    if not records:
      return []
    ids = render.encode_all(records)  # one stream: the engine queues any number of prompts
    out = sampler.generate(ids, samples_per_prompt=n, strategy=method, seed=seed, step=step,
                           prompt_ids=list(range(calls[0], calls[0] + len(ids))), weights=weights)
    calls[0] += len(ids)
    texts = completions(render.tokenizer, to_host(out))
    return [texts[i * n:(i + 1) * n] for i in range(len(records))]

  return generate
