"""On-policy distillation end to end: a tiny random HF student and a teacher (the student with 3x its logits, the
same tokenizer) scored beside the sampler, in the rollout path: its cost and the reverse KL in every metrics row,
one teacher program (with a forward-KL term, its top-k too), nothing compiled after the first step; two teachers
chosen per record; on a slice of its own (teacher.placement="own"), it
runs beside the sampler while that slice is lost. (That the update descends the reverse KL is
tests/teachers/test_teacher.py's.)"""

from configs import base
from harness import hf_models
from rlax import compiled as compiled_lib
from rlax import topology
from rlax.data.records import Record, write_jsonl
from rlax.models import hf
from rlax.runtime import Controller

PROMPTS = ["what is two plus two?", "solve twelve plus thirty", "the cat sat on the mat", "hi"]


def _config(tmp_path, **topology):
  hf_models.make_dir(tmp_path / "student", "llama", tie=False, seed=0)
  hf_models.make_dir(tmp_path / "teacher", "llama", tie=False, seed=0)
  sharp = hf_models.reload(tmp_path / "teacher")  # the student with 3x its logits: a sharper policy
  sharp.lm_head.weight.data *= 3.0
  sharp.save_pretrained(tmp_path / "teacher")
  write_jsonl([Record(id=str(i), prompt=p, answer="four") for i, p in enumerate(PROMPTS)],
              str(tmp_path / "train.jsonl"))
  c = base.get_config()
  c.workdir = str(tmp_path / "run")
  c.model.hf_checkpoint = str(tmp_path / "student")
  c.model.overrides = dict(dtype="float32")
  c.topology.update(slice_size=1, trainer_slices=1, sampler_slices=1, **topology)
  c.algorithm.name = "distill"
  c.teacher.hf_checkpoint = str(tmp_path / "teacher")
  c.rollout.update(prompts_per_step=2, samples_per_prompt=4, max_prompt_len=24, max_new_tokens=8)
  c.controller.update(steps=3, max_staleness=1)
  c.optimizer.update(lr=1e-3, warmup_steps=0)
  c.data.update(train_files=str(tmp_path / "train.jsonl"), n_eval=2)
  c.eval.n_samples = 2
  return c


def test_a_distilling_run_scores_every_batch_with_its_teacher(tmp_path):
  """With a forward-KL term the batches carry the teacher's top-k too (one program all the same)."""
  c = _config(tmp_path)
  c.algorithm.overrides = dict(forward_kl_coef=0.5, forward_kl_top_k=4)
  ctl = Controller(c, progress=False, reward_fn=lambda text, record: (0.0, {}))
  out = ctl.run()
  assert out["steps"] == 3
  rows = ctl.metrics.history
  assert all(r["teacher_s"] > 0 and r["teacher_kl"] > 0 and r["forward_kl"] > 0 for r in rows)
  assert all(r["teacher_s/default"] > 0 and r["teacher_rows/default"] == 8 for r in rows)
  assert all(r["compiles"] == 0 for r in rows[1:])
  assert ctl.sampling.teacher(ctl.parts).traces["teacher_logprobs"] == 1


def test_rows_are_scored_by_the_teacher_their_record_names(tmp_path):
  """Two teachers (the sharp one by default; the student itself for records whose metadata says "self"): each
  scores its records' rows, in passes of 4 rows, with nothing compiled after the first step."""
  c = _config(tmp_path)
  write_jsonl([Record(id=str(i), prompt=f"{p} ({i})", answer="four", metadata={"who": "self"} if i % 2 else {})
               for i, p in enumerate(PROMPTS * 3)], str(tmp_path / "train.jsonl"))
  c.teacher.update(route_field="who", routes={"self": str(tmp_path / "student")}, rows_per_pass=4)
  ctl = Controller(c, progress=False, reward_fn=lambda text, record: (0.0, {}))
  assert ctl.run()["steps"] == 3
  teachers = ctl.sampling.teacher(ctl.parts)
  assert set(teachers.rows) == {"default", "self"} and sum(teachers.rows.values()) >= 3 * 8
  assert {n: t.traces["teacher_logprobs"] for n, t in teachers.teachers.items()} == {"default": 1, "self": 1}
  # The estimate's host runtime counts the programs each teacher compiled, of the teacher's layers.
  run = ctl.run_cfg
  counted = compiled_lib.programs(run, *topology.role_meshes(run.topology, 1, 1), "cpu", None)[3:]
  layers = [hf.read_config(path).n_layers for path in run.teacher.dirs().values()]
  assert counted == [(t.traces["teacher_logprobs"], n) for t, n in zip(teachers.teachers.values(), layers)]
  assert all(r["compiles"] == 0 for r in ctl.metrics.history[1:])
  # each teacher's cost, per step: the rows it scored and its seconds (0 and 0 the steps it scored nothing)
  rows = ctl.metrics.history
  assert all(r["teacher_rows/default"] + r["teacher_rows/self"] == 8 for r in rows)
  assert all((r[f"teacher_s/{n}"] > 0) == (r[f"teacher_rows/{n}"] > 0) for r in rows for n in ("default", "self"))


def test_a_teacher_on_its_own_slice_moves_beside_the_sampler_while_it_is_lost(tmp_path):
  c = _config(tmp_path, service_slices=1)  # trainer: slice 0, sampler: 1, teacher: 7 (the last)
  c.teacher.placement = "own"
  # The producer runs up to two batches ahead: the loss surfaces by step 3, the return at step 4.
  c.faults.update(lose_slice_at="7:1", restore_slice_at="7:4")
  c.controller.steps = 5
  ctl = Controller(c, progress=False, reward_fn=lambda text, record: (0.0, {}))
  assert [d.id for d in ctl.sampling.teacher(ctl.parts).mesh.devices.flat] == [7]
  out = ctl.run()
  assert out["steps"] == 5 and all(r["teacher_s"] > 0 and r["teacher_kl"] > 0 for r in ctl.metrics.history)
  lost, back = [(e["service"], e["sampler"], e["steps_lost"]) for e in ctl.faults.events]
  assert lost == ([], [1], 0) and back == ([7], [1], 0)  # the trainer's steps are never redone
  assert [d.id for d in ctl.sampling.teacher(ctl.parts).mesh.devices.flat] == [7]
