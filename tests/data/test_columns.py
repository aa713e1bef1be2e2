"""Any dataset's columns: key paths map a file's fields onto the record, every other field lands in the
record's metadata and reaches a reward by import path; GSM8K's `#### 42`; JSON arrays and `datasets`
directories next to JSONL; a wrong key is one error naming the file, the row and the keys there are."""

import json
import os
import re
import sys

import pytest

from rlax import builders
from rlax import config as config_lib
from rlax import rewards
from rlax.data import records as R

GSM = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
        "answer": "In May she sold 48/2 = 24.\nIn all 48+24 = 72.\n#### 72"},
       {"question": "A farm has 1,200 hens and buys 34 more. How many hens?", "answer": "1200+34=1234\n#### 1,234"}]


def write(tmp_path, name, rows):
  path = os.path.join(tmp_path, name)
  with open(path, "w") as f:
    f.write("\n".join(json.dumps(r) for r in rows) + "\n")
  return path


def test_gsm8k_shaped_file(tmp_path):
  path = write(tmp_path, "gsm.jsonl", GSM)
  recs = R.read_records(path, R.Columns(prompt="question", answer_format="gsm8k"))
  assert [r.prompt for r in recs] == [g["question"] for g in GSM]
  assert [r.answer for r in recs] == ["72", "1234"]
  with pytest.raises(ValueError) as e:
    R.read_records(path, R.Columns(prompt="query"))
  msg = str(e.value)
  assert "gsm.jsonl:1" in msg and "data.prompt_key='query'" in msg and "['answer', 'question']" in msg


def test_wrong_answer_key_names_the_row_and_the_keys(tmp_path):
  path = write(tmp_path, "gsm.jsonl", GSM)
  with pytest.raises(ValueError, match=r"gsm\.jsonl:1: data\.answer_key='solution' is not in the row; its keys: "
                                       r"\['answer', 'question'\]"):
    R.read_records(path, R.Columns(prompt="question", answer="solution"))
  with pytest.raises(ValueError, match="needs '#### <answer>'"):
    R.read_records(write(tmp_path, "bad.jsonl", [{"question": "q", "answer": "72"}]),
                   R.Columns(prompt="question", answer_format="gsm8k"))


def test_extra_fields_are_kept_in_metadata_and_reach_a_reward(tmp_path, monkeypatch):
  rows = [{"messages": [{"role": "user", "content": "What is 3 * 4?"}], "answer": "12", "a": 3, "op": "*", "b": 4,
           "style": "terse", "metadata": {"origin": "gen"}}]
  recs = R.read_records(write(tmp_path, "extra.jsonl", rows))
  assert recs[0].metadata == {"origin": "gen", "a": 3, "op": "*", "b": 4, "style": "terse"}
  assert recs[0].prompt == "What is 3 * 4?" and recs[0].answer == "12"
  (tmp_path / "my_rewards.py").write_text(
      "def product(completion, record):\n"
      "  m = record.metadata\n"
      "  return float(completion.strip() == str(m['a'] * m['b'])), {'style': m['style']}\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  fn = rewards.build("my_rewards:product")
  assert fn("12", recs[0]) == (1.0, {"style": "terse"}) and fn("13", recs[0])[0] == 0.0
  with pytest.raises(ValueError, match="reward 'no_such_module:f': cannot import it"):
    rewards.build("no_such_module:f")
  sys.modules.pop("my_rewards", None)


def test_dotted_paths_and_json_arrays(tmp_path):
  rows = [{"data": {"q": "2+2?", "id": "x"}, "sol": {"final": 4}, "tags": ["t"]}]
  path = os.path.join(tmp_path, "nested.json")
  with open(path, "w") as f:
    json.dump(rows, f)
  (rec,) = R.read_records(path, R.Columns(prompt="data.q", answer="sol.final"))
  assert rec.prompt == "2+2?" and rec.answer == "4" and rec.metadata == {"tags": ["t"]}
  with pytest.raises(ValueError, match=r"its keys: \['data.id', 'data.q', 'sol.final', 'tags'\]"):
    R.read_records(path, R.Columns(prompt="data.question"))


def test_datasets_directories(tmp_path):
  datasets = pytest.importorskip("datasets")
  d = datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM), "test": datasets.Dataset.from_list(GSM[:1])})
  root = str(tmp_path / "gsm8k")
  d.save_to_disk(root)
  cols = R.Columns(prompt="question", answer_format="gsm8k")
  assert [r.answer for r in R.read_records(root, cols)] == ["72", "1234"]
  assert [r.answer for r in R.read_records(root + "#test", cols)] == ["72"]
  with pytest.raises(ValueError, match=r"no split 'dev'; it has \['test', 'train'\]"):
    R.read_records(root + "#dev", cols)
  with pytest.raises(ValueError, match="not a datasets directory"):
    R.read_records(str(tmp_path), cols)


def test_config_maps_columns_and_refuses_a_bad_format(tmp_path):
  path = write(tmp_path, "gsm.jsonl", GSM)
  work = str(tmp_path / "run")
  run = config_lib.load({"workdir": work, "data": {"train_files": path, "prompt_key": "question",
                                                   "answer_format": "gsm8k"}})
  assert run.data.columns() == R.Columns(prompt="question", answer_format="gsm8k")
  with pytest.raises(ValueError, match="data.answer_format='gsm'"):
    config_lib.load({"workdir": work, "data": {"answer_format": "gsm"}})


def test_a_record_needs_the_reference_its_reward_grades_against(tmp_path):
  """Open-ended prompts (no answer, no tests) load for a reward that reads none; a reward that grades against
  a reference refuses the first record without it, naming the file, the record and the field."""
  path = write(tmp_path, "open.jsonl", [{"prompt": "Write a haiku about rain."},
                                        {"prompt": "Make 24 from 3 8", "task": "countdown",
                                         "metadata": {"numbers": [3, 8], "target": 24}}])
  run = lambda name: config_lib.load({"workdir": str(tmp_path / "run"), "data": {"train_files": path},
                                      "reward": {"name": name}})
  assert [r.answer for r in builders.read_files(run("format"), [path])] == [None, None]
  for name, field in (("math", "answer"), ("code", "tests"), ("format+exact", "answer"), ("auto", "answer")):
    with pytest.raises(ValueError, match=rf"open\.jsonl:1: no `{field}`, which "
                                         rf"reward\.name='{re.escape(name)}' grades against"):
      builders.read_files(run(name), [path])
  countdown = R.read_records(path)[1]
  assert rewards.missing_reference("auto", countdown) is None  # countdown grades from its metadata
  assert rewards.missing_reference("math", countdown) == "answer"
  assert rewards.missing_reference("exact", R.Record(id="e", prompt="p", answer="")) is None  # "" is an answer
