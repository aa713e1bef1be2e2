"""Turning a record's prompt into the text the policy sees: the tokenizer's chat template if any.

`format_prompt` accepts a transformers tokenizer (its `chat_template` is applied with
`add_generation_prompt=True`), a Jinja template string (rendered the same way HF renders it), or
None (the plain prompt, optionally with a system line).
"""

from __future__ import annotations

from typing import Any, Optional, Union


def _render(template: str, messages: list[dict[str, str]], **extra) -> str:
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
  # HF renders templates in a sandboxed environment with these options; match it.
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

  def raise_exception(msg):
    raise jinja2.TemplateError(msg)

  env.globals["raise_exception"] = raise_exception
  return env.from_string(template).render(messages=messages, add_generation_prompt=True, **extra)


def format_prompt(prompt: str, template: Union[None, str, Any] = None,
                  system: Optional[str] = None) -> str:
  """Renders one user turn (+ optional system turn) ready for generation.

  `template` is None, a Jinja chat-template string, or an object with `apply_chat_template`
  (a transformers tokenizer); a tokenizer without a `chat_template` falls back to the plain prompt.
  """
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": prompt}]
  if template is None:
    return (system + "\n\n" + prompt) if system else prompt
  if isinstance(template, str):
    return _render(template, messages)
  if hasattr(template, "apply_chat_template"):
    if not getattr(template, "chat_template", None):
      return (system + "\n\n" + prompt) if system else prompt
    return template.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  raise ValueError(f"template must be None, a template string or a tokenizer, got "
                   f"{type(template).__name__}")
