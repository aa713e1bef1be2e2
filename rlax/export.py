"""Export a policy as a Hugging Face model directory that transformers (and vLLM) load as is.

`export_hf` writes config.json + safetensors (rlax.models.hf), the tokenizer files, the chat template and
generation_config.json. `export_checkpoint` does it for a run's checkpoint, read by
`rlax.checkpoint.load_policy` (only the params, onto one CPU device, so a live training job keeps its
accelerators), with the tokenizer the run trained with: the files of the HF directory it started from, else
the demo tokenizer.

The export is written into `<out_dir>.tmp` and renamed into place, so a crash never leaves a directory
that looks complete; an earlier export at `out_dir` is replaced.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

from rlax import checkpoint
from rlax.models import hf
from rlax.models import lora as lora_lib
from rlax.models.config import ModelConfig
from rlax.models.hf_tokenizer import Tokenizer

# Tokenizer files an HF directory may hold; transformers needs those present to load the tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model")
_DTYPES = ("float32", "bfloat16", "float16")
_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _write_json(path: str, obj: dict) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")


def _token_ids(tok: Tokenizer, base: dict) -> dict[str, Any]:
  """bos/eos/pad ids for config.json and generation_config.json.

  `base` (the source generation_config.json) wins where it names an id; every eos id of `tok` is added,
  so generation stops wherever the runtime stopped. eos is a list when there are several.
  """
  ids = {}
  bos = base.get("bos_token_id", tok.bos_id)
  if bos is not None:
    ids["bos_token_id"] = bos
  eos = base.get("eos_token_id")
  eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
  eos += [i for i in tok.eos_ids if i not in eos]
  if eos:
    ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
  pad = base.get("pad_token_id")
  ids["pad_token_id"] = tok.pad_id if pad is None else pad
  return ids


def _write_tokenizer(tok: Tokenizer, cfg: ModelConfig, out: str) -> None:
  """tokenizer.json from the backend and a tokenizer_config.json naming its special tokens and template."""
  tok.backend.save(os.path.join(out, "tokenizer.json"))
  tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens,
          "model_max_length": cfg.max_position, "clean_up_tokenization_spaces": False}
  unk = getattr(tok.backend.model, "unk_token", None)
  if unk and "unk_token" not in tcfg and tok.backend.token_to_id(unk) is not None:
    tcfg["unk_token"] = unk
  if tok.chat_template is not None:
    tcfg["chat_template"] = tok.chat_template  # the field every transformers version reads
  _write_json(os.path.join(out, "tokenizer_config.json"), tcfg)


def _check_out_dir(path: str) -> None:
  """Only an earlier export (or an empty directory) may be replaced, never some other directory."""
  if os.path.lexists(path):
    if not os.path.isdir(path) or os.path.islink(path):
      raise ValueError(f"export directory {path} exists and is not a directory")
    if os.listdir(path) and not os.path.exists(os.path.join(path, "config.json")):
      raise ValueError(f"export directory {path} exists and holds no config.json (not an earlier export); "
                       "refusing to replace it")


def export_hf(params: Any, cfg: ModelConfig, out_dir: str, *, tokenizer: Optional[Tokenizer] = None,
              tokenizer_dir: Optional[str] = None, dtype: Optional[str] = None) -> list[str]:
  """Writes `params` as an HF model directory; returns the file names written, sorted.

  The tokenizer is `tokenizer_dir`'s files (an HF directory: tokenizer.json, tokenizer_config.json,
  chat template, vocab/merges, generation_config.json), else `tokenizer`'s backend and special tokens.
  `tokenizer` (default: loaded from `tokenizer_dir`) gives the bos/eos/pad ids. `dtype` (float32,
  bfloat16, float16) is the tensors' dtype, default `cfg.param_dtype`.
  """
  if dtype is not None and dtype not in _DTYPES:
    raise ValueError(f"export dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
  if tokenizer is None and tokenizer_dir is None:
    raise ValueError("export_hf needs a tokenizer or a tokenizer_dir (an HF directory with tokenizer.json)")
  if tokenizer_dir is not None:
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
      raise ValueError(f"tokenizer_dir {tokenizer_dir}: no tokenizer.json there (an HF model directory with a "
                       "fast tokenizer is needed)")
    if tokenizer is None:
      tokenizer = hf.load_tokenizer(tokenizer_dir)
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}")
  cfg = cfg.replace(param_dtype=dtype or cfg.param_dtype)

  final = os.path.abspath(out_dir)
  _check_out_dir(final)
  tmp, old = final + ".tmp", final + ".old"
  for stale in (tmp, old):  # left by an export that crashed
    shutil.rmtree(stale, ignore_errors=True)
  os.makedirs(tmp)
  try:
    gen = {}
    if tokenizer_dir is not None:
      for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
          shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
      gen = _read_json(os.path.join(tokenizer_dir, "generation_config.json"))  # keeps its sampling defaults
    else:
      _write_tokenizer(tokenizer, cfg, tmp)
    ids = _token_ids(tokenizer, gen)
    _write_json(os.path.join(tmp, "generation_config.json"), {**gen, **ids})
    hf.save_checkpoint(params, cfg, tmp, extra_config=ids)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if os.path.exists(final):
    os.rename(final, old)
  try:
    os.rename(tmp, final)
  except BaseException:
    if os.path.exists(old) and not os.path.exists(final):
      os.rename(old, final)  # put the earlier export back
    raise
  shutil.rmtree(old, ignore_errors=True)
  return sorted(os.listdir(final))


def export_peft(adapters: Any, lora: lora_lib.LoraConfig, out_dir: str, *, base_model: str = "") -> list[str]:
  """Writes LoRA adapters as a PEFT directory (adapter_config.json, adapter_model.safetensors) that
  `peft.PeftModel.from_pretrained(base, out_dir)` loads onto the base model; returns the file names."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  final = os.path.abspath(out_dir)
  if os.path.lexists(final) and (not os.path.isdir(final) or (os.listdir(final) and not os.path.exists(
      os.path.join(final, "adapter_config.json")))):
    raise ValueError(f"export directory {final} exists and is not an earlier adapter export; refusing to replace it")
  tmp = final + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    save_file(lora_lib.to_peft(adapters), os.path.join(tmp, "adapter_model.safetensors"))
    _write_json(os.path.join(tmp, "adapter_config.json"), lora_lib.peft_config(lora, base_model))
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  shutil.rmtree(final, ignore_errors=True)
  os.rename(tmp, final)
  return sorted(os.listdir(final))


def export_checkpoint(workdir: str, out_dir: str, step: Optional[int] = None, *,
                      dtype: Optional[str] = None, lora: str = "merged") -> dict:
  """Exports a run's newest (or the given) checkpoint as an HF directory at `out_dir`.

  The model config comes from the checkpoint's meta; the tokenizer from the run's `hf_checkpoint`
  directory, else the demo tokenizer. `dtype` defaults to the run's param dtype. A LoRA run's checkpoint
  holds adapters: lora="merged" writes the base (its `hf_checkpoint`, or the seed's random init) with them
  merged, lora="adapter" a PEFT directory of the adapters alone.
  Returns {"step", "export_dir", "files"}.
  """
  if lora not in ("merged", "adapter"):
    raise ValueError(f"--lora={lora!r}: use merged or adapter")
  policy = checkpoint.load_policy(workdir, step, merge_lora=lora == "merged")
  step, hf_dir = policy.step, policy.hf_checkpoint
  if hf_dir and not os.path.isdir(hf_dir):
    raise ValueError(f"checkpoint step {step} was trained from {hf_dir}, which does not exist any more; "
                     "its tokenizer files are needed for the export")
  if lora == "adapter":
    if not policy.lora.enabled:
      raise ValueError(f"checkpoint step {step} in {workdir} holds full weights, no adapters (--lora=adapter)")
    files = export_peft(policy.params, policy.lora, out_dir, base_model=hf_dir)
  elif hf_dir:
    files = export_hf(policy.params, policy.model, out_dir, tokenizer_dir=hf_dir, dtype=dtype)
  else:
    from rlax.data.tokenizer import demo_tokenizer  # the built-in tasks' tokenizer
    files = export_hf(policy.params, policy.model, out_dir, tokenizer=demo_tokenizer(), dtype=dtype)
  return {"step": step, "export_dir": os.path.abspath(out_dir), "files": files}
