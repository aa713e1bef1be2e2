"""load_tokenizer against transformers' AutoTokenizer on a tiny trained BPE tokenizer with a ChatML template."""

import json

import pytest
import tokenizers
import transformers
from tokenizers import models, pre_tokenizers, decoders, trainers

from rlax.models import hf

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture
def tok_dir(tmp_path):
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  corpus = ["the cat sat on the mat", "what is two plus two? four.", "solve 12 + 30 = 42"] * 20
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp_path / "tokenizer.json"))
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    eos = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
           "rstrip": False, "single_word": False, "special": True}  # the serialized-AddedToken form
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": eos,
               "pad_token": "<|endoftext|>"}, f)
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"eos_token_id": [0, 2]}, f)
  return tmp_path


def test_matches_transformers(tok_dir):
  ours = hf.load_tokenizer(str(tok_dir))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
  for text in ["the cat sat", "what is 12 + 30?", "<|im_start|>user\nhi<|im_end|>"]:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two?"}]
  prompt = ours.apply_chat_template(messages)
  assert prompt == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert prompt == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\ntwo plus two?<|im_end|>\n"
                    "<|im_start|>assistant\n")
  ids = ours.apply_chat_template(messages, tokenize=True)
  assert ids[0] == ours.backend.token_to_id("<|im_start|>")
  assert ours.decode(ids, skip_special_tokens=False) == prompt


def test_special_tokens_and_eos_ids(tok_dir):
  tok = hf.load_tokenizer(str(tok_dir))
  assert tok.token_id("eos_token") == 2 and tok.token_id("pad_token") == 0 and tok.token_id("bos_token") is None
  assert tok.eos_token_ids == (2, 0)  # tokenizer's eos first, then config.json's, deduplicated
  assert tok.vocab_size == tok.backend.get_vocab_size()


def test_template_file_wins_and_missing_template_is_clear(tok_dir):
  (tok_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
  assert hf.load_tokenizer(str(tok_dir)).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
  (tok_dir / "chat_template.jinja").unlink()
  (tok_dir / "tokenizer_config.json").write_text("{}")
  with pytest.raises(ValueError, match="no chat template"):
    hf.load_tokenizer(str(tok_dir)).apply_chat_template([{"role": "user", "content": "x"}])
  (tok_dir / "tokenizer.json").unlink()
  with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
    hf.load_tokenizer(str(tok_dir))
