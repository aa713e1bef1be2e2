"""The search environment in a run: the demo's tiny model searches the entities corpus for a step, and a prompt
longer than the sampler's budget is refused before anything compiles."""

import time

import pytest

from rlax.runtime import Controller
from tiny import tiny_config

SEARCH = {"env.name": "search", "env.retriever": "bm25_fuzzy", "env.corpus": "rlax.data.entities:corpus",
          "env.examples": 0, "env.max_turns": 2, "env.max_tool_calls": 1, "env.turn_tokens": 8, "env.top_k": 1,
          "env.passage_chars": 60, "data.task": "entities", "data.system_prompt": "", "data.prompt_style": "instruct",
          "reward.name": "qa_em", "data.n_eval": 8, "eval.n_samples": 2, "controller.steps": 1}


def test_a_search_run_logs_its_searches(tmp_path, monkeypatch):
  monkeypatch.setenv("RLAX_CACHE", str(tmp_path / "cache"))
  over = dict(SEARCH, **{"rollout.max_prompt_len": 512, "rollout.max_new_tokens": 96})
  ctl = Controller(tiny_config(tmp_path / "run", **over), progress=False)
  out = ctl.run()
  assert out["steps"] == 1
  (row,) = ctl.metrics.history
  for k in ("env/searches", "env/search_rate", "env/recall", "env/em", "env/f1"):
    assert 0.0 <= row[k] <= 1.0, (k, row[k])  # shares, and searches under env.max_tool_calls=1
  assert row["env/turns"] >= 1.0 and "pass1_before" in out


def test_a_prompt_longer_than_the_budget_is_refused_before_compiling(tmp_path, monkeypatch):
  monkeypatch.setenv("RLAX_CACHE", str(tmp_path / "cache"))
  t0 = time.monotonic()
  with pytest.raises(ValueError, match=r"env 'search': the first prompt of record 'entities-0-heldout-.*' has \d+ "
                                       r"tokens; rollout.max_prompt_len is 80"):
    Controller(tiny_config(tmp_path / "run", **dict(SEARCH, **{"rollout.max_prompt_len": 80})), progress=False)
  assert time.monotonic() - t0 < 60
