"""The search environment (`env.name="search"`): the policy answers a question with a search tool over the run's
corpus, as in Search-R1. It searches in its own tool-call format (Hermes `<tool_call>` JSON where the chat
template has a tool block, `<search>query</search>` where it has none, SmolLM2's), each search is answered by a
tool turn of the top `env.top_k` passages (`Doc i (Title: t) text`, the text cut to `env.passage_chars`), and a
turn with no call is the final answer: `<answer>...</answer>` or its last line, graded by the run's reward
(`qa_em`, `qa_f1`) on that last turn only, so a retrieved passage never reaches the grader. Passages are
environment content: rendered as plain text, never control tokens (rlax.envs.renderers). Searches go to the
run's one retrieval service (`EnvContext.retrieval`), batched with every other episode's, under
`env.tool_timeout_s`; at most `env.max_tool_calls` per episode.

Each episode reports (Environment.metrics, logged as env/<name>): `searches` (calls made), `search_rate` (it
searched at all), `search_failed` (its searches' share that timed out or failed), `search_empty` (its answered
searches' share that found nothing), `recall` (a gold answer appears in the titles and texts its searches
returned), and the final answer's `em` and `f1`.
"""

from __future__ import annotations

import re
from typing import Sequence

from rlax.envs import renderers
from rlax.envs import retrieval as retrieval_lib
from rlax.envs import tools as tools_lib
from rlax.envs.base import EnvContext
from rlax.envs.tool_env import ToolEnv
from rlax.rewards import qa

MAX_QUERY_CHARS = 500  # a policy's query past this is cut: a retriever's cost grows with it
NO_PASSAGES = "No passages found."
_LABEL = re.compile(r"^Doc \d+ \(Title: ", re.M)
_ANSWER = "When you know the answer, reply with only <answer>the answer</answer>."
SYSTEM = {"tags": "Answer the question with the help of a search engine. To search, reply with only "
                  "<search>query</search>, the query being the name the question asks about, and the search "
                  "engine answers with passages. Search again when they do "
                  "not hold the answer. " + _ANSWER,
          "json": "Answer the question with the help of the search tool: call it with a query, and it answers "
                  "with passages. Search again when they do not hold the answer. " + _ANSWER}

# Worked examples (env.examples of them), about people and places of no corpus: (question, [(query, passages)],
# answer). The first needs two searches, the second query taken from the first search's passages; the last
# one, nearest the question, searches the question's own name.
EXAMPLES = (
    ("In which city was the founder of the Brasimel Company born?",
     [("Brasimel Company", [("Brasimel Company", "The Brasimel Company was founded by Oda Kestrin in 1801. Its "
                             "headquarters are in Velloc."), ("Velloc", "Velloc is a city in Tarnau.")]),
      ("Oda Kestrin", [("Oda Kestrin", "Oda Kestrin was born in Mirrow in 1766."),
                       ("Oda Kestrin", "Oda Kestrin worked as a printer.")])], "Mirrow"),
    ("In which country is the city of Velloc?",
     [("Velloc", [("Velloc", "Velloc is a city in Tarnau."),
                  ("Brasimel Company", "The Brasimel Company was founded by Oda Kestrin in 1801. Its headquarters "
                   "are in Velloc.")])], "Tarnau"),
    ("What did Talo Venmar work as?",
     [("Talo Venmar", [("Talo Venmar", "Talo Venmar was born in Quenrith in 1712."),
                       ("Talo Venmar", "Talo Venmar worked as a weaver."),
                       ("Quenrith", "Quenrith is a city in Dovaria.")])], "weaver"),
)


def render_passages(passages: Sequence[retrieval_lib.Passage], chars: int) -> str:
  """A search's tool turn: `Doc i (Title: t) text` per passage (text cut to `chars`), or NO_PASSAGES."""
  if not passages:
    return NO_PASSAGES
  return "\n".join(f"Doc {i} (Title: {p.title}) {p.text[:chars]}" for i, p in enumerate(passages, 1))


def call_format(ctx: EnvContext) -> str:
  """"json" where the chat template has a tool block (Hermes/Qwen, Llama 3), else "tags"."""
  family = ctx.config.renderer if ctx.config.renderer != "auto" else renderers.family_of(ctx.tokenizer)
  return "tags" if family == "chatml" else "json"


class SearchEnv(ToolEnv):
  """See the module docstring."""

  def __init__(self, ctx: EnvContext):
    if ctx.retrieval is None:
      raise ValueError("env.name='search' needs a retriever: set env.retriever ('bm25' with env.corpus, an "
                       "http(s):// server or 'module:fn')")
    cfg, self.format = ctx.config, call_format(ctx)
    tool = tools_lib.Tool.from_function(self.search, version=f"{cfg.retriever}|{cfg.corpus}|{ctx.retrieval.version}|"
                                        f"{cfg.top_k}|{cfg.passage_chars}")
    calls = renderers.TagCalls({"search": "search"}, argument="query") if self.format == "tags" else None
    super().__init__(ctx, [tool], calls=calls, system=SYSTEM[self.format])
    self.searches, self.failed, self.empty, self.found, self.final = 0, 0, 0, [], ""

  async def search(self, query: str) -> str:
    """Searches the corpus; returns the best passages, each with its title."""
    q = " ".join(query.encode("utf-8", "replace").decode("utf-8").split())[:MAX_QUERY_CHARS]  # no lone surrogates
    hits = await self.ctx.retrieval.search(q, self.cfg.top_k) if q else []
    return render_passages(hits, self.cfg.passage_chars)

  def messages(self, record) -> list[dict]:
    """The system prompt, `env.examples` worked examples, then the record's conversation."""
    examples = []
    for question, searches, answer in EXAMPLES[:self.cfg.examples]:
      examples.append({"role": "user", "content": question})
      for query, passages in searches:
        found = [retrieval_lib.Passage(f"example/{i}", t, x) for i, (t, x) in enumerate(passages)]
        call = self.render.calls.write(tools_lib.ToolCall("search", {"query": query}))
        examples += [{"role": "assistant", "content": call},
                     {"role": self.render.tool_role, "content": render_passages(found, self.cfg.passage_chars)}]
      examples.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
    own = super().messages(record)
    head = [m for m in own if m["role"] == "system"][:1]
    return head + examples + [m for m in own if m not in head]

  async def run_calls(self, calls, key) -> list[tools_lib.ToolResult]:
    results = await super().run_calls(calls, key)
    for c, r in zip(calls, results):
      if c.name != "search":
        continue
      self.searches += 1
      if r.outcome not in ("ok", "truncated"):
        self.failed += 1
        continue
      self.empty += r.output == NO_PASSAGES
      self.found.append(_LABEL.sub(" ", r.output))  # titles and texts: recall never matches "Doc 2"
    return results

  async def final_reward(self, text: str) -> tuple[float, dict]:
    self.final = text  # the answer the metrics grade too
    return await super().final_reward(text)

  def metrics(self) -> dict[str, float]:
    out = {"searches": float(self.searches), "search_rate": float(self.searches > 0)}
    answered = self.searches - self.failed
    if self.searches:
      out["search_failed"] = self.failed / self.searches
    if answered:
      out["search_empty"] = self.empty / answered
    if self.record is not None and self.record.answer is not None:
      seen = f" {qa.normalize(' '.join(self.found))} "
      out["recall"] = float(any(f" {qa.normalize(g)} " in seen for g in qa.golds(self.record)))
      _, info = qa.qa_f1_reward(self.final, self.record) if self.final else (0.0, {"em": 0.0, "f1": 0.0})
      out.update(em=info["em"], f1=info["f1"])
    return out
