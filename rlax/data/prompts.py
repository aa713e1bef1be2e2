"""A record → the token ids the policy sees: chat template or plain text, system prompt, instruction.

    render = PromptRenderer(tokenizer, template="auto", system_prompt="", instruction="{prompt}")
    ids = render.encode(record)

`template`: "chat" renders the conversation with the tokenizer's chat template (generation prompt
added; the template writes BOS and role markers, so no special tokens are added on top); "plain"
encodes the text with the tokenizer's own special-token rule (e.g. BOS first); "auto" is "chat" when
the tokenizer has a template. The user turn is `instruction` with `{prompt}` replaced by the record's
prompt; a record that brings its own `messages` is rendered as they are (a system prompt is added
when they have none).
"""

from __future__ import annotations

from typing import Sequence

from rlax.data.records import Record
from rlax.models.hf_tokenizer import Tokenizer

TEMPLATES = ("auto", "chat", "plain")


class PromptRenderer:
  """Renders and encodes records for one tokenizer; see the module docstring."""

  def __init__(self, tokenizer: Tokenizer, template: str = "auto", system_prompt: str = "",
               instruction: str = "{prompt}"):
    if template not in TEMPLATES:
      raise ValueError(f"data.template={template!r}: use one of {', '.join(TEMPLATES)}")
    if "{prompt}" not in instruction:
      raise ValueError(f"data.instruction={instruction!r} must contain '{{prompt}}'")
    if template == "chat" and not tokenizer.chat_template:
      raise ValueError("data.template='chat' but the tokenizer has no chat template; use 'plain'")
    self.tokenizer = tokenizer
    self.chat = template == "chat" or (template == "auto" and bool(tokenizer.chat_template))
    self.system_prompt, self.instruction = system_prompt, instruction

  def messages(self, record: Record) -> list[dict]:
    msgs = [dict(m) for m in record.messages] if record.messages else [
        {"role": "user", "content": self.instruction.replace("{prompt}", record.prompt)}]
    if self.system_prompt and not any(m.get("role") == "system" for m in msgs):
      msgs.insert(0, {"role": "system", "content": self.system_prompt})
    return msgs

  def text(self, record: Record) -> str:
    """The prompt as text (chat-rendered or plain)."""
    if self.chat:
      return self.tokenizer.apply_chat_template(self.messages(record), add_generation_prompt=True)
    if record.messages:
      raise ValueError(f"record {record.id} brings chat messages but the tokenizer has no chat template "
                       "(data.template='plain'); give it a `prompt` instead")
    user = self.instruction.replace("{prompt}", record.prompt)
    return f"{self.system_prompt}\n\n{user}" if self.system_prompt else user

  def encode(self, record: Record) -> list[int]:
    return self.tokenizer.encode(self.text(record), add_special_tokens=not self.chat)

  def encode_all(self, records: Sequence[Record]) -> list[list[int]]:
    return [self.encode(r) for r in records]

  def fitting(self, records: Sequence[Record], max_len: int) -> tuple[list[Record], int]:
    """(records whose rendered prompt has at most `max_len` tokens, how many were dropped)."""
    kept = [r for r in records if len(self.encode(r)) <= max_len]
    return kept, len(records) - len(kept)


def response_ids(tokenizer: Tokenizer, text: str, eos: bool = True) -> list[int]:
  """A supervised response: its tokens (no special tokens) followed by the first stop token."""
  ids = tokenizer.encode(text, add_special_tokens=False)
  if eos and not tokenizer.eos_ids:
    raise ValueError("the tokenizer has no eos token to end a supervised response")
  return ids + ([tokenizer.eos_ids[0]] if eos else [])

