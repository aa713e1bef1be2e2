"""Between the sampler and the trainer: prompts in, graded `RolloutBatch` out; SFT warm start; eval sampling.

Host-side glue only: tokenizing prompts, packing the sampler's prompt-major
output into the trainer's batch layout (rlax.trainer.batch), grading
completions in the verifier pool.
"""

from __future__ import annotations

from typing import Sequence

from absl import logging
import jax.numpy as jnp
import numpy as np

from rlax.data import tokenizer as tok_lib
from rlax.data.records import Record
from rlax.sampler import Sampler, SampleOutput, strategies
from rlax.trainer.batch import RolloutBatch, SFTBatch, response_loss_mask


def make_sampler(c, model_cfg, mesh) -> Sampler:
  r = c.rollout
  return Sampler(model_cfg, mesh, max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
                 batch_size=max(r.prompts_per_step * r.samples_per_prompt, c.eval.n_samples * 16),
                 eos_id=tok_lib.EOS_ID, pad_id=tok_lib.PAD_ID, decode_chunk=r.decode_chunk or None)


def strategy(temperature: float, top_k: int = 0, top_p: float = 1.0) -> strategies.SamplingMethod:
  """The sampling method a config asks for (temperature, then optional top-k or top-p truncation)."""
  if top_k and top_p < 1.0:
    raise ValueError("rollout.top_k and rollout.top_p are exclusive; set one of them")
  if top_k:
    return strategies.TopK(top_k, temperature)
  if top_p < 1.0:
    return strategies.TopP(top_p, temperature)
  return strategies.Temperature(temperature)


def encode_prompts(tokenizer, records: Sequence[Record]) -> list[list[int]]:
  return [tok_lib.encode(tokenizer, r.prompt) for r in records]


def completions(tokenizer, out: SampleOutput) -> list[str]:
  """Decoded response text of every row (EOS and padding dropped)."""
  toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
  return [tok_lib.decode(tokenizer, t[:n]) for t, n in zip(toks, lens)]


def pack(out: SampleOutput, rewards: np.ndarray, prompt_len: int) -> RolloutBatch:
  """Sampler output (prompt-major rows) + rewards → the trainer's RolloutBatch.

  tokens = [prompt left-padded to `prompt_len` | right-padded response], so every
  batch has the same static shape (no trainer recompiles, fixed checkpoint
  shapes); the behaviour log-prob of response token j sits at index P-1+j,
  where token_logprobs scores it.
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
  return RolloutBatch(tokens=jnp.asarray(tokens), input_mask=jnp.asarray(input_mask),
                      loss_mask=jnp.asarray(response_loss_mask(input_mask, P)),
                      behaviour_logprobs=jnp.asarray(blp), rewards=jnp.asarray(rewards, jnp.float32),
                      versions=jnp.asarray(row_version), group_ids=jnp.asarray(out.prompt_ids, jnp.int32),
                      prompt_len=P)


def empty_batch(batch: int, prompt_len: int, new_tokens: int) -> RolloutBatch:
  """An all-zero RolloutBatch of the static shape `pack` produces (a checkpoint restore template)."""
  T = prompt_len + new_tokens
  z = lambda *s, d=np.float32: jnp.zeros(s, d)
  return RolloutBatch(tokens=z(batch, T, d=np.int32), input_mask=z(batch, T, d=bool), loss_mask=z(batch, T - 1),
                      behaviour_logprobs=z(batch, T - 1), rewards=z(batch), versions=z(batch, d=np.int32),
                      group_ids=z(batch, d=np.int32), prompt_len=prompt_len)


def sft_target(record: Record, style: str) -> str:
  """The supervised response for a record: the bare answer ('compact') or inside <answer> tags."""
  if record.answer is None:
    raise ValueError(f"record {record.id} has no reference answer to warm-start on")
  return record.answer if style == "compact" else f"<answer>{record.answer}</answer>"


def sft_batch(tokenizer, records: Sequence[Record], style: str, prompt_len: int, response_len: int) -> SFTBatch:
  """Prompt (left-padded to prompt_len) + target + EOS (right-padded to response_len); loss on the target."""
  B, T = len(records), prompt_len + response_len
  toks = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), bool)
  for i, r in enumerate(records):
    p = tok_lib.encode(tokenizer, r.prompt)[-prompt_len:]
    a = tok_lib.encode(tokenizer, sft_target(r, style), add_bos=False, add_eos=True)[:response_len]
    toks[i, prompt_len - len(p):prompt_len] = p
    toks[i, prompt_len:prompt_len + len(a)] = a
    mask[i, prompt_len - len(p):prompt_len + len(a)] = True
  return SFTBatch(jnp.asarray(toks), jnp.asarray(mask), jnp.asarray(response_loss_mask(mask, prompt_len)))


def sft_warm_start(trainer, state, tokenizer, records: Sequence[Record], *, steps: int, batch: int, style: str,
                   prompt_len: int, response_len: int, log_every: int = 50):
  """`steps` supervised updates over `records` (in order, wrapping); returns the new state."""
  for s in range(steps):
    lo = (s * batch) % max(1, len(records) - batch)
    state, m = trainer.sft_step(state, sft_batch(tokenizer, records[lo:lo + batch], style, prompt_len,
                                                 response_len))
    if s % log_every == 0 or s == steps - 1:
      logging.info("sft step %d/%d: loss %.4f", s + 1, steps, float(m["loss"]))
  return state


def text_generate_fn(sampler: Sampler, tokenizer, method: strategies.SamplingMethod, seed: int, step: int):
  """A `generate_fn(prompts: list[str], n) -> list[list[str]]` over the sampler (for eval and curation)."""
  calls = [0]

  def generate(prompts: list[str], n: int) -> list[list[str]]:
    per_call = max(1, sampler.batch_size // n)
    texts: list[str] = []
    for lo in range(0, len(prompts), per_call):
      ids = [tok_lib.encode(tokenizer, p) for p in prompts[lo:lo + per_call]]
      out = sampler.generate(ids, samples_per_prompt=n, strategy=method, seed=seed, step=step,
                             prompt_ids=list(range(calls[0], calls[0] + len(ids))))
      calls[0] += len(ids)
      texts += completions(tokenizer, out)
    return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]

  return generate
