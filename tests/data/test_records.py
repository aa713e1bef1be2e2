"""User data files: the documented schema (prompt or messages), one error line per bad row, prompt rendering."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness import hf_models
from rlax.data import records as R
from rlax.data.prompts import PromptRenderer
from rlax.data.tokenizer import demo_tokenizer
from rlax.models import hf


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_jsonl_schema_prompt_or_messages_and_default_ids(tmp_path):
  msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two?"}]
  path = _write(tmp_path / "d.jsonl", [{"prompt": "what is 2+2?", "answer": 4, "source": "gsm"},
                                       {"messages": msgs, "answer": "4"}])
  a, b = R.read_records(path)
  assert (a.id, a.prompt, a.answer, a.source, a.messages) == (f"{path}:1", "what is 2+2?", "4", "gsm", None)
  assert b.id == f"{path}:2" and b.prompt == "two plus two?" and b.messages == tuple(msgs)
  back = tmp_path / "back.jsonl"
  R.write_jsonl([a, b], str(back))
  assert R.read_records(str(back)) == [a, b]
  assert "messages" not in json.loads(back.read_text().splitlines()[0])


@pytest.mark.parametrize("line,match", [
    ('{"prompt": 3, "answer": "1"}', "prompt must be a string"),
    ('{"messages": [{"role": "user"}], "answer": "1"}', "messages must be"),
    ('[1, 2]', "expected a JSON object"),
    ('{"prompt": "p", "answer": ', "not JSON"),
])
def test_a_bad_row_is_one_error_naming_file_and_line(tmp_path, line, match):
  path = _write(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}])
  with open(path, "a") as f:
    f.write(line + "\n")
  with pytest.raises(ValueError, match=rf"d.jsonl:2: bad record: .*{match}") as e:
    R.read_records(path)
  assert "\n" not in str(e.value)


def test_parquet_rows_and_bad_row(tmp_path):
  path = str(tmp_path / "d.parquet")
  pq.write_table(pa.Table.from_pylist([{"id": "x", "prompt": "p", "answer": "1", "source": "a"},
                                       {"id": "y", "prompt": "q", "answer": "2", "source": "b"}]), path)
  assert [(r.id, r.answer, r.source) for r in R.read_records(path)] == [("x", "1", "a"), ("y", "2", "b")]
  pq.write_table(pa.Table.from_pylist([{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": None}]), path)
  assert [r.answer for r in R.read_records(path)] == ["1", None]  # a reward that needs one refuses it
  pq.write_table(pa.Table.from_pylist([{"prompt": "p", "metadata": None}, {"prompt": "q", "metadata": "{"}]), path)
  with pytest.raises(ValueError, match=r"d.parquet:row 1: bad record: metadata is a string, not a JSON object"):
    R.read_records(path)
  with pytest.raises(ValueError, match="cannot read as Parquet"):
    R.read_records(str(tmp_path / "missing.parquet"))


def test_renderer_chat_template_system_prompt_instruction_and_length_filter(tmp_path):
  hf_models.qwen_tokenizer(tmp_path)
  tok = hf.load_tokenizer(str(tmp_path))
  r = R.Record(id="1", prompt="hi", answer="x")
  render = PromptRenderer(tok, system_prompt="be brief", instruction="{prompt}\nthe cat")
  text = render.text(r)
  assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi\nthe cat<|im_end|>\n"
                  "<|im_start|>assistant\n")
  assert render.encode(r) == tok.encode(text, add_special_tokens=False)
  own = R.Record(id="2", prompt="", answer="x", messages=({"role": "system", "content": "S"},
                                                          {"role": "user", "content": "U"}))
  assert render.text(own).startswith("<|im_start|>system\nS<|im_end|>")  # its own system turn is kept
  long = R.Record(id="3", prompt="the cat sat on the mat " * 20, answer="x")
  kept, dropped = render.fitting([r, long], max_len=len(render.encode(r)))
  assert kept == [r] and dropped == 1


def test_plain_renderer_and_bad_settings():
  tok = demo_tokenizer()
  r = R.Record(id="1", prompt="12+3=", answer="15")
  assert PromptRenderer(tok).encode(r) == [tok.bos_id] + tok.encode("12+3=", add_special_tokens=False)
  assert PromptRenderer(tok, system_prompt="S").text(r) == "S\n\n12+3="
  with pytest.raises(ValueError, match="no chat template"):
    PromptRenderer(tok, template="chat")
  with pytest.raises(ValueError, match="must contain"):
    PromptRenderer(tok, instruction="no placeholder")
  with pytest.raises(ValueError, match="brings chat messages"):
    PromptRenderer(tok).text(R.Record(id="m", prompt="", answer="1", messages=({"role": "user", "content": "u"},)))


@pytest.mark.parametrize("tests", ["assert f(1)==2", ["assert f(1)==2", 3]])
def test_tests_must_be_a_list_of_statements(tests):
  with pytest.raises(ValueError, match="Record 1: tests must be a list of Python statements"):
    R.Record.from_dict({"id": "1", "prompt": "p", "tests": tests})
  assert R.Record.from_dict({"id": "1", "prompt": "p", "tests": ["assert f(1)==2"]}).tests == (
      "assert f(1)==2",)


def test_non_utf8_bytes_name_file_and_line(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
  with pytest.raises(ValueError, match=r"d.jsonl:2: bad record: not UTF-8 text \(invalid continuation "
                     r"byte at byte 15 of the line\)"):
    R.read_records(str(path))


def test_write_records_by_suffix_and_bad_paths(tmp_path):
  recs = [R.Record(id="a", prompt="p", answer="1", metadata={"k": [1, 2]}),
          R.Record(id="b", prompt="q", tests=("assert 1",), messages=({"role": "user", "content": "q"},))]
  for name in ("x.parquet", "x.jsonl"):
    assert R.write_records(recs, str(tmp_path / name)) == 2
    assert R.read_records(str(tmp_path / name)) == recs
  assert (tmp_path / "x.parquet").read_bytes()[:4] == b"PAR1"
  (tmp_path / "file").write_text("")
  for path, match in ((tmp_path, "it is a directory"), (tmp_path / "x.txt", "expected .jsonl or .parquet"),
                      (tmp_path / "file" / "x.jsonl", r"cannot create directory .*file \(File exists\)")):
    with pytest.raises(ValueError, match=match):
      R.write_records(recs, str(path))
