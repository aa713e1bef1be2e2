"""Renderers: the first prompt plus the sampled turn plus `env_turn` is, token for token, what the model's own
chat template renders for the conversation with the tool results as messages (ChatML as SmolLM2 writes it,
Qwen2.5's Hermes `<tool_response>` user turns, Llama 3.1's ipython turns); append-only detection."""

import pytest

from rlax.envs import renderers

from chat_tokenizers import DROPS_REASONING, chat, ids, tokenizer

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


