"""The fictional encyclopedia of the search task: deterministic worlds, every answer stated in its supporting
passages, held-out questions asking only facts no training question asks."""

import pytest

from rlax.data import entities as E


def test_a_world_is_its_number():
  a, b = E.World(3), E.World(3)
  assert a.passages() == b.passages() and a.passages() != E.World(4).passages()
  ids = [p["id"] for p in a.passages()]
  assert len(ids) == len(set(ids)) == 24 + 2 * 96 + 32


def test_answers_live_in_their_passages_and_splits_never_meet():
  world = E.World(0)
  text = {p["id"]: p["title"] + " " + p["text"] for p in world.passages()}
  asked = {}
  for split in E.SPLITS:
    recs = E.questions(world, split, 400, seed=1)
    assert recs == E.questions(world, split, 400, seed=1)
    assert {r.metadata["hops"] for r in recs} == {1, 2}
    for r in recs:
      assert r.task == "search_qa" and r.metadata["split"] == split
      assert r.answer in text[r.metadata["support_ids"][-1]]  # the last hop's passage states the answer
      if r.metadata["hops"] == 2:  # the first hop's answer is the second hop's subject
        assert any(w in text[r.metadata["support_ids"][0]] for w in text[r.metadata["support_ids"][1]].split()[:2])
    asked[split] = {(r.metadata["support_ids"][-1], r.metadata["relations"][-1]) for r in recs}
  assert asked["train"] and asked["heldout"] and not asked["train"] & asked["heldout"]
  with pytest.raises(ValueError, match="split='test'"):
    E.questions(world, "test", 1, seed=0)
