"""Stream.extend: a held row that stopped takes given tokens into its cache (no re-prefill of its prefix) and
decodes on; against prefilling the concatenation and a teacher-forced full-forward reference, on the dense and
the paged layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import models as M
from rlax import sampler as S
from rlax.sampler import rows as rows_lib

from harness.sampling_ref import CFG, P0, P1, PROMPTS

ENV = [[7, 8, 9], [11], [5, 6, 4, 3, 2]]  # an environment's replies: 3, 1 and 5 tokens


def make(attention="dense", **kw):
  args = dict(max_prompt_len=8, max_new_tokens=24, slots=4, decode_chunk=3, params=P0, attention=attention)
  if attention != "dense":
    args["page_size"] = 4  # a slot's 32 positions span 8 pages: writes cross page edges
  args.update(kw)
  return S.Sampler(CFG, **args)


def run_episodes(cs, strategy, prompts, turns, *, seed=0, first=3, then=4, weights=None, before_turn=None):
  """Each prompt is an episode of one row: sampled `first` tokens, then for each reply in `turns` the reply is
  appended and `then` more tokens sampled. Returns {prompt index: final host output of its row}."""
  stream = cs.stream(strategy, weights=weights)
  stream.submit(prompts, samples_per_prompt=1, seed=seed, max_new_tokens=first, hold=True)
  turn = {i: 0 for i in range(len(prompts))}
  replies = turns if isinstance(turns, dict) else {i: turns for i in turn}  # {prompt index: its replies}
  done = {}
  while stream.pending:
    for g in stream.step():
      (req,) = g.requests
      if turn[g.tag] == len(replies[g.tag]):
        done[g.tag] = g.out
        stream.release(req)
        continue
      if before_turn is not None:
        before_turn(turn[g.tag])
      assert stream.extend(req, replies[g.tag][turn[g.tag]], max_new_tokens=then)
      turn[g.tag] += 1
  return done


def teacher_forced(params, prompt, tokens):
  """Log-prob of every token after the prompt under `params` (full forward, no cache)."""
  seq = np.asarray([list(prompt) + list(tokens)], np.int32)
  return np.asarray(M.token_logprobs(params, CFG, jnp.asarray(seq)))[0, len(prompt) - 1:]


def check_episode(out, prompt, turns, first, then, params_of, seed, pid, strategy=S.Temperature(1.0), atol=1e-5):
  """Layout: [first sampled | turn 0 | then sampled | turn 1 | then sampled ...]; sampled tokens are drawn from
  the full forward of everything before them with the uniform of their index; appended ones are marked."""
  toks, lps, smp, ver = (np.asarray(x)[0] for x in (out.tokens, out.logprobs, out.sampled, out.versions))
  n = first + sum(len(t) + then for t in turns)
  assert int(out.lengths[0]) == n and not smp[n:].any() and np.all(ver[n:] == -1)
  want = np.zeros(n, bool)
  want[:first] = True
  at = first
  for t in turns:
    np.testing.assert_array_equal(toks[at:at + len(t)], t)
    at += len(t)
    want[at:at + then] = True
    at += then
  np.testing.assert_array_equal(smp[:n], want)
  assert np.all(lps[:n][~want] == 0)
  key = jax.random.wrap_key_data(rows_lib.row_key_data(seed, 0, [pid], [0]))
  seq = jnp.asarray([list(prompt) + toks[:n].tolist()], jnp.int32)
  full = {}  # version → causal full-forward logits of the whole episode: position p sees tokens up to p only
  for j in np.flatnonzero(want):  # each sampled token: its own index's uniform over the full-forward logits
    v = int(ver[j])
    if v not in full:
      full[v] = M.forward(params_of(v), CFG, seq)[0][0]
    logits = full[v][len(prompt) + j - 1][None]
    tok, lp = strategy.sample(logits, rows_lib.uniforms(key, j))
    assert int(tok[0]) == toks[j], j
    np.testing.assert_allclose(lps[j], float(lp[0]), atol=atol, err_msg=f"token {j}")
  tf = teacher_forced(params_of(int(ver[n - 1])), prompt, toks[:n])
  if len(set(ver[:n][want].tolist())) == 1:
    np.testing.assert_allclose(lps[:n][want], tf[:n][want], atol=atol)


@pytest.mark.parametrize("attention", ["dense", "paged"])
def test_extend_then_decode_equals_prefilling_the_concatenation(attention):
  """Greedy: a row extended twice decodes exactly what a fresh prefill of prompt + everything before decodes."""
  cs = make(attention)
  done = run_episodes(cs, S.Greedy(), PROMPTS[:3], ENV[:2])
  fresh = make("dense", max_prompt_len=24)
  for i, out in done.items():
    toks, lps = np.asarray(out.tokens)[0], np.asarray(out.logprobs)[0]
    cut = 3 + len(ENV[0]) + 4 + len(ENV[1])  # everything before the last turn's sampled tokens
    again = fresh.generate([PROMPTS[i] + toks[:cut].tolist()], strategy=S.Greedy(), max_new_tokens=4)
    np.testing.assert_array_equal(np.asarray(again.tokens)[0, :4], toks[cut:cut + 4])
    np.testing.assert_allclose(np.asarray(again.logprobs)[0, :4], lps[cut:cut + 4], atol=1e-5)
    check_episode(out, PROMPTS[i], ENV[:2], 3, 4, lambda v: P0, 0, i, strategy=S.Greedy())


@pytest.mark.parametrize("attention", ["dense", "paged"])
def test_sampled_turns_match_the_reference(attention):
  """Temperature sampling over three turns (replies of 3, 1 and 5 tokens), more episodes than slots."""
  cs = make(attention, slots=2)
  done = run_episodes(cs, S.Temperature(1.0), PROMPTS, ENV, seed=4)
  assert sorted(done) == [0, 1, 2, 3]
  for i, out in done.items():
    check_episode(out, PROMPTS[i], ENV, 3, 4, lambda v: P0, 4, i)


@pytest.mark.parametrize("attention", ["dense", "paged"])
def test_replies_longer_than_a_block_are_fed_in_several(attention):
  """Replies of 13 and 2 tokens extended in one call run in blocks of 8 (`warmup.extend_block`): two loops, the
  second writing only the long reply's last 5 fed tokens over the cache the first wrote."""
  cs = make(attention)
  assert cs.extend_buckets() == ((1, 2, 4), (8,))
  calls = []
  extension = cs.extension
  cs.extension = lambda *a, **k: calls.append(len(a[2])) or extension(*a, **k)  # rows per call
  replies = {0: [list(range(40, 53))], 1: [[9, 10]]}
  done = run_episodes(cs, S.Temperature(1.0), PROMPTS[:2], replies, seed=3)
  assert calls == [2] and cs.trace_counts["extend"] == 1
  for i, out in done.items():
    check_episode(out, PROMPTS[i], replies[i], 3, 4, lambda v: P0, 3, i)


def test_interpreted_kernel_extends_like_the_reference():
  """The Pallas kernel in interpret mode loads K/V as bf16: the same greedy tokens, log-probs to bf16 precision."""
  want = run_episodes(make("paged"), S.Greedy(), PROMPTS[:2], ENV[:1])
  got = run_episodes(make("paged_interpret"), S.Greedy(), PROMPTS[:2], ENV[:1])
  for i in want:
    np.testing.assert_array_equal(np.asarray(got[i].tokens), np.asarray(want[i].tokens))
    np.testing.assert_allclose(np.asarray(got[i].logprobs), np.asarray(want[i].logprobs), atol=3e-2)


@pytest.mark.parametrize("attention", ["dense", "paged"])
def test_extending_across_a_weight_swap_recomputes_the_cache(attention):
  """Weights change between turns and inside one (on_swap="recompute"): every sampled token's log-prob is its
  own version's; the appended tokens carry the version in force when they were appended."""
  cs = make(attention, decode_chunk=2)
  versions = [(cs.placer(P0), 0)]
  by_version = {0: P0, 1: P1, 2: P0}

  def before_turn(turn):
    if len(versions) == turn + 1:
      v = len(versions)
      versions.append((cs.placer(by_version[v]), v))

  done = run_episodes(cs, S.Temperature(1.0), PROMPTS[:2], ENV[:2], seed=2, weights=lambda: versions[-1],
                      before_turn=before_turn)
  for i, out in done.items():
    ver = np.asarray(out.versions)[0]
    assert ver[0] == 0 and ver[int(out.lengths[0]) - 1] == 2
    check_episode(out, PROMPTS[i], ENV[:2], 3, 4, by_version.__getitem__, 2, i)


def test_a_row_past_its_budget_is_refused_never_truncated():
  cs = make(max_new_tokens=12)
  stream = cs.stream(S.Greedy())
  stream.submit(PROMPTS[:1], max_new_tokens=5, hold=True)
  (g,) = stream.step() or stream.step()
  (req,) = g.requests
  before = stream.output(req)
  assert not stream.extend(req, [1, 2, 3, 4], max_new_tokens=4)  # 5 + 4 + 4 > 12
  after = stream.output(req)
  assert int(after.finish_reason[0]) == S.BUDGET and after.lengths[0] == 5
  np.testing.assert_array_equal(after.tokens, before.tokens)
  assert not stream.extend(req, list(range(7)))  # 5 + 7 leave no room for one sampled token
  assert stream.extend(req, [1, 2], max_new_tokens=None)  # the rest of the budget: 5 more
  (g,) = [x for _ in range(4) for x in stream.step()][:1]
  assert int(g.out.lengths[0]) == 12 and int(g.out.finish_reason[0]) == S.LENGTH
  with pytest.raises(ValueError, match="not a held row that has stopped"):
    stream.extend(12345, [1])
  with pytest.raises(ValueError, match="max_new_tokens=0 must be >= 1"):
    stream.extend(req, [1], max_new_tokens=0)
  with pytest.raises(ValueError, match="1-D sequence of token ids"):
    stream.extend(req, [[1, 2]])
  with pytest.raises(ValueError, match=r"token ids must lie in \[0, 64\)"):
    stream.extend(req, [1, 64])


def test_held_rows_filling_every_slot_are_named_when_groups_wait():
  cs = make(slots=2)
  stream = cs.stream(S.Greedy())
  stream.submit(PROMPTS[:2], max_new_tokens=2, hold=True)
  stream.submit(PROMPTS[2:3], max_new_tokens=2)
  held = stream.step()  # both rows stop within the first chunk and keep their slots
  assert len(held) == 2 and stream.queued == 1
  with pytest.raises(ValueError, match="every one of the 2 slots is held by a stopped row and 1 group"):
    stream.step()
  stream.release(held[0].requests[0])
  (g,) = [g for _ in range(3) for g in stream.step()]
  assert g.tag == 0 and not g.requests and int(g.out.lengths[0]) == 2


def test_stop_tokens_of_an_extension_end_the_turn():
  cs = make()
  base = run_episodes(cs, S.Greedy(), PROMPTS[:1], ENV[:1], then=8)[0]
  at = 3 + len(ENV[0])  # the second turn's first sampled token
  stream = cs.stream(S.Greedy())
  stream.submit(PROMPTS[:1], max_new_tokens=3, hold=True)
  (g,) = stream.step()
  assert stream.extend(g.requests[0], ENV[0], max_new_tokens=8, stop=[int(np.asarray(base.tokens)[0, at])])
  out = [x for _ in range(6) for x in stream.step()][0].out
  assert int(out.lengths[0]) == at + 1 and int(out.finish_reason[0]) == S.STOP


def test_slots_of_finished_episodes_are_reused():
  """8 two-turn episodes on 2 slots: a released slot takes the next queued episode; the tail shrinks the held
  rows onto fewer slots and their caches move with them."""
  cs = make(slots=2)
  prompts = [PROMPTS[i % 4] + [i + 1] for i in range(8)]
  done = run_episodes(cs, S.Temperature(1.0), prompts, ENV[:1], seed=9)
  assert sorted(done) == list(range(8))
  for i, out in done.items():
    check_episode(out, prompts[i], ENV[:1], 3, 4, lambda v: P0, 9, i)


def test_submesh_extension_matches_single_device():
  mesh = M.make_mesh(jax.devices()[:4], data=2, fsdp=1, tensor=2)
  one = run_episodes(make(), S.Temperature(1.0), PROMPTS, ENV[:2], seed=1)
  two = run_episodes(make(mesh=mesh), S.Temperature(1.0), PROMPTS, ENV[:2], seed=1)
  for i in one:
    np.testing.assert_array_equal(np.asarray(two[i].tokens), np.asarray(one[i].tokens))
    np.testing.assert_allclose(np.asarray(two[i].logprobs), np.asarray(one[i].logprobs), atol=1e-5)
