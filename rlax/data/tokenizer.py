"""A small character-level tokenizer for demos and tests, built with the `tokenizers` library.

Ids: pad=0, bos=1, eos=2, unk=3, then one id per character (digits, arithmetic operators, space,
newline, letters, common punctuation) — 100 tokens, small enough for tiny models to learn the
arithmetic task. It ships as `rlax/data/assets/demo_tokenizer.json`; `python -m
rlax.data.tokenizer` rebuilds the asset. Characters outside the alphabet encode to unk.
"""

from __future__ import annotations

import os
import string

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from rlax.models.hf_tokenizer import Tokenizer

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
ALPHABET = (string.digits + "+-*/=" + " \n" + string.ascii_lowercase + string.ascii_uppercase
            + ".,?!:;()[]<>'\"_{}\\^%#&|~@$`")
ASSET_PATH = os.path.join(os.path.dirname(__file__), "assets", "demo_tokenizer.json")


def build_demo_tokenizer() -> tokenizers.Tokenizer:
  """Builds the character-level tokenizer from `ALPHABET` (deterministic ids)."""
  vocab = {tok: i for i, tok in enumerate(SPECIALS)}
  for ch in ALPHABET:
    vocab.setdefault(ch, len(vocab))
  tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
  # Every character is its own pre-token, whitespace included, so decode(encode(s)) == s.
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIALS))
  return tok


def load_demo_tokenizer() -> tokenizers.Tokenizer:
  """Loads the shipped asset (falls back to building it if the asset is missing)."""
  if os.path.exists(ASSET_PATH):
    return tokenizers.Tokenizer.from_file(ASSET_PATH)
  return build_demo_tokenizer()


def demo_tokenizer() -> Tokenizer:
  """The demo tokenizer as the runtime uses it: BOS prepended by `encode`, EOS ends a response."""
  backend = load_demo_tokenizer()
  backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS_ID)])
  return Tokenizer.from_backend(backend, bos="<bos>", eos="<eos>", pad="<pad>")


def encode(tok: tokenizers.Tokenizer, text: str, add_bos: bool = True,
           add_eos: bool = False) -> list[int]:
  """Token ids of `text`, optionally framed by bos/eos."""
  ids = tok.encode(text, add_special_tokens=False).ids
  return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])


def decode(tok: tokenizers.Tokenizer, ids) -> str:
  """Text of `ids`, special tokens dropped."""
  return tok.decode([int(i) for i in ids], skip_special_tokens=True)


if __name__ == "__main__":
  os.makedirs(os.path.dirname(ASSET_PATH), exist_ok=True)
  build_demo_tokenizer().save(ASSET_PATH)
  print(ASSET_PATH, build_demo_tokenizer().get_vocab_size())
