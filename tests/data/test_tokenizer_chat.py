"""Demo tokenizer round trip and chat-template rendering."""

import pytest
import transformers

from rlax.data import chat
from rlax.data import tokenizer as T

_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_demo_tokenizer_round_trip_and_special_ids():
  tok = T.load_demo_tokenizer()
  assert 64 <= tok.get_vocab_size() <= 128
  assert [tok.token_to_id(s) for s in T.SPECIALS[:3]] == [0, 1, 2]
  text = "What is 12 * 7 - 3?\n<answer>81</answer> (ok, done!)"
  ids = T.encode(tok, text, add_bos=True, add_eos=True)
  assert ids[0] == T.BOS_ID and ids[-1] == T.EOS_ID and len(ids) == len(text) + 2
  assert T.decode(tok, ids) == text
  assert T.encode(tok, "é", add_bos=False) == [T.UNK_ID]


def test_shipped_asset_matches_builder():
  assert T.load_demo_tokenizer().get_vocab() == T.build_demo_tokenizer().get_vocab()


def test_format_prompt_plain_string_template_and_tokenizer():
  assert chat.format_prompt("2+2?") == "2+2?"
  assert chat.format_prompt("2+2?", system="Be brief.") == "Be brief.\n\n2+2?"
  assert chat.format_prompt("2+2?", _TEMPLATE) == "<|user|>2+2?\n<|assistant|>"
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=T.load_demo_tokenizer())
  assert chat.format_prompt("2+2?", hf) == "2+2?"  # no template: plain prompt
  hf.chat_template = _TEMPLATE
  assert chat.format_prompt("2+2?", hf, system="S") == "<|system|>S\n<|user|>2+2?\n<|assistant|>"
  with pytest.raises(ValueError, match="template must be"):
    chat.format_prompt("x", 3)
