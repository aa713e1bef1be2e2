"""Several teachers chosen per record: the config, the routing rule, each row scored by its own teacher in
fixed-shape passes (as that teacher scores the whole batch), their weights in the memory estimate and their
programs in launch.plan. (A run with two teachers end to end: tests/teachers/test_distill_run.py.)"""

import collections

import numpy as np
import pytest

from configs import paper_qwq32b
from harness import hf_models
from rlax import config as config_lib
from rlax import memory
from rlax import planning
from rlax.data.records import Record
from rlax.teachers import DEFAULT, Teacher, TeacherConfig, Teachers, route
from rlax.trainer.batch import response_loss_mask, RolloutBatch


@pytest.fixture(scope="module")
def two(tmp_path_factory):
  d = tmp_path_factory.mktemp("teachers")
  for name, seed in (("a", 3), ("b", 4)):
    hf_models.make_dir(d / name, "qwen2", tie=False, seed=seed)
  return d


def _batch(rng, B=8, P=4, N=5):
  tokens = rng.integers(3, 50, size=(B, P + N)).astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  lm = response_loss_mask(mask, P)
  return RolloutBatch(tokens=tokens, input_mask=mask, loss_mask=lm, behaviour_logprobs=np.zeros_like(lm),
                      rewards=np.zeros(B, np.float32), versions=np.zeros(B, np.int32),
                      group_ids=np.arange(B, dtype=np.int32) // 2, prompt_len=P)


def test_a_record_goes_to_the_teacher_its_metadata_names_else_to_the_default():
  recs = [Record(id="1", prompt="p", metadata={"domain": "code"}), Record(id="2", prompt="p"),
          Record(id="3", prompt="p", metadata={"domain": "poetry"}), Record(id="4", prompt="p", metadata={"domain": 7})]
  assert list(route(recs, [DEFAULT, "code", "7"], "domain")) == ["code", DEFAULT, DEFAULT, "7"]


def test_the_routes_config(two, tmp_path):
  ok = TeacherConfig(hf_checkpoint=str(two / "a"), route_field="domain", routes={"code": str(two / "b")}).validate()
  assert ok.dirs() == {DEFAULT: str(two / "a"), "code": str(two / "b")} and hash(ok)  # a frozen section hashes
  for bad, match in [(dict(routes={"code": str(two / "b")}), "go together"),
                     (dict(route_field="domain"), "go together"),
                     (dict(route_field="d", routes={"default": str(two / "b")}), "'default' is the default teacher"),
                     (dict(route_field="d", routes={"code": str(tmp_path)}), "teacher.routes.code=.*no config.json"),
                     (dict(route_field="d", routes={"code": ""}), "teacher.routes.code=''.*no config.json")]:
    with pytest.raises(ValueError, match=match):
      TeacherConfig(hf_checkpoint=str(two / "a"), **bad).validate()
  from configs import base
  c = base.get_config()
  c.workdir = str(tmp_path / "run")
  c.teacher.routes = {"code": "~/nowhere"}
  with pytest.raises(ValueError, match="go together"):  # a mapping from the config file, paths made absolute
    config_lib.load(c)
  c.teacher.routes = {"code": 3}
  with pytest.raises(ValueError, match=r"teacher.routes=.*expected dict\[str, str\]"):
    config_lib.load(c)


@pytest.mark.parametrize("pass_rows", [0, 3])
def test_each_row_is_scored_by_its_own_teacher(two, pass_rows):
  """Rows 0, 3, 4 go to teacher "code" (b), the rest to the default (a): each row's scores are what its teacher
  gives it in the whole batch, in passes of 3 rows (the last filled) or of all 8; one program per teacher."""
  load = lambda d: Teacher.load(TeacherConfig(hf_checkpoint=str(d)), dtype="float32", top_k=2)
  teachers = Teachers({DEFAULT: load(two / "a"), "code": load(two / "b")}, field="domain", pass_rows=pass_rows)
  batch = _batch(np.random.default_rng(0))
  recs = [Record(id=str(i), prompt="p", metadata={"domain": "code"} if i in (0, 3, 4) else {}) for i in range(8)]
  got = teachers.scores(batch, recs)
  whole = {n: load(two / d).scores(batch) for n, d in ((DEFAULT, "a"), ("code", "b"))}
  assert set(got) == {"teacher_logprobs", "teacher_top_ids", "teacher_top_logprobs"}
  for b in range(8):
    own = whole["code" if b in (0, 3, 4) else DEFAULT]
    for k, v in got.items():
      np.testing.assert_allclose(v[b], own[k][b], atol=1e-5, err_msg=f"{k} row {b}")
  assert teachers.rows == collections.Counter({DEFAULT: 5, "code": 3})
  assert teachers.traces["teacher_logprobs"] == 2  # one program each
  teachers.scores(batch, [Record(id="x", prompt="p")] * 8)  # no row for "code": it is not called
  assert teachers.rows["code"] == 3 and teachers.traces["teacher_logprobs"] == 2
  with pytest.raises(ValueError, match="route rows by record"):
    teachers.scores(batch)


def test_the_warm_up_compiles_what_a_later_batch_first_needs(two):
  """One teacher: the packed rows of a batch whose episodes split into rows (forks), where a run's episodes may;
  the padded rows compile with the first batch. Nothing new compiles when such batches come."""
  teacher = Teacher.load(TeacherConfig(hf_checkpoint=str(two / "a")), dtype="float32")
  teachers = Teachers({DEFAULT: teacher})
  batch = _batch(np.random.default_rng(1))
  teachers.warm_up(8, batch.prompt_len, batch.tokens.shape[1] - batch.prompt_len, forks=True)
  assert teacher.traces["teacher_logprobs"] == 1
  forks = np.zeros(batch.tokens.shape, np.int32)
  forks[2, batch.prompt_len + 2] = 1
  got = teachers.scores(batch.replace(forks=forks))
  assert teacher.traces["teacher_logprobs"] == 1 and np.all(got["teacher_logprobs"][batch.loss_mask > 0] < 0)


def _distill_plan_config(two, rows_per_pass):
  c = paper_qwq32b.get_config("tiny")  # a 2-layer model on 2 slices of 4 devices
  c.algorithm.name = "distill"
  c.algorithm.overrides = dict(forward_kl_coef=0.5, forward_kl_top_k=4)
  c.teacher.update(hf_checkpoint=str(two / "a"), route_field="domain", routes={"code": str(two / "b")},
                   rows_per_pass=rows_per_pass)
  return c


def test_the_estimate_and_the_plan_hold_every_teacher(two):
  c = _distill_plan_config(two, rows_per_pass=4)
  run = config_lib.load(c)
  one = config_lib.load(_one_teacher(c))
  est, single = memory.estimate(run, 4, 4, platform="cpu"), memory.estimate(one, 4, 4, platform="cpu")
  assert est.sampler["teacher"] == 2 * single.sampler["teacher"] > 0  # the two are the same size
  c.plan.programs = "teacher_score"
  progs = {p["name"]: p for p in planning.make_plan(c)["programs"]}
  assert set(progs) == {"teacher_score", "teacher_score[code]"}
  assert all(p["shape"]["rows"] == 4 for p in progs.values())  # the rows of one call, not the batch's


def _one_teacher(c):
  c = c.copy_and_resolve_references()
  c.teacher.route_field, c.teacher.routes = "", {}
  return c
