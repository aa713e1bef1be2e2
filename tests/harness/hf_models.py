"""Tiny Hugging Face model directories for tests: random Llama / Qwen2 models with odd sizes and real
tokenizers built with `tokenizers` (Llama style and Qwen2 style, with a chat template)."""

import json

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

TOL = 1e-4  # relative to the largest logit, f32

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen2's pre-tokenizer split.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
CORPUS = ["the cat sat on the mat", "what is two plus two?\nfour.", "solve twelve plus thirty", "hi\n"] * 20


def write_json(path, obj):
  with open(path, "w") as f:
    json.dump(obj, f)


def llama_tokenizer(d):
  """Llama style: Metaspace BPE, bos prepended by the post-processor, one eos, no pad, no generation_config."""
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=50, special_tokens=["<unk>", "<s>", "</s>"]))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.save(str(d / "tokenizer.json"))
  write_json(d / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                            "eos_token": "</s>", "unk_token": "<unk>"})
  return {"bos": 1, "eos": 2, "pad": 2, "gen": {}}


def qwen_tokenizer(d):
  """Qwen2 style (what transformers' Qwen2Tokenizer rebuilds): byte-level BPE behind Qwen's split regex, no bos,
  ChatML template file, eos <|im_end|>, generation_config.json with two eos ids and sampling defaults."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=60, special_tokens=special))
  tok.save(str(d / "tokenizer.json"))
  write_json(d / "tokenizer_config.json", {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
                                            "pad_token": "<|endoftext|>", "bos_token": None})
  (d / "chat_template.jinja").write_text(CHATML)
  gen = {"bos_token_id": 0, "eos_token_id": [2, 0], "temperature": 0.7, "top_p": 0.8}
  write_json(d / "generation_config.json", gen)
  return {"bos": 0, "eos": [2, 0], "pad": 0, "gen": gen}


def hf_model(arch: str, tie: bool, seed: int = 0):
  """A random HF causal LM with odd sizes and O(1) logits (weights ~N(0, 0.15²), norms 1±0.2)."""
  kw = dict(vocab_size=67, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=tie, attn_implementation="eager")
  config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[arch]
  if arch == "mixtral":
    kw.update(num_local_experts=4, num_experts_per_tok=2)
  torch.manual_seed(seed)
  model = model_cls(config_cls(**kw)).to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
  return model


def logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def assert_close(ours, ref):
  ours, ref = np.asarray(ours), np.asarray(ref)
  assert ours.shape == ref.shape
  assert np.abs(ours - ref).max() <= TOL * np.abs(ref).max(), np.abs(ours - ref).max()


def reload(out):
  return transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").float().eval()


def make_dir(path, arch: str, tie: bool, seed: int = 0) -> dict:
  """A random HF model of `arch` with its tokenizer in `path`; returns the tokenizer's expected ids."""
  model = hf_model(arch, tie, seed)
  model.save_pretrained(path)
  return (llama_tokenizer if arch in ("llama", "mixtral") else qwen_tokenizer)(path)
