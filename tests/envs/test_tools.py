"""Tools never stall or crash an episode: a huge power, an infinite loop, a 10 MB answer, invalid JSON, an
unknown tool, bad arguments, an exception and an unavailable tool each become an error observation with a
counted outcome, and the pool keeps serving. Also the schema a function's type hints give."""

import asyncio
import time

import pytest

from rlax import envs, rewards
from rlax.envs import renderers, tools


def spin(n: int) -> str:
  """Never returns."""
  while True:
    n += 1


def flood(n: int) -> str:
  """n megabytes of text."""
  return "x" * (n << 20)


def boom(why: str) -> str:
  """Raises."""
  raise RuntimeError(why)


def add(a: int, b: int = 0) -> str:
  """Adds two integers.

  Longer text that is not part of the description."""
  return str(a + b)


TOOLS = [tools.Tool.from_function(f) for f in (tools.calculator, spin, flood, boom, add)]


@pytest.fixture(scope="module")
def pool():
  with rewards.VerifierPool(num_workers=2, timeout_s=1.0, memory_mb=512) as p:
    yield p


def run(runner, *calls):
  return asyncio.run(runner.run([renderers.ToolCall(n, a) for n, a in calls]))


def test_schema_from_type_hints():
  s = tools.Tool.from_function(add).schema()["function"]
  assert s["name"] == "add" and s["description"] == "Adds two integers."
  assert s["parameters"] == {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                             "required": ["a"]}
  with pytest.raises(ValueError, match="argument x has type"):
    tools.Tool.from_function(_bad)


def _bad(x: set) -> str:
  """A type JSON has no name for."""
  return str(x)


def test_hostile_calls_become_error_observations_and_the_pool_keeps_serving(pool):
  runner = tools.ToolRunner(pool, TOOLS, timeout_s=1.0, output_chars=100)
  t0 = time.monotonic()
  res = run(runner, ("calculator", {"expression": "9**9**9**9"}), ("spin", {"n": 1}), ("flood", {"n": 10}),
            ("boom", {"why": "broken"}), ("calculator", {"expression": "__import__('os')"}),
            ("calculator", {"expression": "23*47"}))
  wall = time.monotonic() - t0
  outcomes = [r.outcome for r in res]
  assert outcomes[0] in ("timeout", "tool_error")  # the deadline, or the memory cap, whichever comes first
  assert outcomes[1] == "timeout" and "did not finish within 1s" in res[1].output
  assert outcomes[2] == "truncated" and res[2].output == "x" * 100  # cut inside the worker
  assert outcomes[3] == "tool_error" and "broken" in res[3].output
  assert outcomes[4] == "tool_error" and "only numbers" in res[4].output
  assert res[5] == tools.ToolResult("1081", "ok")
  assert wall < 10, wall  # two workers, two 1 s deadlines: nothing waits for a hung call
  assert run(runner, ("add", {"a": 2, "b": 3}))[0] == tools.ToolResult("5", "ok")  # still serving


def test_unknown_tools_bad_arguments_and_unavailable(pool):
  runner = tools.ToolRunner(pool, TOOLS)
  res = run(runner, ("nope", {}), ("add", {"b": 1}), ("add", {"a": "2"}), ("add", {"a": True}),
            ("add", {"a": 1, "c": 2}))
  assert [r.outcome for r in res] == ["unknown_tool"] + ["bad_arguments"] * 4
  assert "unknown tool 'nope'" in res[0].output and "missing arguments ['a']" in res[1].output
  assert "must be integer, got str" in res[2].output and "got bool" in res[3].output
  assert "unknown arguments ['c']" in res[4].output
  off = tools.ToolRunner(pool, TOOLS, available=False)
  assert run(off, ("add", {"a": 1}))[0] == tools.ToolResult("error: the tool is unavailable", "tool_error")


def test_malformed_calls_are_parse_errors():
  hermes = renderers.JsonCalls()
  turn = hermes.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call> and '
                      '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call> <tool_call>[1]</tool_call>'
                      '<tool_call>{"name": "add", "arguments": 3}</tool_call>')
  assert turn.calls == (renderers.ToolCall("add", {"a": 2}, '{"name": "add", "arguments": {"a": 2}}'),)
  assert len(turn.errors) == 3 and "invalid JSON" in turn.errors[0] and not turn.final
  assert "string 'name'" in turn.errors[1] and "'arguments' must be an object" in turn.errors[2]
  llama = renderers.JsonCalls(tag="", arguments_key="parameters")
  assert llama.parse('{"name": "add", "parameters": {"a": 1}}').calls[0].arguments == {"a": 1}
  assert llama.parse("The answer is 3.").final
  tags = renderers.TagCalls({"calc": "calculator"})
  assert tags.parse("<calc>2*3</calc>").calls[0].arguments == {"expression": "2*3"}
  assert tags.parse("<calc>2*3").errors == ("unclosed <calc> tag",)


class _Tok:
  """Characters as token ids, for ToolEnv's loop without a model."""
  chat_template = None

  def encode(self, text, add_special_tokens=False):
    return [ord(c) for c in text]

  def encode_chat(self, pieces):
    return [ord(c) for text, _ in pieces for c in text]

  def decode(self, ids):
    return "".join(map(chr, ids))


def test_tool_env_turns_errors_into_observations_and_counts_stops(pool):
  cfg = envs.EnvConfig(name="calculator", renderer="chatml", max_turns=3, max_tool_calls=2)
  graded = []

  def grade(fn, texts, records):
    graded.append(texts[0])
    return [(float(texts[0].rstrip("<|im_end|>").endswith("1081.")), {})]

  ctx = envs.EnvContext(tokenizer=_Tok(), render=None, reward_fn=None, grade=grade, pool=pool, config=cfg)

  def turn(text, i, finish="eos", left=500):
    ids = _Tok().encode(text)
    return envs.Turn(tokens=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason=finish,
                     index=i, context_left=left)

  async def episode(*texts, **kw):
    env = envs.CalculatorEnv(ctx)
    await env.reset(type("R", (), {"prompt": "What is 23 * 47?", "messages": None})())
    out = []
    for i, t in enumerate(texts):
      out.append(await env.step(turn(t, i, **kw)))
    return out

  a, b, c = asyncio.run(episode("<calc>23*</calc><|im_end|>", "<calc>23*47</calc><|im_end|>",
                                "The answer is 1081.<|im_end|>"))
  assert list(a.calls) == ["tool_error"] and not a.done and "error:" in _Tok().decode(a.tokens)
  assert _Tok().decode(b.tokens) == "\n<|im_start|>tool\n1081<|im_end|>\n<|im_start|>assistant\n"
  assert c.done and c.stop_reason == "final_answer" and c.reward == 1.0
  assert graded == ["The answer is 1081.<|im_end|>"]  # only the last policy turn is graded
  *_, last = asyncio.run(episode("<calc>1+1</calc>", "<calc>2+2</calc>", "<calc>3+3</calc>"))
  assert last.done and last.stop_reason == "max_turns" and last.reward == 0.0
  r, = asyncio.run(episode("<calc>1+1</calc> <calc>2+2</calc> <calc>3+3</calc>"))
  assert r.done and r.stop_reason == "max_tool_calls"
  r, = asyncio.run(episode("<calc>23*47</calc>", left=5))
  assert r.done and r.stop_reason == "context_full"
  r, = asyncio.run(episode("The answer is", finish="length"))
  assert r.done and r.stop_reason == "length" and r.reward == 0.0
  r, = asyncio.run(episode("<calc>23*47</calc>", finish="stop"))  # no end token sampled: the marker is added
  assert _Tok().decode(r.tokens).startswith("<|im_end|>\n<|im_start|>tool\n1081")


def test_async_tools_run_on_the_loop_under_the_deadline_and_are_fingerprinted():
  from rlax.envs import journal

  async def lookup(key: str) -> str:
    """Looks up a key."""
    if key == "slow":
      await asyncio.sleep(5)
    if key == "bad":
      raise KeyError(key)
    return key * 10

  tool = tools.Tool.from_function(lookup)
  assert tool.is_async and tool.parameters["required"] == ["key"]
  runner = tools.ToolRunner(None, [tool], timeout_s=0.2, output_chars=12)  # no pool: async tools need none
  calls = [renderers.ToolCall("lookup", {"key": k}) for k in ("ab", "a", "slow", "bad")] + [
      renderers.ToolCall("lookup", {"key": 1})]
  t0 = time.monotonic()
  out = asyncio.run(runner.run(calls))
  assert time.monotonic() - t0 < 2
  assert [r.outcome for r in out] == ["truncated", "ok", "timeout", "tool_error", "bad_arguments"]
  assert out[0].output == "ab" * 6 and out[1].output == "a" * 10 and "KeyError" in out[3].output
  fp = lambda t: journal.fingerprint([t], True, 12, 0.2)
  assert fp(tool) != fp(tools.Tool.from_function(lookup, version="corpus-2"))
