"""The host packer: every real token once, positions restarting per sequence, shared prompts, buckets, errors."""

import jax
import numpy as np
import pytest

from rlax import algorithms as A
from rlax import config as config_lib
from rlax import models as M
from rlax.rollout import packing
from rlax.trainer import RolloutBatch, Trainer, response_loss_mask

P, N, G = 6, 10, 4


def batch(lengths, prompt_lens, seed=0, shared=True) -> RolloutBatch:
  rng = np.random.default_rng(seed)
  B = len(lengths)
  tokens = rng.integers(3, 50, (B, P + N)).astype(np.int32)
  mask = np.zeros((B, P + N), bool)
  for b, (n, p) in enumerate(zip(lengths, prompt_lens)):
    if shared:
      tokens[b, :P] = tokens[b // G * G, :P]
    mask[b, P - p:P + n] = True
  tokens[~mask] = 0
  lm = response_loss_mask(mask, P)
  return RolloutBatch(tokens=tokens, input_mask=mask, loss_mask=lm, behaviour_logprobs=-lm,
                      rewards=rng.normal(size=B).astype(np.float32), versions=np.zeros(B, np.int32),
                      group_ids=(np.arange(B) // G).astype(np.int32), prompt_len=P)


LENGTHS = [10, 3, 7, 1, 0, 10, 2, 5]
PROMPTS = [6] * 4 + [4] * 4


@pytest.mark.parametrize("share", [True, False])
def test_every_real_token_once_with_restarting_positions(share):
  b = batch(LENGTHS, PROMPTS)
  out = packing.pack_tokens(b, 32, share_prompts=share, row_multiple=3)
  R, L = out.tokens.shape
  assert L == 32 and R % 3 == 0
  real = out.segment_ids > 0
  pieces_prompt = 0
  for r in range(R):
    for sid in np.unique(out.segment_ids[r][real[r]]):
      at = out.segment_ids[r] == sid
      np.testing.assert_array_equal(out.positions[r][at], out.positions[r][at][0] + np.arange(at.sum()))
      if out.parents[r][at][0] == 0:  # a prompt piece
        pieces_prompt += int(at.sum())
        assert out.positions[r][at][0] == 0
  resp = sum(LENGTHS)
  assert real.sum() == pieces_prompt + resp
  if share:  # two groups, each prompt once (row 4 has no response: its group still has others)
    assert pieces_prompt == 6 + 4
  else:
    assert pieces_prompt == sum(p for p, n in zip(PROMPTS, LENGTHS) if n)
  # Scored slots: each response token once, in order, its target the token, scored from the slot before.
  K = out.score_index.shape[1]
  assert K == packing.slot_bucket(int((out.seq < len(LENGTHS)).sum(1).max()), 32)
  for bi, n in enumerate(LENGTHS):
    r, k = np.nonzero(out.seq == bi)
    assert len(k) == n
    if n:
      np.testing.assert_array_equal(out.targets[r, k], b.tokens[bi, P:P + n])
      np.testing.assert_array_equal(out.tokens[r[1:], out.score_index[r, k][1:]], b.tokens[bi, P:P + n - 1])
      assert out.tokens[r[0], out.score_index[r[0], k[0]]] == b.tokens[bi, P - 1]  # the prompt's last token
  np.testing.assert_array_equal(packing.unpack_slots(out.loss_mask, out, b), b.loss_mask)


def test_groups_split_when_they_do_not_fit_a_row():
  b = batch([10] * 4 + [1] * 4, [6] * 8)
  out = packing.pack_tokens(b, 16)  # 6 + 10 fills a row: each of the 4 long answers takes its own prompt copy
  prompt_pieces = [(r, s) for r in range(out.tokens.shape[0]) for s in np.unique(out.segment_ids[r])
                   if s and out.parents[r][out.segment_ids[r] == s][0] == 0]
  assert len(prompt_pieces) == 5  # 4 for the long group, 1 for the short one (6 + 4 x 1 <= 16)


def test_slot_buckets_waste_at_most_a_quarter():
  got = [packing.slot_bucket(n, 1000) for n in range(1, 1001)]
  assert got[:8] == [8] * 8 and all(n <= b <= max(8, 1.25 * n) for n, b in zip(range(1, 1001), got))
  assert len(set(got)) <= 4 * 7 + 1 and packing.slot_bucket(900, 640) == 640


def test_a_sequence_longer_than_the_budget_names_the_knob():
  with pytest.raises(ValueError, match="optimizer.pack_tokens=12"):
    packing.pack_tokens(batch(LENGTHS, PROMPTS), 12)
  with pytest.raises(ValueError, match="optimizer.pack_tokens=20 is shorter"):
    config_lib.load({"workdir": "unused", "rollout": {"max_prompt_len": 16, "max_new_tokens": 8}, "optimizer": {"pack_tokens": 20}})


def test_steady_state_compiles_nothing_new():
  """Batches of other lengths that land in seen buckets (rows, slots) trace no new train step."""
  cfg = M.ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32)
  trainer = Trainer(cfg, A.get_algorithm("grpo", kl_coef=0.0), group_size=G, micro_batch_tokens=48)
  state = trainer.init_state(M.create_params(cfg))
  rng = np.random.default_rng(3)
  seen = set()
  for i in range(6):
    host = packing.for_trainer(batch(rng.integers(1, N + 1, 8), [6] * 8, seed=i), trainer, 16 + 8)
    seen.add((host.tokens.shape, host.score_index.shape))
    state, _ = trainer.step(state, host)
  assert trainer.traces["rl_step"] == len(seen) < 6
  before = dict(trainer.traces)
  for i in range(6):  # steady state: the same buckets again, new lengths inside them
    host = packing.for_trainer(batch(rng.integers(1, N + 1, 8), [6] * 8, seed=10 + i), trainer, 16 + 8)
    if (host.tokens.shape, host.score_index.shape) in seen:
      state, _ = trainer.step(state, host)
  assert dict(trainer.traces) == before
  jax.block_until_ready(state)


def test_a_group_that_fits_no_row_whole_fills_the_roomiest_row():
  """Groups of 6 + 4 x 8 = 38 tokens in rows of 64: whole groups take a row each (3 rows); split, a group's
  responses follow a prompt copy into the space another leaves: 2 rows, every response scored once."""
  b = batch([8] * 12, [6] * 12)
  out = packing.pack_tokens(b, 64, share_prompts=True)
  assert out.tokens.shape[0] == 2
  seq = np.asarray(out.seq)
  assert sorted(seq[seq < 12].tolist()) == sorted(list(range(12)) * 8)
  assert int(np.asarray(out.loss_mask).sum()) == int(np.asarray(b.loss_mask).sum())
