"""Chat-template families for multi-turn episodes: the first prompt from messages, an environment turn as
the tokens that follow the policy's end-of-turn token, and the tool-call format a sampled turn is parsed with.

    r = renderer("chatml", tokenizer, calls=TagCalls({"calc": "calculator"}))
    ids = r.prompt(messages)                  # ends with the assistant generation header
    ids += sampled_turn                       # kept verbatim (its <|im_end|> included)
    ids += r.env_turn("1081")                 # "\n<|im_start|>tool\n1081<|im_end|>\n<|im_start|>assistant\n"
    turn = r.calls.parse(text_of_sampled_turn)   # ParsedTurn(content, calls, errors)

Environment turns are built from the template's own markers and appended as tokens, so the token stream is
what the policy sampled plus what the environment said. `append_only` says whether re-rendering the
conversation with the model's template gives the same stream: a template that drops earlier turns' reasoning
(Qwen3's, before a new user turn) does not (`template_append_only` detects it), and `next_turn` then gives
the conversation re-rendered, the prompt of the episode's next row (`StepResult.prompt`).

The policy is the adversary, and tools return text it may have planted: every message's content (a tool's
output, a retrieved document, an echoed call, the policy's own earlier turns when re-rendered) is plain text,
and only the family's markers and the template's markup are control tokens (`Tokenizer.encode_chat`). The
call parsers never raise and scan in linear time, with caps on nesting, length and calls per turn.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from typing import Any, Mapping, Optional, Sequence

from absl import logging

from rlax.models import hf_tokenizer


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict
  raw: str = ""


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """A sampled turn as a message: its text, the well-formed tool calls in it, and one error per malformed call."""
  content: str
  calls: tuple[ToolCall, ...] = ()
  errors: tuple[str, ...] = ()

  @property
  def final(self) -> bool:
    """No tool call attempted: the turn is the policy's final answer."""
    return not self.calls and not self.errors


# Caps on what one sampled turn can ask of the parsers (the policy writes the text): a call's JSON nesting, a
# call's length in characters, and the calls parsed per turn (the rest are one counted error).
MAX_DEPTH, MAX_BODY, MAX_CALLS = 32, 1 << 16, 16
_JSON_TOKENS = re.compile(r'\\.|["\[\]{}]', re.S)  # what nesting depth depends on; no backtracking


def json_value(text: str, max_depth: int = MAX_DEPTH) -> tuple[Any, Optional[str]]:
  """(value, None) for JSON `text`, else (None, why): nested at most `max_depth` deep, no duplicate keys, no
  non-finite numbers, ints within Python's digit limit. Never raises."""
  depth, in_str = 0, False
  for m in _JSON_TOKENS.finditer(text):
    c = m.group()
    if c == '"':
      in_str = not in_str
    elif not in_str and c in "[{":
      depth += 1
      if depth > max_depth:
        return None, f"JSON nested deeper than {max_depth}"
    elif not in_str and c in "]}":
      depth -= 1
  try:
    return json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant, parse_float=_finite), None
  except Exception as e:  # ValueError (syntax, digit limit), RecursionError, MemoryError: all the same here
    return None, f"invalid JSON: {str(e)[:200]}"


def _unique(pairs):
  out = dict(pairs)
  if len(out) != len(pairs):
    raise ValueError("duplicate key")
  return out


def _no_constant(name):
  raise ValueError(f"{name} is not a number")


def _finite(text):
  x = float(text)
  if x - x != 0:
    raise ValueError(f"number {text[:20]} out of range")
  return x


def _scan(text: str, tags: Sequence[str]):
  """(tag, start, body start, body end, end, closed) of each `<tag>...</tag>` in order, in linear time: an
  unclosed tag's body runs to the end of the text. Each tag's next opening is searched once past each call
  (a tag not found again is never searched again)."""
  nxt, at = {t: -1 for t in tags}, 0
  while True:
    for t, p in list(nxt.items()):
      if p < at:
        nxt[t] = text.find(f"<{t}>", at)
        if nxt[t] < 0:
          del nxt[t]
    if not nxt:
      return
    p, t = min((p, t) for t, p in nxt.items())
    body = p + len(t) + 2
    close = text.find(f"</{t}>", body)
    if close < 0:
      yield t, p, body, len(text), len(text), False
      return
    at = close + len(t) + 3
    yield t, p, body, close, at, True


def _turn(text: str, found, one) -> "ParsedTurn":
  """The turn's calls from the scan `found`, each made by `one` (a ToolCall or an error string); past
  MAX_CALLS they are not parsed, only counted into one error."""
  calls, errors, extra = [], [], 0
  for f in found:
    if len(calls) + len(errors) >= MAX_CALLS:
      extra += 1
      continue
    out = one(*f)
    (calls if isinstance(out, ToolCall) else errors).append(out)
  if extra:
    errors.append(f"{extra} more tool calls ignored: at most {MAX_CALLS} a turn")
  return ParsedTurn(text, tuple(calls), tuple(errors))


class TagCalls:
  """Calls written as tags, `<calc>23*47</calc>`: each tag names a tool whose one string argument is the
  tag's text (the format to teach a model whose template has no tool block)."""

  def __init__(self, tags: Mapping[str, str], argument: str = "expression"):
    self.tags, self.argument = dict(tags), argument

  def write(self, call: ToolCall) -> str:
    tag = next(t for t, n in self.tags.items() if n == call.name)
    return f"<{tag}>{call.arguments[self.argument]}</{tag}>"

  def parse(self, text: str) -> ParsedTurn:
    """Never raises: an unclosed or oversized tag is an error."""
    def one(tag, start, body, close, end, closed):
      if not closed:
        return f"unclosed <{tag}> tag"
      if close - body > MAX_BODY:
        return f"a <{tag}> call longer than {MAX_BODY} characters"
      return ToolCall(self.tags[tag], {self.argument: text[body:close].strip()}, text[start:end])

    return _turn(text, _scan(text, list(self.tags)), one)


class JsonCalls:
  """Calls as JSON objects {"name": ..., "arguments": {...}}: inside `<tool_call>...</tool_call>` (Hermes,
  Qwen2.5), or the whole turn as one object with "parameters" (Llama 3.1's JSON tool calling: `tag=""`)."""

  def __init__(self, tag: str = "tool_call", arguments_key: str = "arguments"):
    self.tag, self.key = tag, arguments_key

  def write(self, call: ToolCall) -> str:
    body = json.dumps({"name": call.name, self.key: call.arguments})
    return f"<{self.tag}>\n{body}\n</{self.tag}>" if self.tag else body

  def _one(self, text: str, body: int, end: int):
    if end - body > MAX_BODY:
      return f"a tool call longer than {MAX_BODY} characters"
    raw = text[body:end].strip()
    obj, why = json_value(raw)
    if why:
      return f"a tool call with {why}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      return "a tool call must be an object with a string 'name'"
    args = obj.get(self.key, obj.get("arguments", {}))
    if not isinstance(args, dict):
      return f"a tool call's '{self.key}' must be an object"
    return ToolCall(obj["name"], args, raw)

  def parse(self, text: str) -> ParsedTurn:
    """Never raises: a malformed, oversized or too deeply nested call is an error."""
    if self.tag:
      return _turn(text, _scan(text, [self.tag]), lambda t, s, body, close, e, c: self._one(text, body, close))
    start = len(text) - len(text.lstrip())
    found = [(start, len(text))] if text.startswith("{", start) else []
    return _turn(text, found, lambda body, end: self._one(text, body, end))


@dataclasses.dataclass
class Renderer:
  """One template family over a tokenizer; see the module docstring. `header(role)` opens a turn, `end`
  closes one (the policy's own end token is the first token of `end`), `between` follows a closed turn;
  `append_only`: the template renders a policy turn followed by a tool turn verbatim. `escaped` counts the
  prompts whose contents could not be located in the template's text (see `_escaped`)."""
  family: str
  tokenizer: Any
  calls: Any
  header: Any
  end: str
  between: str = ""
  append_only: bool = True
  tool_role: str = "tool"
  _append_only: dict = dataclasses.field(default_factory=dict)
  escaped: int = 0

  def appends(self, role: str) -> bool:
    """Whether a `role` message ("tool" or "user") after a policy turn renders append-only."""
    if role not in self._append_only:
      self._append_only[role] = self.append_only if role == "tool" else template_append_only(self.tokenizer, role)
    return self._append_only[role]

  def next_turn(self, conversation: Sequence[dict], parts: Sequence[str], role: str = "tool", *,
                after_eos: bool = True, tools: Optional[Sequence[dict]] = None) -> dict:
    """The StepResult fields of the environment's turn: `parts` as messages of `role` ("tool": tool results)
    after `conversation` (which ends with the policy's turn): the tokens to append where the template renders
    them append-only, else the whole conversation re-rendered as the next row's prompt."""
    if self.appends(role):
      return {"tokens": self.env_turn(list(parts), self.tool_role if role == "tool" else role, after_eos)}
    return {"prompt": self.prompt(list(conversation) + [{"role": role, "content": p} for p in parts], tools)}

  def message(self, text: str) -> dict:
    """A sampled turn's text as the assistant message the template renders it from (its end marker dropped)."""
    return {"role": "assistant", "content": text[:-len(self.end)] if text.endswith(self.end) else text}

  def prompt(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> list[int]:
    """The first prompt: the tokenizer's template (with tool schemas where it takes them) and the generation
    header, or the family's markers when the tokenizer has no template. Every message's content is plain
    text, the policy's own earlier turns included: only the template's markup writes control tokens."""
    if getattr(self.tokenizer, "chat_template", None):
      return self.tokenizer.encode_chat(self._template_pieces(list(messages), tools))
    pieces = [p for m in messages for p in ((self.header(m["role"]), False), (m["content"], True),
                                            (self.end + self.between, False))]
    return self.tokenizer.encode_chat(pieces + [(self.header("assistant"), False)])

  def _template_pieces(self, messages: list[dict], tools) -> list[tuple[str, bool]]:
    """The template's text as (text, is_content) pieces. Each content is located by rendering a placeholder
    (random letters) in its place: with all of them at once when the template writes contents verbatim, else
    one message at a time (a template that cuts the reasoning out, `| tojson`, `| trim`): the text before and
    after the placeholder is the same as in the real render, what lies between is that content as written.
    A content that cannot be located so falls back to `_escaped`."""
    kw = {"tools": list(tools)} if tools else {}
    render = lambda ms: self.tokenizer.apply_chat_template(ms, add_generation_prompt=True, tokenize=False, **kw)
    text = render(messages)
    marks = {i: "".join(secrets.choice(string.ascii_letters) for _ in range(24))
             for i, m in enumerate(messages) if isinstance(m.get("content"), str) and m["content"]}
    markup = render([dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)])
    at, pieces = 0, []
    for pos, i in sorted((markup.find(ph), i) for i, ph in marks.items() if markup.count(ph) == 1):
      pieces += [(markup[at:pos], False), (messages[i]["content"], True)]
      at = pos + len(marks[i])
    pieces.append((markup[at:], False))
    if "".join(t for t, _ in pieces) == text:
      return pieces
    spans = []
    for i, ph in marks.items():
      one = render([dict(m, content=ph) if j == i else m for j, m in enumerate(messages)])
      n = one.count(ph)
      if n == 0 and one == text:
        continue  # the template does not write this content
      a, _, b = one.partition(ph)
      if n != 1 or len(a) + len(b) > len(text) or not (text.startswith(a) and text.endswith(b)):
        return self._escaped(text, messages)
      spans.append((len(a), len(text) - len(b)))
    at, pieces = 0, []
    for a, b in sorted(spans):
      if a < at:
        return self._escaped(text, messages)
      pieces += [(text[at:a], False), (text[a:b], True)]
      at = b
    pieces.append((text[at:], False))
    # the markup left writes the control tokens the template writes around placeholders, no more
    ids = lambda t: [i for _, _, i in self.tokenizer.find_controls(t)]
    if [i for t, c in pieces if not c for i in ids(t)] != ids(markup):
      return self._escaped(text, messages)
    return pieces

  def _escaped(self, text: str, messages: Sequence[dict]) -> list[tuple[str, bool]]:
    """The safe path where contents cannot be located: only the family's own markers (its headers, end and
    BOS) are control tokens, and none that lies within a content (as written, trimmed or as JSON)."""
    self.escaped += 1
    logging.log_first_n(logging.WARNING, "renderer: message contents cannot be located in the chat template's "
                        "text; only the family's markers outside them are control tokens (Renderer.escaped)", 1)
    own = self.header("assistant") + self.end + self.between + self.tokenizer.special_tokens.get("bos_token", "")
    keep = {own[s:e] for s, e, _ in self.tokenizer.find_controls(own)}
    inside = []
    for m in messages:
      c = m.get("content") if isinstance(m.get("content"), str) else ""
      for v in {c, c.strip(), json.dumps(c, ensure_ascii=False)[1:-1]}:
        at = text.find(v) if v and any(k in v for k in keep) else -1
        while at >= 0:
          inside.append((at, at + len(v)))
          at = text.find(v, at + 1)
    pieces, at = [], 0
    for s, e, _ in self.tokenizer.find_controls(text):
      if text[s:e] in keep and not any(a < e and s < b for a, b in inside):
        pieces += [(text[at:s], True), (text[s:e], False)]
        at = e
    return pieces + [(text[at:], True)]

  def env_turn(self, content, role: Optional[str] = None, after_eos: bool = True) -> list[int]:
    """Tokens appended after the policy's turn: what follows its end token in the template, the environment's
    message(s) (`content` a string or one string per tool result, rendered as the template renders that many
    messages of `role`), and the next assistant header. after_eos=False: the turn did not end with the end
    token (a stop id), so the end marker is written too. The messages are plain text, never control tokens."""
    parts = [content] if isinstance(content, str) else list(content)
    head = [(("" if after_eos else self.end) + self.between, False)]
    return self.tokenizer.encode_chat(head + self.messages(parts, role or self.tool_role) +
                                      [(self.header("assistant"), False)])

  def messages(self, parts: Sequence[str], role: str) -> list[tuple[str, bool]]:
    """Consecutive messages of one role as the template writes them (each a turn of its own here), as
    (text, is_content) pieces."""
    return [p for part in parts for p in ((self.header(role), False), (self.wrap(part, role), True),
                                          (self.end + self.between, False))]

  def wrap(self, content: str, role: str) -> str:
    return content


class _Hermes(Renderer):
  """Qwen2.5's template: tool results are one user turn of `<tool_response>` blocks."""

  def messages(self, parts: Sequence[str], role: str) -> list[tuple[str, bool]]:
    if role != self.tool_role:
      return super().messages(parts, role)
    body = [p for k, part in enumerate(parts) for p in ((("\n" if k else "") + "<tool_response>\n", False),
                                                         (part, True), ("\n</tool_response>", False))]
    return [(self.header(role), False)] + body + [(self.end + self.between, False)]


class _Llama3(Renderer):
  """Llama 3.1's template writes a tool (ipython) message's string content as JSON (`| tojson`)."""

  def wrap(self, content: str, role: str) -> str:
    return json.dumps(content, ensure_ascii=False) if role == self.tool_role else content


def template_append_only(tokenizer, next_role: str = "tool") -> bool:
  """Whether the tokenizer's template renders a conversation in which an assistant turn (with reasoning) is
  followed by a `next_role` message as the earlier prompt plus that turn verbatim; False when it drops or
  rewrites the turn. Qwen3's template keeps the reasoning of turns after the last user query, so tool turns
  are append-only there while a new user turn is not."""
  if not getattr(tokenizer, "chat_template", None):
    return True
  first = [{"role": "user", "content": "q"}]
  turn = "<think>r</think>a"
  before = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
  after = tokenizer.apply_chat_template(first + [{"role": "assistant", "content": turn},
                                                 {"role": next_role, "content": "q2"}], add_generation_prompt=True,
                                        tokenize=False)
  return after.startswith(before + turn)


def family_of(tokenizer) -> str:
  """The template family a tokenizer's chat template belongs to (chatml when it has none)."""
  t = getattr(tokenizer, "chat_template", None) or ""
  if "<|start_header_id|>" in t:
    return "llama3"
  if "<tool_call>" in t:
    return "hermes"
  return "chatml"


def renderer(family: str, tokenizer, calls=None) -> Renderer:
  """The renderer of `family` ("auto": from the tokenizer's template) with a tool-call format (default: the
  family's own: Hermes `<tool_call>` JSON for chatml/hermes, bare JSON with "parameters" for llama3)."""
  if not hasattr(tokenizer, "encode_chat"):  # a transformers tokenizer: the same files through rlax's
    tokenizer = hf_tokenizer.Tokenizer.from_transformers(tokenizer)
  if family == "auto":
    family = family_of(tokenizer)
  ok = template_append_only(tokenizer)
  if family in ("chatml", "hermes"):
    cls = _Hermes if family == "hermes" else Renderer
    return cls(family, tokenizer, calls or JsonCalls(), lambda role: f"<|im_start|>{role}\n", "<|im_end|>", "\n",
               append_only=ok, tool_role="user" if family == "hermes" else "tool")
  if family == "llama3":
    return _Llama3(family, tokenizer, calls or JsonCalls(tag="", arguments_key="parameters"),
                    lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>", append_only=ok,
                    tool_role="ipython")
  raise ValueError(f"env.renderer={family!r}: use auto, chatml, hermes or llama3")
