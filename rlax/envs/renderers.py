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
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Optional, Sequence


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


class TagCalls:
  """Calls written as tags, `<calc>23*47</calc>`: each tag names a tool whose one string argument is the
  tag's text (the format to teach a model whose template has no tool block)."""

  def __init__(self, tags: Mapping[str, str], argument: str = "expression"):
    self.tags, self.argument = dict(tags), argument
    self._re = re.compile(r"<(%s)>(.*?)(</\1>|$)" % "|".join(map(re.escape, self.tags)), re.S)

  def write(self, call: ToolCall) -> str:
    tag = next(t for t, n in self.tags.items() if n == call.name)
    return f"<{tag}>{call.arguments[self.argument]}</{tag}>"

  def parse(self, text: str) -> ParsedTurn:
    calls, errors = [], []
    for m in self._re.finditer(text):
      if not m.group(3):
        errors.append(f"unclosed <{m.group(1)}> tag")
      else:
        calls.append(ToolCall(self.tags[m.group(1)], {self.argument: m.group(2).strip()}, m.group(0)))
    return ParsedTurn(text, tuple(calls), tuple(errors))


class JsonCalls:
  """Calls as JSON objects {"name": ..., "arguments": {...}}: inside `<tool_call>...</tool_call>` (Hermes,
  Qwen2.5), or the whole turn as one object with "parameters" (Llama 3.1's JSON tool calling: `tag=""`)."""

  def __init__(self, tag: str = "tool_call", arguments_key: str = "arguments"):
    self.tag, self.key = tag, arguments_key

  def write(self, call: ToolCall) -> str:
    body = json.dumps({"name": call.name, self.key: call.arguments})
    return f"<{self.tag}>\n{body}\n</{self.tag}>" if self.tag else body

  def _one(self, body: str):
    try:
      obj = json.loads(body)
    except json.JSONDecodeError as e:
      return f"invalid JSON in a tool call: {e}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      return "a tool call must be an object with a string 'name'"
    args = obj.get(self.key, obj.get("arguments", {}))
    if not isinstance(args, dict):
      return f"a tool call's '{self.key}' must be an object"
    return ToolCall(obj["name"], args, body)

  def parse(self, text: str) -> ParsedTurn:
    if self.tag:
      bodies = re.findall(r"<%s>(.*?)(?:</%s>|$)" % (self.tag, self.tag), text, re.S)
    else:
      stripped = text.strip()
      bodies = [stripped] if stripped.startswith("{") else []
    calls, errors = [], []
    for body in bodies:
      out = self._one(body.strip())
      (calls if isinstance(out, ToolCall) else errors).append(out)
    return ParsedTurn(text, tuple(calls), tuple(errors))


@dataclasses.dataclass
class Renderer:
  """One template family over a tokenizer; see the module docstring. `header(role)` opens a turn, `end`
  closes one (the policy's own end token is the first token of `end`), `between` follows a closed turn;
  `append_only`: the template renders a policy turn followed by a tool turn verbatim."""
  family: str
  tokenizer: Any
  calls: Any
  header: Any
  end: str
  between: str = ""
  append_only: bool = True
  tool_role: str = "tool"
  _append_only: dict = dataclasses.field(default_factory=dict)

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
    header, or the family's markers when the tokenizer has no template."""
    if getattr(self.tokenizer, "chat_template", None):
      kw = {"tools": list(tools)} if tools else {}
      return list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                     **kw))
    text = "".join(self.header(m["role"]) + m["content"] + self.end + self.between for m in messages)
    return self.tokenizer.encode(text + self.header("assistant"), add_special_tokens=False)

  def env_turn(self, content, role: Optional[str] = None, after_eos: bool = True) -> list[int]:
    """Tokens appended after the policy's turn: what follows its end token in the template, the environment's
    message(s) (`content` a string or one string per tool result, rendered as the template renders that many
    messages of `role`), and the next assistant header. after_eos=False: the turn did not end with the end
    token (a stop id), so the end marker is written too."""
    parts = [content] if isinstance(content, str) else list(content)
    text = ("" if after_eos else self.end) + self.between + self.messages(parts, role or self.tool_role)
    return self.tokenizer.encode(text + self.header("assistant"), add_special_tokens=False)

  def messages(self, parts: Sequence[str], role: str) -> str:
    """Consecutive messages of one role as the template writes them (each a turn of its own here)."""
    return "".join(self.header(role) + self.wrap(p, role) + self.end + self.between for p in parts)

  def wrap(self, content: str, role: str) -> str:
    return content


class _Hermes(Renderer):
  """Qwen2.5's template: tool results are one user turn of `<tool_response>` blocks."""

  def messages(self, parts: Sequence[str], role: str) -> str:
    if role != self.tool_role:
      return super().messages(parts, role)
    body = "\n".join(f"<tool_response>\n{p}\n</tool_response>" for p in parts)
    return self.header(role) + body + self.end + self.between


class _Llama3(Renderer):
  """Llama 3.1's template writes a tool (ipython) message's string content as JSON (`| tojson`)."""

  def wrap(self, content: str, role: str) -> str:
    return json.dumps(content) if role == self.tool_role else content


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
