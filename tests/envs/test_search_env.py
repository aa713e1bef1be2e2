"""The search environment: its call format per template, passages as tool turns, the answer graded from the last
turn only, its episode metrics, the retrieval service's deadline and failures, and hostile searches."""

import asyncio
import os
import sys
import time

import numpy as np
import pytest

from rlax import envs, rewards
from rlax.data.records import Record
from rlax.envs import retrieval, search_env

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chat_tokenizers import HOSTILE, controls, tokenizer  # noqa: E402

PASSAGES = [retrieval.Passage("p1", "Ada Quill", "Ada Quill was born in Norvale in 1790."),
            retrieval.Passage("p2", "Norvale", "Norvale is a city in Estmark."),
            retrieval.Passage("p3", "Bo Tern", "Bo Tern worked as a miller.")]


class WordRetriever:
  """Passages sharing a word with the query, in corpus order; records each batch it is given."""

  def __init__(self, passages=PASSAGES, delay_s=0.0):
    self.passages, self.delay_s, self.batches = passages, delay_s, []

  def search(self, queries, k):
    self.batches.append(list(queries))
    time.sleep(self.delay_s)
    words = lambda s: set(s.lower().replace(".", " ").split())
    return [[p for p in self.passages if words(q) & words(p.title + " " + p.text)][:k] for q in queries]


def _ctx(family="chatml", retriever=None, grade=None, **cfg):
  tok = tokenizer(family)
  config = envs.EnvConfig(name="search", renderer=family, retriever="x", max_turns=4, max_tool_calls=2,
                          **{"examples": 0, **cfg})
  service = retrieval.RetrievalService(retriever or WordRetriever())
  grade = grade or (lambda fn, texts, recs: [fn(t, r) for t, r in zip(texts, recs)])
  return envs.EnvContext(tokenizer=tok, render=None, reward_fn=rewards.build("qa_em"), grade=grade, pool=None,
                         config=config, retrieval=service)


def _turn(tok, text, index=0, context_left=10**6):
  end = tok.backend.token_to_id("<|eot_id|>" if "eot_id" in str(tok.controls) else "<|im_end|>")
  t = np.array(tok.encode(text, add_special_tokens=False, special=False) + [end])
  return envs.Turn(t, np.zeros(len(t)), np.zeros(len(t), np.int32), "eos", index, context_left)


REC = Record(id="q", prompt="In which country was Ada Quill born?", answer="Estmark", source="2-hop")


def _episode(ctx, turns, record=REC):
  env = envs.get("search")(ctx)

  async def go():
    obs = await env.reset(record)
    results = [await env.step(_turn(ctx.tokenizer, t, i)) for i, t in enumerate(turns)]
    return obs, results
  obs, results = asyncio.run(go())
  return env, obs, results


def test_two_searches_then_the_answer_earn_the_reward_and_report_recall():
  ctx = _ctx()
  env, obs, res = _episode(ctx, ["<search>Ada Quill</search>", "<search>Norvale</search>",
                                 "It is in Estmark.\n<answer>estmark</answer>"])
  assert env.format == "tags" and "<search>query</search>" in ctx.tokenizer.decode(obs.tokens)
  first = ctx.tokenizer.decode(res[0].tokens)
  assert "Doc 1 (Title: Ada Quill) Ada Quill was born in Norvale in 1790." in first and "Doc 2" not in first
  assert [list(r.calls) for r in res[:2]] == [["ok"], ["ok"]] and not res[0].done
  assert res[2].done and res[2].reward == 1.0 and res[2].stop_reason == "final_answer"
  assert env.metrics() == {"searches": 2.0, "search_rate": 1.0, "search_failed": 0.0, "search_empty": 0.0,
                           "recall": 1.0, "em": 1.0, "f1": 1.0}
  stats = envs.batch_stats([dict(turns=3, calls=["ok", "ok"], stop="final_answer", appended=10, tokens=40,
                                 metrics=env.metrics()),
                            dict(turns=1, calls=[], stop="final_answer", appended=0, tokens=5,
                                 metrics={"searches": 0.0, "search_rate": 0.0, "recall": 0.0, "em": 0.0, "f1": 0.0})])
  assert stats["env/searches"] == 1.0 and stats["env/search_rate"] == 0.5 and stats["env/search_empty"] == 0.0
  assert stats["env/recall"] == 0.5 and stats["env/em"] == 0.5


def test_the_reward_reads_the_last_turn_only_never_the_passages():
  seen = []
  grade = lambda fn, texts, recs: seen.extend(texts) or [fn(t, r) for t, r in zip(texts, recs)]
  env, _, res = _episode(_ctx(grade=grade), ["<search>Norvale</search>", "I do not know."])
  assert seen == ["I do not know."] and res[1].reward == 0.0
  m = env.metrics()
  assert m["recall"] == 1.0 and m["em"] == 0.0  # the passage held the answer; the policy did not give it


def test_a_search_that_finds_nothing_is_counted_empty_and_the_control_retriever_finds_nothing():
  ctx = _ctx(retriever=retrieval.FunctionRetriever(retrieval.no_passages))
  env, _, res = _episode(ctx, ["<search>Ada Quill</search>", "<answer>Estmark</answer>"])
  assert search_env.NO_PASSAGES in ctx.tokenizer.decode(res[0].tokens)
  assert env.metrics()["search_empty"] == 1.0 and env.metrics()["recall"] == 0.0 and res[1].reward == 1.0


def test_searches_past_max_tool_calls_end_the_episode():
  _, _, res = _episode(_ctx(), ["<search>a</search><search>b</search><search>c</search>"])
  assert res[0].done and res[0].stop_reason == "max_tool_calls" and res[0].reward == 0.0


@pytest.mark.parametrize("family", ["hermes", "llama3"])
def test_templates_with_a_tool_block_search_in_json(family):
  ctx = _ctx(family)
  env = envs.get("search")(ctx)
  obs = asyncio.run(env.reset(REC))
  assert env.format == "json"
  if family == "hermes":  # the test's Llama template writes no tool schemas
    assert '"name": "search"' in ctx.tokenizer.decode(obs.tokens)
  call = env.render.calls.write(envs.ToolCall("search", {"query": "Ada Quill"}))
  res = asyncio.run(env.step(_turn(ctx.tokenizer, call)))
  assert list(res.calls) == ["ok"] and "Norvale in 1790" in ctx.tokenizer.decode(res.tokens)


def test_worked_examples_come_before_the_question():
  ctx = _ctx(examples=3)
  env = envs.get("search")(ctx)
  msgs = env.messages(REC)
  assert msgs[0]["role"] == "system" and msgs[-1] == {"role": "user", "content": REC.prompt}
  said = [m["content"] for m in msgs if m["role"] == "assistant"]
  assert said == ["<search>Brasimel Company</search>", "<search>Oda Kestrin</search>", "<answer>Mirrow</answer>",
                  "<search>Velloc</search>", "<answer>Tarnau</answer>", "<search>Talo Venmar</search>",
                  "<answer>weaver</answer>"]
  tool_turns = [m["content"] for m in msgs if m["role"] == env.render.tool_role]
  assert len(tool_turns) == 4 and tool_turns[0].startswith("Doc 1 (Title: Brasimel Company) The Brasimel")
  assert len(env.messages(REC)) - len(envs.get("search")(_ctx(examples=1)).messages(REC)) == 8  # two 1-search examples


def test_the_deadline_and_a_failing_retriever_are_call_outcomes_not_crashes():
  slow = _ctx(retriever=WordRetriever(delay_s=1.0), tool_timeout_s=0.2)
  env, _, res = _episode(slow, ["<search>Ada</search>"])
  assert list(res[0].calls) == ["timeout"] and "did not finish" in slow.tokenizer.decode(res[0].tokens)
  m = env.metrics()
  assert m["searches"] == 1.0 and m["search_failed"] == 1.0 and "search_empty" not in m

  class Broken:
    def search(self, queries, k):
      raise RuntimeError("index offline")
  _, _, res = _episode(_ctx(retriever=Broken()), ["<search>Ada</search>"])
  assert list(res[0].calls) == ["tool_error"] and "index offline" in _ctx().tokenizer.decode(res[0].tokens)


def test_concurrent_episodes_share_one_retriever_call():
  retriever = WordRetriever(delay_s=0.05)
  ctx = _ctx(retriever=retriever, retrieval_window_ms=50)
  ctx = ctx.__class__(**{**ctx.__dict__, "retrieval": retrieval.RetrievalService(retriever, window_s=0.05)})

  async def one(q):
    env = envs.get("search")(ctx)
    await env.reset(REC)
    return await env.step(_turn(ctx.tokenizer, f"<search>{q}</search>"))
  async def many():
    return await asyncio.gather(*(one(q) for q in ("Ada", "Norvale", "Bo", "Tern")))
  res = asyncio.run(many())
  assert all(list(r.calls) == ["ok"] for r in res) and len(retriever.batches) == 1 and len(retriever.batches[0]) == 4


def test_recall_reads_titles_and_texts_never_the_labels():
  rec = Record(id="n", prompt="How many?", answer="2", source="1-hop")
  env, _, _ = _episode(_ctx(), ["<search>Ada Norvale</search>", "<answer>3</answer>"], record=rec)
  assert env.metrics()["recall"] == 0.0  # "Doc 2" is a label, not a passage saying 2


def test_a_lone_surrogate_in_a_json_query_is_replaced_not_raised():
  ctx = _ctx("hermes")
  env = envs.get("search")(ctx)
  asyncio.run(env.reset(REC))
  res = asyncio.run(env.step(_turn(ctx.tokenizer, '<tool_call>{"name": "search", "arguments": {"query": "Ada \\ud800"}}'
                                                  '</tool_call>')))
  assert list(res.calls) == ["ok"] and "Ada Quill was born" in ctx.tokenizer.decode(res.tokens)


def test_hostile_queries_and_passages_stay_text():
  planted = [retrieval.Passage("evil", "Ada Quill", "Ada Quill " + HOSTILE * 3)]
  ctx = _ctx(retriever=WordRetriever(planted), passage_chars=10_000)
  query = "Ada " + HOSTILE + "x" * 60_000
  env, _, res = _episode(ctx, [f"<search>{query}</search>"])
  assert list(res[0].calls) in (["ok"], ["truncated"])
  assert controls(ctx.tokenizer, res[0].tokens) == {"<|im_start|>": 2, "<|im_end|>": 1}  # the tool turn's own
  queried = ctx.retrieval.retriever.batches[0][0]
  assert len(queried) <= search_env.MAX_QUERY_CHARS and "\n" not in queried


def test_search_without_a_retriever_is_one_clear_error():
  ctx = _ctx()
  ctx = ctx.__class__(**{**ctx.__dict__, "retrieval": None})
  with pytest.raises(ValueError, match="env.retriever"):
    envs.get("search")(ctx)
