"""The tokenizer (and chat template) stored next to an HF checkpoint, without transformers.

Built on the `tokenizers` library (a core dependency) so that it behaves the
same whether or not transformers is installed. The chat template is read from
`chat_template.jinja` or `tokenizer_config.json` and rendered the way
transformers renders it (sandboxed jinja2, trim_blocks, lstrip_blocks).

Text that the policy or a tool wrote is encoded with special-token parsing off
(`encode(text, special=False)`, `encode_chat`): a tool result holding
`<|im_end|>` is those characters, never the control token.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from datetime import datetime
from typing import Any, Optional, Sequence

import tokenizers

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def _content(tok) -> Optional[str]:
  """Special tokens are saved either as strings or as serialized AddedToken dicts."""
  return tok.get("content") if isinstance(tok, dict) else tok


@dataclasses.dataclass
class Tokenizer:
  """A `tokenizers.Tokenizer` plus the special tokens and chat template of its checkpoint."""
  backend: tokenizers.Tokenizer
  special_tokens: dict[str, str]
  chat_template: Optional[str] = None
  eos_token_ids: tuple[int, ...] = ()
  _plain: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
  _controls: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> Optional[int]:
    return self.token_id("bos_token")

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every token that ends a response (the tokenizer's eos and generation_config's eos_token_id)."""
    return self.eos_token_ids

  @property
  def pad_id(self) -> int:
    """Fills positions that every mask excludes; any real id works, so fall back to eos, then 0."""
    pad = self.token_id("pad_token")
    return pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)

  @classmethod
  def from_backend(cls, backend: tokenizers.Tokenizer, *, bos: Optional[str] = None, eos: Optional[str] = None,
                   pad: Optional[str] = None, chat_template: Optional[str] = None) -> "Tokenizer":
    """Wraps a `tokenizers.Tokenizer` whose special tokens are named by their text."""
    special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)) if v is not None}
    for k, v in special.items():
      if backend.token_to_id(v) is None:
        raise ValueError(f"{k} {v!r} is not in the tokenizer's vocabulary")
    eos_ids = (backend.token_to_id(eos),) if eos is not None else ()
    return cls(backend=backend, special_tokens=special, chat_template=chat_template, eos_token_ids=eos_ids)

  @classmethod
  def from_transformers(cls, tok) -> "Tokenizer":
    """The same tokenizer from a transformers fast tokenizer (its backend, special tokens and template)."""
    special = {k: getattr(tok, k) for k in _SPECIAL if isinstance(getattr(tok, k, None), str)}
    eos = (tok.eos_token_id,) if getattr(tok, "eos_token_id", None) is not None else ()
    return cls(backend=tok.backend_tokenizer, special_tokens=special, chat_template=tok.chat_template,
               eos_token_ids=eos)

  def token_id(self, name: str) -> Optional[int]:
    """Id of a special token by role ('bos_token', 'eos_token', 'pad_token'), or None."""
    tok = self.special_tokens.get(name)
    return None if tok is None else self.backend.token_to_id(tok)

  def encode(self, text: str, add_special_tokens: bool = True, special: bool = True) -> list[int]:
    """special=False: special-token strings in `text` are plain text (HF's `split_special_tokens=True`);
    added tokens that are not special (Qwen's `<think>`) still encode as their ids."""
    if not special and self._plain is None:  # a copy with the flag set: never toggled on a shared backend
      plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
      plain.encode_special_tokens = True
      self._plain = plain
    backend = self.backend if special else self._plain
    return backend.encode(_valid(text), add_special_tokens=add_special_tokens).ids

  @property
  def controls(self) -> dict[str, int]:
    """The control tokens: added tokens marked special, by their text."""
    if self._controls is None:
      self._controls = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
    return self._controls

  def find_controls(self, text: str) -> list[tuple[int, int, int]]:
    """(start, end, id) of the control-token strings in `text`, leftmost-longest as the backend matches them."""
    hits = []
    for s, i in self.controls.items():
      at = text.find(s)
      while at >= 0:
        hits.append((at, -len(s), i))
        at = text.find(s, at + 1)
    out, end = [], 0
    for at, neg, i in sorted(hits):
      if at >= end:
        out.append((at, at - neg, i))
        end = at - neg
    return out

  def encode_chat(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """Ids of a chat text given as (text, is_content) pieces: control tokens only where the markup pieces write
    them, content always plain text. Honest content encodes exactly as the joined text does."""
    at, marks, dirty = 0, [], False
    for piece, content in pieces:
      if content:
        dirty = dirty or any(s in piece for s in self.controls)
      else:
        marks += [(s + at, e + at, i) for s, e, i in self.find_controls(piece)]
      at += len(piece)
    text = "".join(piece for piece, _ in pieces)
    if not dirty:
      ids = self.encode(text, add_special_tokens=False)
      controls = set(self.controls.values())
      if [i for i in ids if i in controls] == [i for _, _, i in marks]:
        return ids
    out, at = [], 0  # content holds a control-token string: cut at the markup's, the rest plain text
    for s, e, i in marks:
      out += self.encode(text[at:s], add_special_tokens=False, special=False) + [i]
      at = e
    return out + self.encode(text[at:], add_special_tokens=False, special=False)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          tokenize: bool = False, **kwargs):
    """Renders `messages` ([{'role', 'content'}, ...]) with the checkpoint's template.

    Returns the prompt string, or its token ids (no special tokens added: the
    template writes them) when `tokenize`.
    """
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template (tokenizer_config.json, chat_template.jinja)")
    text = _compiled(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs)
    return self.encode(text, add_special_tokens=False) if tokenize else text


def _valid(text: str) -> str:
  """`text` encodable as UTF-8: lone surrogates (from a JSON escape) become '?'."""
  try:
    text.encode("utf-8")
    return text
  except UnicodeEncodeError:
    return text.encode("utf-8", "replace").decode("utf-8")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
  """A chat template compiled once (renderers render one per message to locate contents)."""
  import jinja2.sandbox  # only needed for chat templates

  def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
      x, indent=indent, ensure_ascii=ensure_ascii)
  env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
  return env.from_string(template)


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def load_tokenizer(path: str) -> Tokenizer:
  """Tokenizer from an HF checkpoint directory (tokenizer.json, tokenizer_config.json, chat template).

  eos_token_ids collects the tokenizer's eos token and the `eos_token_id`(s) of
  generation_config.json / config.json, since chat models stop on several.
  """
  tok_file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(tok_file):
    raise FileNotFoundError(f"no tokenizer.json in {path} (only fast tokenizers are supported)")
  backend = tokenizers.Tokenizer.from_file(tok_file)
  tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
  special = {k: _content(tcfg[k]) for k in _SPECIAL if tcfg.get(k) is not None}
  template = tcfg.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
    template = {t["name"]: t["template"] for t in template}.get("default")
  jinja_file = os.path.join(path, "chat_template.jinja")
  if os.path.exists(jinja_file):
    with open(jinja_file) as f:
      template = f.read()
  eos = []
  if "eos_token" in special and backend.token_to_id(special["eos_token"]) is not None:
    eos.append(backend.token_to_id(special["eos_token"]))
  for name in ("generation_config.json", "config.json"):
    ids = _read_json(os.path.join(path, name)).get("eos_token_id")
    for i in ([] if ids is None else [ids] if isinstance(ids, int) else ids):
      if i not in eos:
        eos.append(int(i))
  return Tokenizer(backend=backend, special_tokens=special, chat_template=template, eos_token_ids=tuple(eos))
