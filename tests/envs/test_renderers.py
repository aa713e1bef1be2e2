"""Renderers: the first prompt plus the sampled turn plus `env_turn` is, token for token, what the model's own
chat template renders for the conversation with the tool results as messages (ChatML as SmolLM2 writes it,
Qwen2.5's Hermes `<tool_response>` user turns, Llama 3.1's ipython turns); append-only detection."""

import pytest

from rlax.envs import renderers

from chat_tokenizers import DROPS_REASONING, HOSTILE, PLAIN_ADDED, chat, controls, ids, tokenizer

SYSTEM = [{"role": "system", "content": "You can use a calculator."}, {"role": "user", "content": "What is 23 * 47?"}]


@pytest.mark.parametrize("family", ["chatml", "hermes", "llama3"])
@pytest.mark.parametrize("results", [["1081"], ["1081", "error: unknown tool 'x'"]])
def test_prompt_turn_and_env_turn_equal_the_template(family, results):
  tok = tokenizer(family)
  r = renderers.renderer("auto", tok)
  assert r.family == family and r.append_only
  schemas = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
  tools = schemas if family == "hermes" else None
  prompt = r.prompt(SYSTEM, tools)
  assert prompt == chat(tok, SYSTEM, tools)
  reply = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
  sampled = ids(tok, reply) + [tok.backend.token_to_id(r.end)]  # the policy's turn, its end token included
  stream = prompt + sampled + r.env_turn(results if len(results) > 1 else results[0])
  convo = SYSTEM + [{"role": "assistant", "content": reply}] + [{"role": "tool", "content": x} for x in results]
  assert stream == chat(tok, convo, tools)
  # and the next turn goes on the same way
  final = ids(tok, "The answer is 1081.") + [tok.backend.token_to_id(r.end)]
  more = stream + final + r.env_turn("ok")
  convo += [{"role": "assistant", "content": "The answer is 1081."}, {"role": "tool", "content": "ok"}]
  assert more == chat(tok, convo, tools)


def test_a_turn_stopped_without_its_end_token_gets_the_end_marker():
  tok = tokenizer("chatml")
  r = renderers.renderer("chatml", tok)
  stream = r.prompt(SYSTEM) + ids(tok, "<calc>23*47</calc>") + r.env_turn("1081", after_eos=False)
  convo = SYSTEM + [{"role": "assistant", "content": "<calc>23*47</calc>"}, {"role": "tool", "content": "1081"}]
  assert stream == chat(tok, convo)


def test_append_only_detection():
  assert renderers.template_append_only(tokenizer("chatml"))
  qwen3 = tokenizer("chatml", DROPS_REASONING)
  assert renderers.template_append_only(qwen3)  # tool turns keep the reasoning before them
  assert not renderers.template_append_only(qwen3, next_role="user")  # a new user query drops it
  assert renderers.family_of(tokenizer("llama3")) == "llama3"
  with pytest.raises(ValueError, match="env.renderer='gemma'"):
    renderers.renderer("gemma", tokenizer("chatml"))


@pytest.mark.parametrize("family,template", [("chatml", None), ("hermes", None), ("llama3", None),
                                             ("chatml", DROPS_REASONING)])
def test_re_rendered_prompt_equals_the_template_for_any_honest_content(family, template):
  """Contents the template transforms (Llama's `| tojson` escapes quotes and newlines; Qwen3's drops the
  reasoning of turns before the last query) are located one message at a time, and tokenize as before."""
  tok = tokenizer(family, template)
  r = renderers.renderer(family, tok)
  for c in ['He said "hi"\n\tthere ', "  padded  ", "émoji 🎉 \\ back", "<think>a</think>b"]:
    roles = ["tool", "user", "assistant", "tool"]
    convo = SYSTEM + [{"role": "assistant", "content": "<think>r</think>" + c}] + [{"role": x, "content": c}
                                                                                  for x in roles]
    assert r.prompt(convo) == chat(tok, convo), c
  assert r.escaped == 0


def test_content_encodes_as_transformers_split_special_tokens():
  """Special tokens in content are text; added tokens that are not special (Qwen's <think>) keep their ids,
  as in transformers with split_special_tokens=True."""
  tok = tokenizer("chatml", added=PLAIN_ADDED)
  text = "a<think>b</think>" + HOSTILE
  want = tok.ref(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
  assert tok.encode(text, add_special_tokens=False, special=False) == want
  assert tok.encode(text, add_special_tokens=False) == tok.ref(text, add_special_tokens=False)["input_ids"]
  turn = renderers.renderer("chatml", tok).env_turn(text)
  assert tok.backend.token_to_id("<think>") in turn and controls(tok, turn) == {"<|im_start|>": 2, "<|im_end|>": 1}


def test_a_transformers_tokenizer_renders_the_same():
  tok = tokenizer("llama3")
  mine, theirs = renderers.renderer("auto", tok), renderers.renderer("auto", tok.ref)
  convo = SYSTEM + [{"role": "assistant", "content": "{}"}, {"role": "tool", "content": HOSTILE}]
  assert theirs.prompt(convo) == mine.prompt(convo) and theirs.env_turn(HOSTILE) == mine.env_turn(HOSTILE)


def test_a_template_writing_a_content_twice_is_escaped():
  """A content that cannot be located exactly once: only the family's markers outside contents are control
  tokens (counted in Renderer.escaped)."""
  twice = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
          "<|im_start|>assistant\n{{ messages[-1].content }}"
  tok = tokenizer("chatml", twice)
  r = renderers.renderer("chatml", tok)
  convo = [{"role": "user", "content": "q " + HOSTILE}]
  got = r.prompt(convo)
  assert r.escaped == 1 and controls(tok, got) == {"<|im_start|>": 2, "<|im_end|>": 1}
  assert tok.decode(got, skip_special_tokens=False) == tok.apply_chat_template(convo)
  honest = [{"role": "user", "content": "q"}]
  assert r.prompt(honest) == chat(tok, honest)

