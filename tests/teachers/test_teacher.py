"""A teacher's log-probs of the sampled tokens (against transformers), only on scored slots, the tokenizer check,
and the distillation advantage they give the trainer (by hand, padded and packed alike). Top-k forward KL: the
teacher's top-k tokens (against transformers, among the ids the student can sample), the term by hand, and the
trainer's loss and gradient against the exact expression from the student's full log-softmax (packed, padded,
split episodes and garbage in appended slots: tests/trainer/test_packed_equivalence.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import hf_models
from rlax import algorithms
from rlax import models
from rlax.models import hf
from rlax.teachers import Teacher, TeacherConfig, row_passes
from rlax.trainer import layouts, loss_inputs, objective, rl_loss
from rlax.trainer.batch import RolloutBatch, response_loss_mask


def _batch(rng, B=4, P=5, N=6, vocab=67, appended=()):
  """Rows of a left-padded prompt (lengths 3..P) and N response tokens; `appended` response slots are
  environment tokens (not sampled: loss_mask 0)."""
  T = P + N
  tokens = rng.integers(3, vocab, size=(B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  for b in range(B):
    mask[b, :b % 3] = False  # left padding
    tokens[b, :b % 3] = 0
  lm = response_loss_mask(mask, P)
  for j in appended:
    lm[:, P - 1 + j] = 0.0
  blp = np.where(lm > 0, -rng.uniform(0.1, 3.0, size=lm.shape), 0.0).astype(np.float32)
  return RolloutBatch(tokens=tokens, input_mask=mask, loss_mask=lm, behaviour_logprobs=blp,
                      rewards=rng.integers(0, 2, B).astype(np.float32), versions=np.zeros(B, np.int32),
                      group_ids=np.repeat(np.arange(B // 2), 2).astype(np.int32), prompt_len=P)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("teacher")
  hf_models.make_dir(d, "llama", tie=False, seed=3)
  return d


def test_teacher_log_probs_match_transformers_on_scored_slots_only(teacher_dir):
  teacher = Teacher.load(TeacherConfig(hf_checkpoint=str(teacher_dir)), dtype="float32")
  batch = _batch(np.random.default_rng(0), appended=(2, 3))
  got = teacher.scores(batch)["teacher_logprobs"]
  assert got.shape == batch.loss_mask.shape and got.dtype == np.float32
  ref = hf_models.reload(teacher_dir)
  for b in range(batch.batch_size):
    start = int(np.argmax(batch.input_mask[b]))  # the row without its left padding, as transformers sees it
    row = batch.tokens[b, start:]
    logits = hf_models.logits(ref, row[None])[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    lp = logits - np.log(np.exp(logits - top).sum(-1, keepdims=True)) - top
    want = np.zeros(batch.loss_mask.shape[1])
    for t in range(start, batch.tokens.shape[1] - 1):
      if batch.loss_mask[b, t]:
        want[t] = lp[t - start, batch.tokens[b, t + 1]]
    np.testing.assert_allclose(got[b], want, atol=2e-4)
  assert np.all(got[batch.loss_mask == 0] == 0) and np.all(got[batch.loss_mask > 0] < 0)
  again = teacher.scores(_batch(np.random.default_rng(1), appended=(2, 3)))["teacher_logprobs"]
  assert again.shape == got.shape and teacher.traces["teacher_logprobs"] == 1  # one program per batch shape


def test_rows_scored_in_passes_give_the_same_log_probs(teacher_dir):
  assert [row_passes(16, 5), row_passes(12, 5), row_passes(7, 3), row_passes(8, 0), row_passes(4, 8)] == [4, 3, 7, 1, 1]
  assert row_passes(72, 20, shards=8) == 9 and row_passes(72, 20) == 4  # 8 rows a pass: one a shard
  batch = _batch(np.random.default_rng(0), B=8, appended=(2,))
  whole = Teacher.load(TeacherConfig(hf_checkpoint=str(teacher_dir)), dtype="float32")
  split = Teacher.load(TeacherConfig(hf_checkpoint=str(teacher_dir), rows_per_pass=3), dtype="float32")
  assert split.passes(8) == 4  # 2 rows a pass: the fewest passes that divide 8 with at most 3 rows each
  lp = lambda t: t.scores(batch)["teacher_logprobs"]
  np.testing.assert_allclose(lp(split), lp(whole), atol=1e-5)


def _hf_logprobs(ref, seq):
  logits = hf_models.logits(ref, np.asarray(seq)[None])[0].astype(np.float64)
  m = logits.max(-1, keepdims=True)
  return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def test_episodes_split_into_rows_are_scored_segment_by_segment(teacher_dir):
  """Forks: row 1's response starts a new segment at slot 3 (it attends to the prompt, not to slots 0-2), row 2's
  at slot 4 alone (an appended token first, unscored); each scored token's log-prob is the teacher's over its own
  segment, as transformers computes it on that segment alone."""
  teacher = Teacher.load(TeacherConfig(hf_checkpoint=str(teacher_dir)), dtype="float32")
  batch = _batch(np.random.default_rng(2))
  B, T = batch.tokens.shape
  P = batch.prompt_len
  forks = np.zeros((B, T), np.int32)
  forks[1, P + 3], forks[2, P + 4] = 1, 2
  lm = np.array(batch.loss_mask)
  lm[2, P - 1 + 4] = 0.0  # an alone segment's first token is the environment's
  batch = batch.replace(forks=forks, loss_mask=lm)
  got = teacher.scores(batch)["teacher_logprobs"]
  ref = hf_models.reload(teacher_dir)
  for b, cut, alone in ((0, None, False), (1, 3, False), (2, 4, True), (3, None, False)):
    start = int(np.argmax(batch.input_mask[b]))
    prompt, resp = batch.tokens[b, start:P], batch.tokens[b, P:]
    segments = [(0, len(resp))] if cut is None else [(0, cut), (cut, len(resp))]
    for a, z in segments:
      own = alone and a > 0
      seq = np.concatenate([[] if own else prompt, resp[a:z]]).astype(np.int32)
      lp = _hf_logprobs(ref, seq)
      first = 0 if own else len(prompt)  # where the segment's response tokens start in `seq`
      for i in range(a + (1 if own else 0), z):  # response token i, scored at slot P - 1 + i
        want = lp[first + i - a - 1, resp[i]]
        np.testing.assert_allclose(got[b, P - 1 + i], want, atol=2e-4, err_msg=f"row {b} token {i}")
  assert np.all(got[lm == 0] == 0)


def test_a_teacher_with_another_tokenizer_is_one_clear_error(tmp_path, teacher_dir):
  student = tmp_path / "student"
  hf_models.make_dir(student, "qwen2", tie=False)
  with pytest.raises(ValueError, match="tokenizer differs from the policy's"):
    Teacher.load(TeacherConfig(hf_checkpoint=str(teacher_dir)), student_tokenizer=hf.load_tokenizer(str(student)))
  same = tmp_path / "same"
  hf_models.make_dir(same, "llama", tie=True, seed=5)
  Teacher.load(TeacherConfig(hf_checkpoint=str(teacher_dir)), student_tokenizer=hf.load_tokenizer(str(same)))


def test_reverse_kl_advantage_by_hand():
  blp = jnp.array([[-1.0, -2.0, -0.5]])
  tlp = jnp.array([[-1.5, -1.0, -40.0]])
  m = jnp.array([[1.0, 1.0, 0.0]])
  np.testing.assert_allclose(algorithms.reverse_kl_advantages(blp, tlp, m, 2.0), [[-1.0, 2.0, 0.0]])
  # A token the teacher finds impossible is clipped at 20 nats.
  np.testing.assert_allclose(algorithms.reverse_kl_advantages(blp, tlp, jnp.ones((1, 3)), 1.0), [[-0.5, 1.0, -20.0]])
  np.testing.assert_allclose(algorithms.mean_reverse_kl(blp, tlp, m), (0.5 - 1.0) / 2)


@pytest.mark.parametrize("reward_coef", [0.0, 0.5])
def test_distill_advantages_ignore_what_lies_off_the_sampled_tokens(reward_coef):
  rng = np.random.default_rng(2)
  batch = _batch(rng, appended=(1, 4))
  tlp = np.where(batch.loss_mask > 0, -rng.uniform(0.1, 3.0, size=batch.loss_mask.shape), 0.0).astype(np.float32)
  algo = algorithms.get_algorithm("distill", reward_coef=reward_coef)
  adv = np.asarray(objective.batch_advantages(algo, batch.replace(teacher_logprobs=tlp), group_size=2))
  task = np.asarray(algorithms.grpo_advantages(jnp.asarray(batch.rewards), 2))
  want = np.where(batch.loss_mask > 0, -(batch.behaviour_logprobs - tlp) + reward_coef * task[:, None], 0.0)
  np.testing.assert_allclose(adv * batch.loss_mask, want, rtol=1e-5, atol=1e-6)
  # Garbage where nothing was sampled (prompt, appended tokens, padding) changes no scored advantage.
  off = batch.loss_mask == 0
  junk = batch.replace(teacher_logprobs=np.where(off, 1e3, tlp).astype(np.float32),
                       behaviour_logprobs=np.where(off, -1e3, batch.behaviour_logprobs).astype(np.float32))
  adv2 = np.asarray(objective.batch_advantages(algo, junk, group_size=2))
  np.testing.assert_array_equal(adv2 * batch.loss_mask, adv * batch.loss_mask)
  with pytest.raises(ValueError, match="fill batch.teacher_logprobs"):
    objective.batch_advantages(algo, batch, group_size=2)


def test_distill_config_rules():
  assert not algorithms.get_algorithm("distill").tied_groups_inert  # a tied group still has a teacher signal
  assert algorithms.get_algorithm("grpo", distill_coef=0.5).distills
  with pytest.raises(ValueError, match="not all 0"):
    algorithms.get_algorithm("distill", distill_coef=0.0)
  with pytest.raises(ValueError, match="per-token advantages"):
    algorithms.get_algorithm("gspo", distill_coef=1.0)


def test_the_distillation_gradient_descends_the_exact_reverse_kl(tmp_path):
  """The trainer's distillation gradient on 32 x 8 tokens sampled from the student points along the gradient of
  the exact KL(student || teacher) summed over the vocabulary (a sign error would point against it). Teacher: the
  student with 3x its logits."""
  hf_models.make_dir(tmp_path, "llama", tie=False, seed=0)
  cfg, params = hf.load_checkpoint(str(tmp_path), dtype="float32")
  logp = lambda p, toks, scale=1.0: jax.nn.log_softmax(models.forward(p, cfg, toks)[0] * scale, -1)
  B, P, N = 32, 4, 8
  toks = np.zeros((B, P + N), np.int32)
  toks[:, :P] = np.random.default_rng(0).integers(3, cfg.vocab_size, (B, P))
  key = jax.random.key(0)
  for t in range(P, P + N):
    key, k = jax.random.split(key)
    toks[:, t] = np.asarray(jax.random.categorical(k, logp(params, toks)[:, t - 1]))
  mask = np.ones_like(toks, bool)
  lm = response_loss_mask(mask, P)
  take = lambda lp: (np.asarray(jnp.take_along_axis(lp[:, :-1], toks[:, 1:, None], -1)[..., 0]) * lm).astype(np.float32)
  batch = RolloutBatch(tokens=toks, input_mask=mask, loss_mask=lm, behaviour_logprobs=take(logp(params, toks)),
                       rewards=np.zeros(B, np.float32), versions=np.zeros(B, np.int32),
                       group_ids=np.arange(B, dtype=np.int32) // 4, prompt_len=P,
                       teacher_logprobs=take(logp(params, toks, 3.0)))
  algo = algorithms.get_algorithm("distill")
  x = loss_inputs(algo, jax.tree.map(jnp.asarray, batch), 4)
  surrogate = lambda p: rl_loss(p, cfg, algo, x, num_tokens=jnp.sum(x.loss_mask), num_seqs=B, num_rows=B,
                                layout=layouts.of(batch))[0]
  teacher = jax.lax.stop_gradient(logp(params, toks, 3.0)[:, P - 1:-1])

  def exact(p):
    s = logp(p, toks)[:, P - 1:-1]
    return jnp.mean(jnp.sum(jnp.exp(s) * (s - teacher), -1))

  flat = lambda g: jnp.concatenate([v.ravel() for v in jax.tree.leaves(g)])
  g1, g2 = flat(jax.grad(surrogate)(params)), flat(jax.grad(exact)(params))
  assert float(g1 @ g2 / jnp.linalg.norm(g1) / jnp.linalg.norm(g2)) > 0.25


def test_a_teacher_with_fewer_embedding_rows_than_the_policy_is_one_error(teacher_dir):
  with pytest.raises(ValueError, match="do not cover the policy's 80"):
    Teacher.load(TeacherConfig(hf_checkpoint=str(teacher_dir)), student_vocab=80)


def test_forward_kl_by_hand():
  tlp = jnp.log(jnp.array([[[0.5, 0.3]]]))  # q = (0.625, 0.375) over the two tokens
  slp = jnp.log(jnp.array([[[0.4, 0.1]]]))
  want = 0.625 * np.log(0.625 / 0.4) + 0.375 * np.log(0.375 / 0.1)
  np.testing.assert_allclose(algorithms.top_k_forward_kl(tlp, slp), [[want]], rtol=1e-6)
  # 0 where the student puts all its mass on the k tokens in the teacher's proportions, > 0 elsewhere.
  np.testing.assert_allclose(algorithms.top_k_forward_kl(tlp, jnp.log(jnp.array([[[0.625, 0.375]]]))), [[0.0]],
                             atol=1e-6)
  rng = np.random.default_rng(0)
  s = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(64, 10)) * 3), -1)
  assert float(jnp.min(algorithms.top_k_forward_kl(jnp.asarray(rng.normal(size=(64, 4))), s[:, :4]))) >= 0


def test_forward_kl_config_rules():
  alone = algorithms.get_algorithm("distill", distill_coef=0.0, forward_kl_coef=1.0, forward_kl_top_k=8)
  assert alone.distills and alone.teacher_top_k == 8 and not alone.zero_advantage_inert
  assert algorithms.get_algorithm("distill").teacher_top_k == 0  # the top-k travels only with the term
  with pytest.raises(ValueError, match="forward_kl_top_k=0"):
    algorithms.get_algorithm("distill", forward_kl_coef=1.0, forward_kl_top_k=0)
  with pytest.raises(ValueError, match="not all 0"):
    algorithms.get_algorithm("distill", distill_coef=0.0)
  # The term is in the loss, not the advantages: GSPO keeps its sequence advantages (reward_coef x the task's).
  gspo = algorithms.get_algorithm("gspo", forward_kl_coef=0.5, reward_coef=0.5)
  batch = _batch(np.random.default_rng(0))
  adv = objective.batch_advantages(gspo, batch.replace(teacher_logprobs=np.zeros_like(batch.loss_mask)), 2)
  np.testing.assert_allclose(adv, 0.5 * algorithms.grpo_advantages(jnp.asarray(batch.rewards), 2, gspo.adv_eps))


@pytest.mark.parametrize("rows_per_pass", [0, 2])
def test_teacher_top_k_matches_transformers_among_the_students_ids(teacher_dir, rows_per_pass):
  k, vocab = 4, 50  # the student samples ids < 50 of the teacher's 67
  teacher = Teacher.load(TeacherConfig(hf_checkpoint=str(teacher_dir), rows_per_pass=rows_per_pass),
                         dtype="float32", top_k=k, student_vocab=vocab)
  batch = _batch(np.random.default_rng(0), appended=(2, 3), vocab=vocab)
  got = teacher.scores(batch)
  ids, lps = got["teacher_top_ids"], got["teacher_top_logprobs"]
  assert ids.shape == lps.shape == (*batch.loss_mask.shape, k) and ids.dtype == np.int32
  ref = hf_models.reload(teacher_dir)
  for b in range(batch.batch_size):
    start = int(np.argmax(batch.input_mask[b]))
    lp = _hf_logprobs(ref, batch.tokens[b, start:])
    for t in np.flatnonzero(batch.loss_mask[b]):
      row = lp[t - start]
      np.testing.assert_array_equal(ids[b, t], np.argsort(-row[:vocab])[:k], err_msg=f"row {b} slot {t}")
      np.testing.assert_allclose(lps[b, t], row[ids[b, t]], atol=2e-4)
      np.testing.assert_allclose(got["teacher_logprobs"][b, t], row[batch.tokens[b, t + 1]], atol=2e-4)
  off = batch.loss_mask == 0
  assert np.all(ids[off] == 0) and np.all(lps[off] == 0)


def test_the_forward_kl_loss_and_gradient_are_the_exact_expressions(tmp_path):
  """The trainer's loss with the forward-KL term alone is the token mean of sum_v q(v) (log q(v) - log pi_s(v))
  over the teacher's top-k, pi_s from the student's full log-softmax (an independent computation), and so is its
  gradient."""
  hf_models.make_dir(tmp_path, "llama", tie=False, seed=0)
  cfg, params = hf.load_checkpoint(str(tmp_path), dtype="float32")
  B, P, N, k = 4, 4, 6, 5
  rng = np.random.default_rng(1)
  toks = rng.integers(3, cfg.vocab_size, (B, P + N)).astype(np.int32)
  mask = np.ones_like(toks, bool)
  mask[1, :2] = False  # a left-padded prompt
  toks[~mask] = 0
  lm = response_loss_mask(mask, P)
  lm[2, P - 1 + 3] = 0.0  # an appended token
  ids = (rng.integers(0, cfg.vocab_size, (*lm.shape, k)) * (lm[..., None] > 0)).astype(np.int32)
  tlp = (np.sort(-rng.uniform(0.1, 5.0, (*lm.shape, k)), -1) * lm[..., None]).astype(np.float32)
  batch = RolloutBatch(tokens=toks, input_mask=mask, loss_mask=lm, behaviour_logprobs=np.zeros_like(lm),
                       rewards=np.zeros(B, np.float32), versions=np.zeros(B, np.int32),
                       group_ids=np.arange(B, dtype=np.int32), prompt_len=P, teacher_logprobs=np.zeros_like(lm),
                       teacher_top_ids=ids, teacher_top_logprobs=tlp)
  algo = algorithms.get_algorithm("distill", distill_coef=0.0, forward_kl_coef=0.7, forward_kl_top_k=k)
  x = loss_inputs(algo, jax.tree.map(jnp.asarray, batch), 1)
  surrogate = lambda p: rl_loss(p, cfg, algo, x, num_tokens=jnp.sum(x.loss_mask), num_seqs=B, num_rows=B,
                                layout=layouts.of(batch))

  def exact(p):
    logits = models.forward(p, cfg, toks, input_mask=mask)[0]
    s = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), ids, -1)
    q = jax.nn.log_softmax(tlp, -1)
    per_slot = jnp.sum(jnp.exp(q) * (q - s), -1)
    return 0.7 * jnp.sum(per_slot * lm) / np.sum(lm)

  (loss, metrics), g1 = jax.value_and_grad(surrogate, has_aux=True)(params)
  want, g2 = jax.value_and_grad(exact)(params)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(metrics["forward_kl_sum"] / np.sum(lm) * 0.7, want, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g2)
  assert float(want) > 0
  plain = algorithms.get_algorithm("distill", distill_coef=0.5)  # no term, no metric
  x = loss_inputs(plain, jax.tree.map(jnp.asarray, batch), 1)
  _, metrics = rl_loss(params, cfg, plain, x, num_tokens=jnp.sum(x.loss_mask), num_seqs=B, num_rows=B,
                       layout=layouts.of(batch))
  assert "forward_kl_sum" not in metrics
