"""The trainer/sampler handshake (rlax.runtime.roles) and the prompt budget rule (builders.train_and_eval_records),
without running a controller."""

import json

import pytest

from rlax import builders
from rlax import config as config_lib
from rlax.data.records import Record
from rlax.runtime.roles import End, Handshake, Start
from tiny import tiny_config


class _Store:
  """A Channel's JSON surface over a dict (every value crosses as JSON text, as over the coordination service)."""

  def __init__(self):
    self.kv = {}

  def set_json(self, key, value):
    assert key not in self.kv, f"{key} written twice"  # each key is written once per job attempt
    self.kv[key] = json.dumps(value)

  def get_json(self, key):
    return json.loads(self.kv[key])


def test_handshake_round_trips_typed_messages():
  store = _Store()
  trainer, sampler = Handshake(store), Handshake(store)
  trainer.send_start(Start(step=3, first=5, data={"epoch": 1, "pos": [2, 7]}, evaluate=False))
  trainer.send_end(End(evaluate=True))
  sampler.send_eval("before", {"pass@1": 0.25})
  assert sampler.recv_start() == Start(step=3, first=5, data={"epoch": 1, "pos": [2, 7]}, evaluate=False)
  assert sampler.recv_end() == End(evaluate=True)
  assert trainer.recv_eval("before") == {"pass@1": 0.25}
  assert sorted(store.kv) == ["end", "eval/before", "start"]
  assert json.loads(store.kv["start"]) == {"step": 3, "first": 5, "data": {"epoch": 1, "pos": [2, 7]},
                                           "evaluate": False}


def test_handshake_without_a_channel_sends_nothing():
  one = Handshake(None)  # one process holds both roles
  one.send_start(Start(step=0, first=0, data=None, evaluate=True))
  one.send_end(End(evaluate=False))
  one.send_eval("after", {})


def _run(tmp_path, max_prompt_len):
  run = config_lib.load(tiny_config(tmp_path, **{"rollout.max_prompt_len": max_prompt_len}))
  return run, builders.renderer(run, builders.checked_tokenizer(run))


def test_prompts_over_the_budget_are_dropped_from_given_records(tmp_path):
  run, render = _run(tmp_path, 8)
  short = [Record(id=str(i), prompt=str(i), answer="1") for i in range(3)]
  long = Record(id="long", prompt="1 2 3 4 5 6 7 8 9 " * 4, answer="1")
  assert len(render.encode(long)) > 8 >= max(len(render.encode(r)) for r in short)
  train, held, dropped = builders.train_and_eval_records(run, render, ([*short, long], [long, short[0]]))
  assert (train, held, dropped) == (short, [short[0]], {"train": 1, "eval": 1})
  with pytest.raises(ValueError, match="every eval prompt is longer than rollout.max_prompt_len=8"):
    builders.train_and_eval_records(run, render, (short, [long]))


def test_a_built_in_task_over_the_budget_is_an_error_naming_the_length(tmp_path):
  run, render = _run(tmp_path, 16)
  train, held, dropped = builders.train_and_eval_records(run, render)
  assert dropped == {"train": 0, "eval": 0} and (train, held) == builders.datasets(run)
  longest = max(len(render.encode(r)) for r in train + held)
  run, render = _run(tmp_path, longest - 1)
  with pytest.raises(ValueError, match=f"task 'digit_sort'.*raise it to {longest}"):
    builders.train_and_eval_records(run, render)
