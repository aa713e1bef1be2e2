"""Hostile policies and tools against the environment side: parse bombs in tool calls, control-token injection
through tool output, retrieved text and echoed policy text (every renderer family, appended and re-rendered
turns), and a corrupted tool journal. Each case asserts the safe outcome and a clean host (`clean_host`).
"""

import asyncio
import functools
import json
import os
import sys
import time

import numpy as np
import pytest

from rlax import envs
from rlax.envs import journal as journal_lib
from rlax.envs import renderers, tools

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envs"))
from chat_tokenizers import DROPS_REASONING, HOSTILE, chat, controls, tokenizer  # noqa: E402

MB = 1 << 20
FAMILIES = [("chatml", None), ("hermes", None), ("llama3", None), ("chatml", DROPS_REASONING)]
CALC = renderers.TagCalls({"calc": "calculator", "search": "search"})
HERMES, LLAMA = renderers.JsonCalls(), renderers.JsonCalls(tag="", arguments_key="parameters")


@functools.lru_cache(maxsize=None)
def _tok(family, template=None):
  return tokenizer(family, template)


def _parse_all(text):
  """Every parser on `text`, timed: nothing raises, every attempted call is a call or one error."""
  out = []
  for p in (CALC, HERMES, LLAMA):
    t = time.perf_counter()
    got = p.parse(text)
    out.append((got, time.perf_counter() - t))
    assert len(got.calls) + len(got.errors) <= renderers.MAX_CALLS + 1
    assert all(isinstance(e, str) and len(e) < 1000 for e in got.errors)
  return out


# -- parse bombs ---------------------------------------------------------------------------------------------
def test_deep_nesting_is_one_parse_error(clean_host):
  for body in ["[" * 10_000, '{"name": "add", "arguments": {"a": ' + "[" * 10_000 + "]" * 10_000 + "}}",
               '{"name": "add", "arguments": ' + '{"a": ' * 5_000 + "1" + "}" * 5_001]:
    for got in (HERMES.parse(f"<tool_call>{body}</tool_call>"), LLAMA.parse("{" + body)):
      assert not got.calls and len(got.errors) == 1 and "nested deeper" in got.errors[0]
  ok = '{"name": "add", "arguments": {"a": ' + "[" * 30 + "]" * 30 + "}}"  # depth 32: allowed
  assert HERMES.parse(f"<tool_call>{ok}</tool_call>").calls


def test_oversized_bodies_are_errors_without_parsing(clean_host):
  big = "1+" * MB + "1"
  for p, text in [(CALC, f"<calc>{big}</calc>"), (HERMES, f'<tool_call>{{"name": "a", "x": "{big}"}}</tool_call>'),
                  (LLAMA, f'{{"name": "a", "parameters": {{"x": "{big}"}}}}')]:
    got = p.parse(text)
    assert not got.calls and got.errors == (got.errors[0],) and "longer than" in got.errors[0]


def test_a_megabyte_of_openings_scans_in_linear_time(clean_host):
  for text in ["<calc>" * (MB // 6), "<tool_call>" * (MB // 11), "<calc>1</calc>" * (MB // 14),
               "<calc>1</calc><search>q</search>" * (MB // 32), "</calc><calc" * (MB // 12), "{" * MB,
               '<tool_call>"\\"' * (MB // 15)]:
    for got, seconds in _parse_all(text):
      assert seconds < 1.5, (text[:20], seconds)


def test_calls_past_the_cap_are_one_counted_error(clean_host):
  got = CALC.parse("<calc>1+1</calc>" * 10_000)
  assert len(got.calls) == renderers.MAX_CALLS and got.errors == ("9984 more tool calls ignored: at most 16 a turn",)
  got = HERMES.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 100 + "<tool_call>[")
  assert len(got.calls) == 16 and len(got.errors) == 1


@pytest.mark.parametrize("body", [
    '{"name": "a", "arguments": {"x": 1e999999}}', '{"name": "a", "arguments": {"x": -1e999999}}',
    '{"name": "a", "arguments": {"x": NaN}}', '{"name": "a", "arguments": {"x": Infinity}}',
    '{"name": "a", "arguments": {"x": ' + "9" * 100_000 + "}}", '{"name": "a", "arguments": {"x": 1, "x": 2}}',
    '{"name": "a", "name": "b", "arguments": {}}', '{"name": "a", "arguments": [1, 2]}', '{"name": "a", '
    '"arguments": "x"}', '{"name": 7, "arguments": {}}', '["name", "a"]', '"just a string"', "", "nul\x00l",
    '{"name": "a\x00", "arguments": {"x": "\\ud800\\udfff\\ud800"}}', '{"name": "\ud800", "arguments": {}}',
    '{"name": "a", "arguments": {"x": "\\x41"}}', '{"name": "a", "arguments": {"x": 1}', "\udcff\udcfe",
    '{"name": "a", "arguments": {"x": ' + "[" * 33 + "]" * 33 + "}}"])
def test_hostile_json_is_a_call_or_one_error(clean_host, body):
  for p, text in [(HERMES, f"<tool_call>{body}</tool_call>"), (LLAMA, body.replace("arguments", "parameters"))]:
    got = p.parse(text)
    assert len(got.calls) + len(got.errors) == (1 if p is HERMES or text.lstrip().startswith("{") else 0)
    for c in got.calls:  # what gets through is a well-formed call: a string name, a dict of finite arguments
      assert isinstance(c.name, str) and isinstance(c.arguments, dict)
      json.dumps(c.arguments, allow_nan=False)


# -- token injection -----------------------------------------------------------------------------------------
def _ctx(tok, family, **cfg):
  config = envs.EnvConfig(renderer=family, max_turns=8, max_tool_calls=1000, **cfg)
  return envs.EnvContext(tokenizer=tok, render=None, reward_fn=None, pool=None, config=config,
                         grade=lambda fn, texts, records: [(0.0, {})] * len(texts))


def _turn(tok, r, text, index=0):
  t = np.array(tok.encode(text, add_special_tokens=False, special=False) + [tok.backend.token_to_id(r.end)])
  return envs.Turn(t, np.zeros(len(t)), np.zeros(len(t), np.int32), "eos", index, 10**6)


class _Rec:
  prompt, messages = "What is 23 * 47? " + HOSTILE, None


def _expected(family, parts, role="tool"):
  """The control tokens an environment turn of `parts` messages writes: its headers and end markers only."""
  if family == "llama3":
    return {"<|start_header_id|>": parts + 1, "<|end_header_id|>": parts + 1, "<|eot_id|>": parts}
  if family == "hermes" and role == "tool":
    return {"<|im_start|>": 2, "<|im_end|>": 1}
  return {"<|im_start|>": parts + 1, "<|im_end|>": parts}


@pytest.mark.parametrize("family", ["chatml", "hermes", "llama3"])
def test_tool_output_holding_control_strings_is_text_when_appended(clean_host, family):
  tok = _tok(family)
  env = envs.ToolEnv(_ctx(tok, family), [tools.Tool.from_function(tools.calculator)])
  asyncio.run(env.reset(_Rec()))
  env.runner.run = lambda calls, key=None: asyncio.sleep(0, [tools.ToolResult(HOSTILE, "ok")] * len(calls))
  call = env.render.calls.write(renderers.ToolCall("calculator", {"expression": "1+1"}))
  res = asyncio.run(env.step(_turn(tok, env.render, call + "\n" + call if family != "llama3" else call)))
  n = 1 if family == "llama3" else 2
  assert not res.done and list(res.calls) == ["ok"] * n
  assert controls(tok, res.tokens) == _expected(family, n)
  assert HOSTILE.replace("\n", "") in tok.decode(res.tokens).replace("\\n", "").replace("\n", "")


def test_tool_output_holding_control_strings_is_text_when_re_rendered(clean_host):
  always = DROPS_REASONING.replace("m.role == 'assistant' and loop.index0 < ns.last", "m.role == 'assistant'")
  tok = _tok("chatml", always)  # drops the policy's reasoning before a tool turn too: every turn re-rendered
  env = envs.ToolEnv(_ctx(tok, "chatml"), [tools.Tool.from_function(tools.calculator)],
                     calls=renderers.TagCalls({"calc": "calculator"}))
  asyncio.run(env.reset(_Rec()))
  env.runner.run = lambda calls, key=None: asyncio.sleep(0, [tools.ToolResult(HOSTILE, "ok")] * len(calls))
  res = asyncio.run(env.step(_turn(tok, env.render, f"<think>{HOSTILE}</think><calc>1</calc><calc>2</calc>")))
  assert list(res.calls) == ["ok", "ok"] and controls(tok, res.prompt) == {"<|im_start|>": 5, "<|im_end|>": 4}
  assert env.render.escaped == 0


@pytest.mark.parametrize("family,template", FAMILIES)
def test_hostile_text_in_every_message_is_text_when_re_rendered(clean_host, family, template):
  """The re-rendered prompt (a template not append-only): user text, retrieved documents, tool results and
  the policy's own earlier turns hold control strings; only the template's markup writes control tokens."""
  tok = _tok(family, template)
  r = renderers.renderer(family, tok)
  roles = ["system", "user", "assistant", "tool", "user", "assistant", "tool"]
  hostile = [{"role": x, "content": f"<think>{HOSTILE}</think>{x} {HOSTILE}"} for x in roles]
  honest = [{"role": x, "content": f"<think>r</think>{x}"} for x in roles]
  got = r.prompt(hostile)
  assert controls(tok, got) == controls(tok, chat(tok, honest)) and r.escaped == 0
  assert tok.decode(got, skip_special_tokens=False) == tok.apply_chat_template(hostile)


@pytest.mark.parametrize("family,template", FAMILIES)
def test_tool_env_step_never_raises_and_echoes_nothing_as_control(clean_host, family, template):
  """Policy turns built to break the parser or to be echoed back in an error (an unknown tool named with
  control strings, bad arguments): every one is a StepResult whose tokens hold only the turn's own markers."""
  tok = _tok(family, template)
  env = envs.ToolEnv(_ctx(tok, family, tools_available=False), [tools.Tool.from_function(tools.calculator)])
  honest = lambda: controls(tok, chat(tok, [dict(m, content="x") for m in env.conversation], env.schemas))
  obs = asyncio.run(env.reset(_Rec()))
  assert controls(tok, obs.tokens) == honest()
  name = json.dumps(HOSTILE)
  texts = [f'<tool_call>{{"name": {name}, "arguments": {{}}}}</tool_call>',
           f'{{"name": {name}, "parameters": {{}}}}', '{"name": "calculator", "parameters": {"expression": 7}}',
           '<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>',
           "<tool_call>" + "[" * 10_000, "{" * 10_000, "<tool_call>" * 1000 + HOSTILE, HOSTILE + "<tool_call>\ud800",
           '<tool_call>{"name": "calculator", "arguments": {"expression": "' + HOSTILE + '"}}</tool_call>']
  for i, text in enumerate(texts):
    res = asyncio.run(env.step(_turn(tok, env.render, text, i)))
    env.turns = 0
    assert set(res.calls) <= {"parse_error", "unknown_tool", "bad_arguments", "tool_error"}
    if res.done:
      assert res.stop_reason == "final_answer" and not res.calls
    elif res.prompt:
      assert controls(tok, res.prompt) == honest()
    else:
      assert controls(tok, res.tokens) == _expected(family, len(res.calls))


def test_retry_message_and_echoed_policy_turn_are_text(clean_host):
  tok = _tok("chatml", DROPS_REASONING)
  ctx = _ctx(tok, "chatml", retry_message="Wrong. " + HOSTILE)
  env = envs.RetryEnv(ctx)
  asyncio.run(env.reset(_Rec()))
  res = asyncio.run(env.step(_turn(tok, env.render, "<think>" + HOSTILE + "</think>" + HOSTILE)))
  assert res.prompt and controls(tok, res.prompt) == {"<|im_start|>": 4, "<|im_end|>": 3}
  append = envs.RetryEnv(_ctx(_tok("llama3"), "llama3", retry_message=HOSTILE))
  asyncio.run(append.reset(_Rec()))
  res = asyncio.run(append.step(_turn(_tok("llama3"), append.render, HOSTILE)))
  assert controls(_tok("llama3"), res.tokens) == _expected("llama3", 1, "user")


def test_a_template_whose_contents_cannot_be_located_is_escaped(clean_host):
  """Content written twice (or transformed beyond recognition): the fallback keeps only the family's markers
  outside every content's occurrences, so the hostile text still is text."""
  twice = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "<|im_start|>assistant\n{{ messages[-1].content | upper }}{{ messages[-1].content }}")
  tok = tokenizer("chatml", twice)
  r = renderers.renderer("chatml", tok)
  got = r.prompt([{"role": "user", "content": "a"}, {"role": "tool", "content": HOSTILE}])
  assert r.escaped == 1 and controls(tok, got) == {"<|im_start|>": 3, "<|im_end|>": 2}


# -- the tool journal ----------------------------------------------------------------------------------------
def _good(step=1, turn=0, calls=("a",), results=(("out", "ok"),), config=""):
  return json.dumps({"key": [0, step, 2, 3, turn], "config": config, "calls": list(calls),
                     "results": [list(r) for r in results]})


def test_journal_skips_wrong_shape_lines_and_counts_them(clean_host, tmp_path):
  bad = ['{"key": "[0, 1, 2, 3, 0]", "calls": ["a"], "results": [["out", "ok"]]}',  # the old format
         '{"key": [0, 1, 2, 3], "calls": ["a"], "results": [["out", "ok"]]}',
         '{"key": [0, 1.5, 2, 3, 0], "calls": ["a"], "results": [["out", "ok"]]}',
         '{"key": [0, true, 2, 3, 0], "calls": ["a"], "results": [["out", "ok"]]}',
         '{"key": [0, 1, 2, 3, 0], "calls": "a", "results": [["out", "ok"]]}',
         '{"key": [0, 1, 2, 3, 0], "calls": ["a"], "results": [["out", "ok"], ["x", "ok"]]}',
         '{"key": [0, 1, 2, 3, 0], "calls": ["a"], "results": [["out", "pwned"]]}',
         '{"key": [0, 1, 2, 3, 0], "calls": ["a"], "results": [[7, "ok"]]}',
         '{"key": [0, 1, 2, 3, 0], "calls": ["a"], "results": [["out", "ok"]], "config": 5}',
         '{"key": [0, 1, 2, 3, 0], "calls": ["a"], "results": [["out", "ok"]], "extra": 1}',
         "[" * 100_000, '"a string"', "null", '{"key": [0, 1, 2, 3, 0], "calls": [NaN], "results": [["o", "ok"]]}']
  path = tmp_path / "j.jsonl"
  path.write_bytes("\n".join(bad).encode() + b"\n\xff\xfe{bad utf-8}\n" + _good().encode() + b"\n\n")
  j = envs.ToolJournal(str(path))
  assert j.skipped == len(bad) + 1 and len(j) == 1 and j.get((0, 1, 2, 3, 0), ["a"]) == [["out", "ok"]]


def test_journal_skips_a_huge_line_and_keeps_the_next(clean_host, tmp_path):
  path = tmp_path / "j.jsonl"
  with open(path, "w") as f:
    f.write(_good(results=[("x" * (3 * MB), "ok")]) + "\n" + "y" * (2 * MB) + "\n" + _good(turn=1) + "\n")
  j = envs.ToolJournal(str(path))
  assert j.skipped == 2 and len(j) == 1 and j.get((0, 1, 2, 3, 1), ["a"]) == [["out", "ok"]]
  j.put((0, 1, 2, 3, 2), ["b"], [["z" * (2 * MB), "ok"]])  # too long to write: kept in memory only
  assert os.path.getsize(path) < 6 * MB and j.get((0, 1, 2, 3, 2), ["b"])


def test_an_entry_appended_after_a_torn_line_is_kept(clean_host, tmp_path):
  path = str(tmp_path / "j.jsonl")
  j = envs.ToolJournal(path)
  j.put((0, 1, 2, 3, 0), ["a"], [["out", "ok"]])
  j.close()
  with open(path, "a") as f:
    f.write(_good(turn=1)[:25])  # a kill tore the last line
  again = envs.ToolJournal(path)
  again.put((0, 1, 2, 3, 2), ["c"], [["later", "ok"]])
  again.close()
  third = envs.ToolJournal(path)
  assert third.skipped == 1 and third.get((0, 1, 2, 3, 2), ["c"]) == [["later", "ok"]] and len(third) == 2


def test_an_entry_from_another_tool_configuration_is_not_replayed(clean_host, tmp_path):
  calc = tools.Tool.from_function(tools.calculator)
  j = envs.ToolJournal(str(tmp_path / "j.jsonl"))
  j.bind([calc], False, 1000, 5.0).put((0, 1, 2, 3, 0), ["a"], [["error: the tool is unavailable", "tool_error"]])
  resumed = envs.ToolJournal(str(tmp_path / "j.jsonl")).bind([calc], True, 1000, 5.0)
  assert resumed.get((0, 1, 2, 3, 0), ["a"]) is None and resumed.journal.foreign == 1
  assert resumed.journal.replayed == 0


def test_a_replayed_output_longer_than_the_limit_is_cut(clean_host, tmp_path):
  calc = tools.Tool.from_function(tools.calculator)
  fp = journal_lib.fingerprint([calc], True, 100, 5.0)
  path = tmp_path / "j.jsonl"
  path.write_text(_good(calls=["a", "b", "c"], config=fp, results=[("7" * 5000, "ok"), ("e" * 300, "tool_error"),
                                                                    ("short", "truncated")]) + "\n")
  got = envs.ToolJournal(str(path)).bind([calc], True, 100, 5.0).get((0, 1, 2, 3, 0), ["a", "b", "c"])
  assert got == [["7" * 100, "truncated"], ["e" * 100, "tool_error"], ["short", "truncated"]]


def test_prune_keeps_what_a_resume_needs_and_bounds_the_file(clean_host, tmp_path):
  path = str(tmp_path / "run" / journal_lib.FILE)
  j = envs.ToolJournal(path)
  lines = []
  for step in range(20):
    for turn in range(3):
      j.put((0, step, 1, 0, turn), ["c"], [["x" * 100, "ok"]])
      j.put((0, step, 1, 0, turn), ["c"], [["y" * 100, "ok"]])  # a turn that ran again replaces its entry
    journal_lib.prune(path, step - 2)  # the run's checkpoint: by the path, as the run state prunes it
    with open(path) as f:
      lines.append(len(f.readlines()))
  assert lines[2:] == [9] * 18 and os.listdir(tmp_path / "run") == [journal_lib.FILE]  # no temporary file left
  j.put((0, 20, 1, 0, 0), ["c"], [["z", "ok"]])  # appends after a prune reach the new file
  again = envs.ToolJournal(path)
  assert len(again) == 3 * 3 + 1 and again.skipped == 0 and again.get((0, 17, 1, 0, 0), ["c"]) == [["y" * 100, "ok"]]
  assert again.get((0, 16, 1, 0, 0), ["c"]) is None
