"""The resolved run's train programs: fixed shapes, compiled ahead, no compile after warm-up across varied
batches, and a batch's result independent of how many empty micro-batches its program carries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A
from rlax import builders
from rlax import config as config_lib
from rlax import models as M
from rlax import run as run_lib
from rlax.rollout import packing
from rlax.run.compiles import CompileCounter
from rlax.trainer import RolloutBatch, Trainer, response_loss_mask
from rlax.trainer.state import fill_order, split_micro_batches

P, N, G = 6, 10, 4
CFG = dict(preset="w1", vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32)


def _run(rollout=None, **opt):
  return config_lib.load({"workdir": "unused", "model": {"preset": "w1", "overrides": {k: v for k, v in CFG.items()
                                                                                       if k != "preset"}},
                          "rollout": {"prompts_per_step": 2, "samples_per_prompt": G, "max_prompt_len": P,
                                      "max_new_tokens": N, **(rollout or {})},
                          "algorithm": {"name": "grpo", "kl_coef": 0.0}, "optimizer": opt})


def _batch(lengths, seed=0) -> RolloutBatch:
  rng = np.random.default_rng(seed)
  B = len(lengths)
  tokens = rng.integers(3, 50, (B, P + N)).astype(np.int32)
  mask = np.zeros((B, P + N), bool)
  for b, n in enumerate(lengths):
    tokens[b, :P] = tokens[b // G * G, :P]
    mask[b, :P + n] = True
  tokens[~mask] = 0
  lm = response_loss_mask(mask, P)
  return RolloutBatch(tokens=tokens, input_mask=mask, loss_mask=lm, behaviour_logprobs=-0.5 * lm,
                      rewards=rng.normal(size=B).astype(np.float32), versions=np.zeros(B, np.int32),
                      group_ids=(np.arange(B) // G).astype(np.int32), prompt_len=P)


def test_fill_order_fills_whole_micro_batches_first_across_shards():
  order = fill_order(12, 3, shards=2)
  assert sorted(order) == list(range(12))
  mbs = split_micro_batches(jnp.arange(12), 3)  # micro-batch j: rows j, j + 3, ...
  first = set(np.asarray(mbs[0]).tolist())
  assert set(order[:4].tolist()) == first  # the first 4 real rows are micro-batch 0
  assert [int(i) // 6 for i in order[:4]] == [0, 1, 0, 1]  # alternating between the two shards


def test_plan_holds_one_row_per_sequence_in_whole_micro_batches():
  run = _run(micro_batch_tokens=64)
  trainer = builders.trainer(run, None)
  plan = run_lib.train_plan(run, trainer)
  prog = plan.programs[0]  # shared prompts: one packed length
  assert prog.packed is not None and (prog.length,) == packing.auto_row_lens(run.model, P, N, G, True)
  assert prog.rows >= run.rollout.rows  # one row per sequence at most
  assert prog.micro_rows == max(1, 64 // prog.length) and prog.rows % prog.micro_batches == 0
  assert prog.packed.slots == packing.slot_cap(prog.length, P, N, G, True) >= N
  share_off = run_lib.train_plan(_run(share_prompts=False), trainer)
  assert [p.packed is None for p in share_off.programs] == [False, True]  # packed + the padded alternative


def test_the_padded_program_stays_where_full_length_sequences_pack_no_better():
  """Long prompts shared by a group pack well even at full length: one program. Short prompts and full-length
  responses fill packed rows no better than padded ones (W3's random tokens never stop): the padded program is
  kept, and each batch takes the cheaper."""
  trainer = builders.trainer(_run(), None)
  plan = lambda prompt, new: run_lib.train_plan(
      _run(rollout=dict(max_prompt_len=prompt, max_new_tokens=new), pack_tokens=128, micro_batch_tokens=128), trainer)
  long_prompts, short_prompts = plan(100, 4), plan(2, 30)
  assert [p.packed is None for p in long_prompts.programs] == [False]
  assert [p.packed is None for p in short_prompts.programs] == [False, True]


def test_no_compile_after_warm_up_across_varied_batches():
  run = _run(micro_batch_tokens=48, pack_tokens=48)
  trainer = builders.trainer(run, None)
  plan = run_lib.train_plan(run, trainer)
  trainer.compile_ahead()
  assert len(trainer.compiled) == len(plan.programs)
  state = trainer.init_state(M.create_params(run.model))
  traces, counter = dict(trainer.traces), CompileCounter()
  rng = np.random.default_rng(0)
  state, _ = trainer.step(state, packing.for_trainer(_batch([N] * 8), trainer, plan.packed, padded=plan.padded))
  jax.block_until_ready(state)
  counter.delta()  # the first step's small host-side programs (e.g. placing the batch)
  runs = set()
  for i in range(6):
    lengths = rng.integers(0, N + 1, 8) if i else np.zeros(8, int) + 1
    host = packing.for_trainer(_batch(lengths, seed=i), trainer, plan.packed, padded=plan.padded)
    state, m = trainer.step(state, host)
    runs.add(int(m["micro_batches_run"]))
  jax.block_until_ready(state)
  assert dict(trainer.traces) == traces and counter.delta()[0] == 0
  assert len(runs) > 1  # the batches did vary in how many rows they needed


def _one_step_each(trainer, params, *batches) -> list[tuple]:
  """(updated parameters, metrics) of one step on each batch, every step from the same `params`, on the host."""
  out = []
  for b in batches:
    state, m = trainer.step(trainer.init_state(jax.tree.map(jnp.copy, params)), b)
    out.append((jax.device_get(state.params), jax.device_get(m)))
  return out


@pytest.mark.parametrize("share", [True, False])
def test_empty_micro_batches_change_nothing(share):
  """The same batch in its run's fixed program (many micro-batches, most empty) and packed as small as it
  goes (row buckets, no empty micro-batch): equal loss, metrics and updated parameters."""
  run = _run(micro_batch_tokens=48, pack_tokens=48, share_prompts=share)
  trainer = builders.trainer(run, None)
  plan = run_lib.train_plan(run, trainer)
  host = _batch([3, 10, 0, 5, 7, 1, 2, 9], seed=4)
  fixed = packing.pack_tokens(host, plan.packed[0], share_prompts=share)
  small = packing.pack_tokens(host, plan.packed[0].length, share_prompts=share)
  assert fixed.tokens.shape[0] > small.tokens.shape[0]
  (p1, m1), (p2, m2) = _one_step_each(trainer, M.create_params(run.model), fixed, small)
  for k in ("loss", "pg_loss", "entropy", "ratio_max", "logp_diff_max", "tokens", "grad_norm"):
    np.testing.assert_allclose(m1[k], m2[k], rtol=2e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p1, p2)
  assert m1["micro_batches_run"] < plan.programs[0].micro_batches


@pytest.mark.parametrize("share", [True, False])
def test_tied_groups_take_micro_batches_of_their_own_and_are_skipped(share):
  """GRPO without KL or entropy terms: a group whose rewards tie has advantage 0 and adds nothing. Packed apart
  (`inert`), its rows fill micro-batches from the program's back, which the trainer skips: the same update as
  the batch packed as small as it goes, for fewer micro-batches."""
  run = _run(micro_batch_tokens=48, pack_tokens=48, share_prompts=share)
  trainer = builders.trainer(run, None)
  assert trainer.algo.tied_groups_inert
  prog = run_lib.train_plan(run, trainer).programs[0]
  host = _batch([3, 10, 0, 5, 7, 1, 2, 9], seed=4)
  host = host.replace(rewards=np.where(np.arange(8) < G, 1.0, host.rewards).astype(np.float32))  # group 0 ties
  inert = np.arange(8) < G
  apart = packing.pack_tokens(host, prog.packed, share_prompts=share, inert=inert)
  small = packing.pack_tokens(host, prog.packed.length, share_prompts=share)
  mbs = np.asarray(split_micro_batches(jnp.asarray(apart.seq), prog.micro_batches))  # [n, rows, K]
  holds = [set(np.unique(mb[mb < 8]).tolist()) for mb in mbs]
  tied = set(np.flatnonzero(inert).tolist())
  assert all(not (h & tied) or h <= tied for h in holds)
  live = sum(bool(h - tied) for h in holds)
  assert packing.rows_run(apart, prog.micro_batches, inert) == live * prog.micro_rows
  (p1, m1), (p2, m2) = _one_step_each(trainer, M.create_params(run.model), apart, small)
  for k in ("loss", "pg_loss", "grad_norm"):
    np.testing.assert_allclose(m1[k], m2[k], rtol=2e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p1, p2)
  assert m1["micro_batches_run"] == live < sum(bool(h) for h in holds)
  assert m1["tokens"] == sum(host.loss_mask[G:].ravel())  # the tied group's tokens were not computed


def test_which_algorithms_skip_tied_groups():
  """Only where a tie gives advantage 0 and a zero advantage gives no gradient."""
  assert A.get_algorithm("grpo", kl_coef=0.0).tied_groups_inert
  assert A.get_algorithm("rloo").tied_groups_inert and A.get_algorithm("dr_grpo").tied_groups_inert
  assert not A.get_algorithm("grpo", kl_coef=0.04).tied_groups_inert  # the KL term trains every token
  assert not A.get_algorithm("grpo", kl_coef=0.0, entropy_coef=0.01).tied_groups_inert
  assert not A.get_algorithm("grpo", kl_coef=0.04, kl_in_reward=True).tied_groups_inert  # shaped rewards differ
  assert A.get_algorithm("grpo", kl_coef=0.04, kl_in_reward=True).zero_advantage_inert
  assert not A.get_algorithm("reinforce_pp").tied_groups_inert  # normalized over the batch, not the group
