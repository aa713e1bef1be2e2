"""A packed batch gives the padded batch's loss, metrics and gradients, for every registered algorithm.
An episode split into rows (its new rows in segments of their own) trains as the same episode in one row.

The padded path is the reference: one sequence per row, computed as before packing existed. The batch
mixes prompt lengths (one left-padded prompt), response lengths (a 1-token and an empty response), a
response token the policy did not sample (loss mask 0 inside the response), and off-policy behaviour
log-probs, so that IS weights, clipping and every aggregation mode see non-trivial values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import algorithms as A
from rlax import models as M
from rlax.rollout import packing
from rlax.trainer import (OptimizerConfig, RolloutBatch, Trainer, accumulate_gradients, loss_inputs,
                          reduce_metrics, rl_loss)
from rlax.trainer import layouts, response_loss_mask
from trainer_testlib import CFG, host

B, G, P, N = 8, 4, 5, 5
T = P + N
LENGTHS = [5, 3, 1, 4, 0, 5, 2, 5]
ROW_LEN = 16


def mixed_batch(params, *, shared: bool, seed: int = 0) -> RolloutBatch:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  if shared:  # GRPO: the G samples of a prompt share its tokens
    for g in range(B // G):
      tokens[g * G:(g + 1) * G, :P] = tokens[g * G, :P]
  mask[G:, :2] = False  # the second prompt is 3 tokens, left-padded
  for b, n in enumerate(LENGTHS):
    mask[b, P + n:] = False
  tokens[~mask] = 0
  lm = response_loss_mask(mask, P)
  lm[3, P - 1 + 2] = 0.0  # a token appended to the response, not sampled
  lp = np.asarray(jax.jit(lambda p, t, m: M.token_logprobs(p, CFG, t, input_mask=m))(params, tokens, mask))
  behaviour = (lp + 0.3 * rng.normal(size=lp.shape)).astype(np.float32) * lm
  ref = (lp + 0.2 * rng.normal(size=lp.shape)).astype(np.float32) * lm
  rewards = rng.normal(size=B).astype(np.float32)
  teacher = (lp + 0.4 * rng.normal(size=lp.shape)).astype(np.float32) * lm  # read by distilling algorithms only
  return RolloutBatch(tokens=tokens, input_mask=mask, loss_mask=lm, behaviour_logprobs=behaviour,
                      rewards=rewards, versions=np.zeros(B, np.int32), group_ids=(np.arange(B) // G).astype(np.int32),
                      ref_logprobs=ref, prompt_len=P, teacher_logprobs=teacher, **_teacher_top(rng, lm))


def _teacher_top(rng, lm, k=3) -> dict:
  """A teacher's top-k ids and log-probs on the scored slots (read by the forward-KL objective only)."""
  ids = rng.integers(0, CFG.vocab_size, (*lm.shape, k)).astype(np.int32) * (lm[..., None] > 0)
  lps = np.sort(-rng.uniform(0.05, 4.0, (*lm.shape, k)), -1)[..., ::-1].astype(np.float32) * lm[..., None]
  return dict(teacher_top_ids=ids, teacher_top_logprobs=np.ascontiguousarray(lps))


def _algorithms():
  out = [(name, {}) for name in A.known_algorithms()]
  out += [("grpo", dict(off_policy="tis_seq", entropy_coef=0.01)), ("dapo", dict(off_policy="mis_seq", is_cap=1.2)),
          ("reinforce_pp", dict(kl_coef=0.1, kl_in_reward=True)), ("grpo", dict(kl_coef=0.1, kl_in_reward=True)),
          ("ppo", dict(kl_coef=0.05, kl_in_reward=True)), ("gspo", dict(old_policy="behaviour")),
          ("dr_grpo", dict(off_policy="tis_token")), ("distill", dict(reward_coef=0.5, off_policy="tis_token")),
          ("grpo", dict(distill_coef=0.3)), ("distill", dict(forward_kl_coef=0.5, forward_kl_top_k=3)),
          ("grpo", dict(distill_coef=0.0, forward_kl_coef=0.2, forward_kl_top_k=3))]
  return out


@pytest.fixture(scope="module")
def params():
  return M.create_params(CFG, seed=0)


def _objective(params, algo, batch, micro_batches):
  """(loss, metric sums, gradients) of the RL objective over `micro_batches`, computed as the trainer does."""
  layout = layouts.of(batch)
  old = None
  if algo.kl_in_reward and algo.old_policy == "recompute":
    old = layout.logprobs(params, CFG, layout.inputs(batch), chunk=256, temperature=1.0)
  inputs = loss_inputs(algo, batch, G, old)
  tok, seqs = A.denominators(inputs.loss_mask, layout.segments(inputs.model))
  loss_fn = lambda p, mb: rl_loss(p, CFG, algo, mb, num_tokens=tok, num_seqs=seqs, num_rows=B, layout=layout)
  grads, loss, stacked = accumulate_gradients(loss_fn, params, inputs, micro_batches)
  return loss, reduce_metrics(stacked, loss, jnp.zeros(()), jnp.zeros(())), grads


# Shared prompts (their segments packed once) for every algorithm; distinct ones pack the same way for any
# algorithm: a token-level, a sequence-level and a returns-based one.
@pytest.mark.parametrize("name,kw,shared", [(n, kw, True) for n, kw in _algorithms() if n != "ppo"] +
                         [("grpo", {}, False), ("gspo", {}, False), ("reinforce_pp", {}, False)],
                         ids=lambda a: str(a))
def test_objective_packed_equals_padded(params, name, kw, shared):
  algo = A.get_algorithm(name, **kw)
  padded = mixed_batch(params, shared=shared)
  packed = packing.pack_tokens(padded, ROW_LEN, share_prompts=True, row_multiple=2)
  jitted = jax.jit(_objective, static_argnums=(1, 3))
  want = jitted(params, algo, jax.tree.map(jnp.asarray, padded), 2)
  got = jitted(params, algo, jax.tree.map(jnp.asarray, packed), 2)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  for k in want[1]:
    np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), host(got[2]), host(want[2]))
  assert float(jnp.abs(jax.tree.leaves(want[2])[0]).sum()) > 0  # the gradient is not trivially zero


# The step end to end where it differs by algorithm (each algorithm's advantages and loss are covered above): a
# group-normalized one, PPO's value model (and its KL reward) and a distilling one's teacher log-probs.
@pytest.mark.parametrize("name,kw", [("grpo", {}), ("ppo", {}), ("ppo", dict(kl_coef=0.05, kl_in_reward=True)),
                                     ("distill", {}), ("distill", dict(forward_kl_coef=0.5, forward_kl_top_k=3))],
                         ids=lambda a: str(a))
def test_trainer_step_packed_equals_padded(params, name, kw):
  """Trainer.step end to end (advantages, PPO's value model and GAE, metrics, the AdamW update) on 2 devices."""
  algo = A.get_algorithm(name, **kw)
  mesh = M.make_mesh(jax.devices()[:2], fsdp=2)
  padded = mixed_batch(params, shared=True)
  packed = packing.pack_tokens(padded, ROW_LEN, row_multiple=4)
  opt = OptimizerConfig(lr=1e-2)
  out = []
  for batch in (padded, packed):
    trainer = Trainer(CFG, algo, opt, mesh, group_size=G, micro_batches=2)
    state = trainer.init_state(jax.tree.map(jnp.copy, params))
    state, metrics = trainer.step(state, batch)
    out.append((host(state), host(metrics)))
  (s1, m1), (s2, m2) = out
  for k in m1:
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # AdamW's first step is ~lr * sign(g): compare the update at 1e-3 of lr (as the sharding tests do).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3 * opt.lr), s2.params, s1.params)
  if s1.critic is not None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3 * algo.critic_lr),
                 s2.critic.params, s1.critic.params)


def test_ref_logprobs_packed_equal_padded(params):
  padded = mixed_batch(params, shared=True)
  packed = packing.pack_tokens(padded, ROW_LEN)
  trainer = Trainer(CFG, A.get_algorithm("grpo"), group_size=G)
  want = np.asarray(trainer.ref_logprobs(params, padded)) * padded.loss_mask
  got = packing.unpack_slots(trainer.ref_logprobs(params, packed), packed, padded) * padded.loss_mask
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.abs(want).sum() > 0


# Packed rows (the default layout) for every algorithm; padded rows for the two that read the KL per token.
@pytest.mark.parametrize("packed,name,kw", [(True, n, kw) for n, kw in _algorithms() if n != "ppo"] +
                         [(False, "grpo", dict(kl_coef=0.1, kl_in_reward=True)),
                          (False, "reinforce_pp", dict(kl_coef=0.1, kl_in_reward=True))], ids=lambda a: str(a))
def test_appended_tokens_slots_change_nothing(params, packed, name, kw):
  """An environment's tokens inside a response (loss mask 0) carry no behaviour or reference log-prob: garbage
  in those slots changes neither the loss, the KL, the returns (REINFORCE++ with the KL in the reward) nor the
  importance-ratio metrics, nor any gradient."""
  algo = A.get_algorithm(name, **kw)
  clean, dirty = _with_appended_garbage(params)
  out = []
  for b in (clean, dirty):
    b = packing.pack_tokens(b, ROW_LEN, share_prompts=True, row_multiple=2) if packed else b
    out.append(jax.jit(_objective, static_argnums=(1, 3))(params, algo, jax.tree.map(jnp.asarray, b), 2))
  (l1, m1, g1), (l2, m2, g2) = out
  np.testing.assert_array_equal(l2, l1)
  for k in m1:
    np.testing.assert_array_equal(m2[k], m1[k], err_msg=k)
  jax.tree.map(np.testing.assert_array_equal, host(g2), host(g1))


def test_appended_tokens_slots_change_nothing_in_ppo(params):
  """The same through Trainer.step for PPO with its KL reward (GAE over the value model's per-token values)."""
  algo = A.get_algorithm("ppo", kl_coef=0.05, kl_in_reward=True)
  out = []
  for batch in _with_appended_garbage(params):
    trainer = Trainer(CFG, algo, OptimizerConfig(lr=1e-2), M.make_mesh(jax.devices()[:1]), group_size=G)
    state, metrics = trainer.step(trainer.init_state(jax.tree.map(jnp.copy, params)), batch)
    out.append((host(state), host(metrics)))
  (s1, m1), (s2, m2) = out
  for k in m1:
    np.testing.assert_array_equal(m2[k], m1[k], err_msg=k)
  jax.tree.map(np.testing.assert_array_equal, (s2.params, s2.critic.params), (s1.params, s1.critic.params))


def _with_appended_garbage(params):
  """mixed_batch with four appended tokens inside responses, and a copy with garbage in their log-prob slots."""
  clean = mixed_batch(params, shared=True)
  lm = clean.loss_mask.copy()
  lm[0, P - 1 + 1:P - 1 + 3] = 0.0  # a two-token environment turn between two sampled turns
  lm[5, P - 1 + 2] = 0.0
  clean = clean.replace(loss_mask=lm, behaviour_logprobs=clean.behaviour_logprobs * lm,
                         ref_logprobs=clean.ref_logprobs * lm, teacher_logprobs=clean.teacher_logprobs * lm,
                         teacher_top_ids=clean.teacher_top_ids * (lm[..., None] > 0),
                         teacher_top_logprobs=clean.teacher_top_logprobs * lm[..., None])
  appended = (lm == 0) & clean.input_mask[:, 1:]
  appended[:, :P - 1] = False
  assert appended.sum() == 4
  dirty = clean.replace(behaviour_logprobs=np.where(appended, 37.5, clean.behaviour_logprobs),
                         ref_logprobs=np.where(appended, -1e3, clean.ref_logprobs),
                         teacher_logprobs=np.where(appended, 55.0, clean.teacher_logprobs),
                         teacher_top_ids=np.where(appended[..., None], 10**6, clean.teacher_top_ids).astype(np.int32),
                         teacher_top_logprobs=np.where(appended[..., None], 99.0, clean.teacher_top_logprobs))
  return clean, dirty


def _split_pair(params, seed=0):
  """Two-turn episodes (2 sampled tokens, a 1-token environment turn, 2 sampled tokens) as rows of one
  segment, and the same episodes split into two rows whose second prompt re-renders the first row exactly:
  after the first prompt (rows 0-3: its new tokens are the first turn and the environment's) or alone (rows
  4-7: the whole conversation). Every sampled token has the same context in both."""
  rng = np.random.default_rng(seed)
  n_new = 12
  prompt = rng.integers(3, CFG.vocab_size, (B, P)).astype(np.int32)
  r1, env, r2 = (rng.integers(3, CFG.vocab_size, (B, k)).astype(np.int32) for k in (2, 1, 2))
  one = np.zeros((B, P + n_new), np.int32)
  one[:, :P + 5] = np.concatenate([prompt, r1, env, r2], axis=1)
  mask = np.zeros_like(one, bool)
  mask[:, :P + 5] = True
  lm = response_loss_mask(mask, P)
  lm[:, P - 1 + 2] = 0.0  # the environment's token
  lp = np.asarray(jax.jit(lambda p, t, m: M.token_logprobs(p, CFG, t, input_mask=m))(params, one, mask))
  behaviour = (lp + 0.3 * rng.normal(size=lp.shape)).astype(np.float32) * lm
  ref = (lp + 0.2 * rng.normal(size=lp.shape)).astype(np.float32) * lm
  teacher = (lp + 0.4 * rng.normal(size=lp.shape)).astype(np.float32) * lm
  base = dict(rewards=rng.normal(size=B).astype(np.float32), versions=np.zeros(B, np.int32),
              group_ids=(np.arange(B) // G).astype(np.int32), prompt_len=P)
  top = _teacher_top(rng, lm)
  unsplit = RolloutBatch(tokens=one, input_mask=mask, loss_mask=lm, behaviour_logprobs=behaviour,
                         ref_logprobs=ref, teacher_logprobs=teacher, **top, **base)
  toks, smask, slm, sb, sr, st = (np.zeros_like(a) for a in (one, mask, lm, behaviour, ref, teacher))
  stop = {n: np.zeros_like(a) for n, a in top.items()}
  forks = np.zeros_like(one)
  for b in range(B):
    x = np.concatenate([r1[b], env[b]]) if b < 4 else np.concatenate([prompt[b], r1[b], env[b]])
    resp = np.concatenate([r1[b], x, r2[b]])
    toks[b, :P], toks[b, P:P + len(resp)] = prompt[b], resp
    smask[b, :P + len(resp)] = True
    forks[b, P + 2] = 1 if b < 4 else 2
    for src, dst in ((0, 0), (1, 1), (3, 2 + len(x)), (4, 3 + len(x))):  # sampled tokens' slots
      slm[b, P - 1 + dst], sb[b, P - 1 + dst], sr[b, P - 1 + dst] = 1.0, behaviour[b, P - 1 + src], ref[b, P - 1 + src]
      st[b, P - 1 + dst] = teacher[b, P - 1 + src]
      for n in stop:
        stop[n][b, P - 1 + dst] = top[n][b, P - 1 + src]
  split = RolloutBatch(tokens=toks, input_mask=smask, loss_mask=slm, behaviour_logprobs=sb, ref_logprobs=sr,
                       teacher_logprobs=st, forks=forks, **stop, **base)
  return unsplit, split


@pytest.mark.parametrize("name,kw", [a for a in _algorithms() if a[0] != "ppo"], ids=lambda a: str(a))
def test_an_episode_split_into_rows_trains_as_the_unsplit_episode(params, name, kw):
  """A split episode is one sequence: the same loss, metrics (KL, importance ratios, REINFORCE++'s KL to go
  across its rows) and gradients as the episode kept in one row, when the re-rendered prompt says the same."""
  algo = A.get_algorithm(name, **kw)
  unsplit, split = _split_pair(params)
  jitted = jax.jit(_objective, static_argnums=(1, 3))
  want = jitted(params, algo, jax.tree.map(jnp.asarray, packing.pack_tokens(unsplit, 32, row_multiple=2)), 2)
  got = jitted(params, algo, jax.tree.map(jnp.asarray, packing.pack_tokens(split, 32, row_multiple=2)), 2)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  for k in want[1]:
    np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), host(got[2]), host(want[2]))


def test_a_split_episode_trains_as_the_unsplit_one_in_ppo(params):
  """Trainer.step for PPO with its KL reward: GAE runs over the value model's values across the rows."""
  algo = A.get_algorithm("ppo", kl_coef=0.05, kl_in_reward=True)
  out = []
  for batch in _split_pair(params):
    trainer = Trainer(CFG, algo, OptimizerConfig(lr=1e-2), M.make_mesh(jax.devices()[:1]), group_size=G)
    packed = packing.pack_tokens(batch, 32)
    state, metrics = trainer.step(trainer.init_state(jax.tree.map(jnp.copy, params)), packed)
    out.append((host(state), host(metrics)))
  (s1, m1), (s2, m2) = out
  for k in m1:
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3 * 1e-2), s2.params, s1.params)
