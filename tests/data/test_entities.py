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


def test_the_task_draws_training_and_held_out_records_from_their_own_facts():
  from rlax.data import synthetic
  train = synthetic.generate("entities", 200, seed=1, split="train")
  held = synthetic.generate("entities", 64, seed=2, split="eval", options='{"two_hop_share": 1.0}')
  assert {r.metadata["split"] for r in train} == {"train"} and {r.metadata["split"] for r in held} == {"heldout"}
  assert {r.source for r in held} == {"2-hop"} and {r.source for r in train} == {"1-hop", "2-hop"}
  asked = lambda rs: {(r.prompt, r.answer) for r in rs}
  assert not asked(train) & asked(held)
  with pytest.raises(ValueError, match="task 'entities' has no option 'world'.*two_hop_share"):
    synthetic.generate("entities", 4, options='{"world": 3}')
  with pytest.raises(ValueError, match="task 'arithmetic' has no option 'x'"):
    synthetic.generate("arithmetic", 4, options='{"x": 1}')


def test_the_corpus_is_the_worlds_passages_and_bm25_finds_each_questions_support(tmp_path, monkeypatch):
  from rlax.envs import retrieval
  monkeypatch.setenv("RLAX_CACHE", str(tmp_path))
  bm25 = retrieval.make_retriever("bm25", "rlax.data.entities:corpus")
  assert bm25.built and bm25.index_dir.startswith(str(tmp_path / "bm25" / "rlax.data.entities.corpus-"))
  assert not retrieval.make_retriever("bm25", "rlax.data.entities:corpus").built  # loaded the second time
  qs = E.questions(E.World(0), "heldout", 64, seed=0, two_hop_share=0.0)
  subjects = [r.prompt.split(" of ")[-1].split(" was ")[-1].removeprefix("the ").rstrip("?").removesuffix(" born")
              .removesuffix(" founded") for r in qs]
  hits = bm25.search(subjects, 3)
  found = sum(r.metadata["support_ids"][0] in {p.id for p in h} for r, h in zip(qs, hits))
  assert found >= 0.9 * len(qs), found  # a query of the entity's name finds its passage


def test_a_two_hop_questions_both_facts_are_of_its_split():
  w = E.World(0)
  for split in E.SPLITS:
    for r in E.questions(w, split, 200, seed=4, two_hop_share=1.0):
      s = r.prompt  # the subject's first fact is (subject, relation 1): its split is the question's
      subject = next(name for name in [*w.people, *w.orgs] if name in s)
      assert E.split_of(subject, r.metadata["relations"][0]) == split
