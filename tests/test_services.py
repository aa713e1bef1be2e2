"""A run's frozen models on slices of their own (placement "own", rlax.services): the config rules that come with
them, the memory estimate's service role, and a judged run whose judge decodes on its own device."""

import pytest

from harness import hf_models
from harness import judges as judges_harness
from rlax import builders
from rlax import compiled as compiled_lib
from rlax import config as config_lib
from rlax import judges
from rlax import memory
from rlax import memory_check
from rlax import topology
from rlax.data.records import Record, write_jsonl
from rlax.models import hf
from rlax.runtime import Controller
from rlax.sampler import warmup

PROMPTS = ["what is two plus two?", "solve twelve plus thirty", "the cat sat on the mat", "hi"]
TEMPLATE = judges_harness.TEMPLATE


def _config(tmp_path, placement="own", service_slices=1):
  c = judges_harness.run_config(tmp_path)
  c.topology.service_slices = service_slices
  c.judge.placement = placement
  return c


@pytest.fixture
def dirs(tmp_path):
  hf_models.make_dir(tmp_path / "policy", "llama", tie=False, seed=0)
  judges_harness.programmed(tmp_path / "judge", "four", Record(id="x", prompt="q", answer=""), template=TEMPLATE)
  write_jsonl([Record(id=str(i), prompt=p, answer=None) for i, p in enumerate(PROMPTS)], str(tmp_path / "train.jsonl"))
  return tmp_path


def test_own_placement_and_service_slices_come_together(dirs):
  with pytest.raises(ValueError, match=r"judge.placement='own' needs slices of its own: set topology.service_slices"):
    config_lib.load(_config(dirs, service_slices=0))
  with pytest.raises(ValueError, match="topology.service_slices=1 but no teacher or judge has placement='own'"):
    config_lib.load(_config(dirs, placement="sampler"))
  with pytest.raises(ValueError, match=r"judge.placement='elsewhere': expected one of \['sampler', 'own'\]"):
    config_lib.load(_config(dirs, placement="elsewhere"))


def test_the_estimate_counts_an_own_placed_judge_on_the_service_devices(dirs):
  own = config_lib.load(_config(dirs))
  beside = config_lib.load(_config(dirs, placement="sampler", service_slices=0))
  apart = memory.estimate(own, 1, 1, service_devices=1, platform="cpu")
  together = memory.estimate(beside, 1, 1, platform="cpu")
  assert apart.sampler["judge"] == 0 and apart.service["judge"] == together.sampler["judge"] > 0
  assert apart.service_devices == 1 and "service: 1 device(s)" in apart.summary()
  assert apart.sampler_bytes < together.sampler_bytes
  # Its slices lost (service_devices=0): the judge is counted beside the sampler again.
  assert memory.estimate(own, 1, 1, platform="cpu").sampler == together.sampler
  memory_check.check(apart, apart.trainer_bytes, apart.sampler_bytes, service_budget_bytes=apart.service_bytes)
  # The host's runtime counts the judge's warm-up programs as its engine decides them, each of the judge's layers.
  jcfg = hf.read_config(str(dirs / "judge"))
  engine = judges.engine(beside.judge, jcfg, None, slots=builders.judge_slots(beside))
  counted = compiled_lib.programs(beside, *topology.role_meshes(beside.topology, 1, 1), "cpu", None)
  assert counted[-1] == (len(warmup.programs(engine.warm_up_calls(judges.USES))), jcfg.n_layers) and len(counted) == 4
  with pytest.raises(ValueError, match=r"the service slices \(teacher / judge\) need .*\(topology.service_slices\)"):
    memory_check.check(apart, apart.trainer_bytes, apart.sampler_bytes, service_budget_bytes=apart.service_bytes - 1)


def test_a_judge_on_its_own_device_grades_every_reply(dirs):
  ctl = Controller(_config(dirs), progress=False)
  out = ctl.run()
  assert out["steps"] == 2 and out["pass1_after"] == 1.0
  assert all(r["reward"] == 1.0 and r["reward/judge_failed"] == 0.0 for r in ctl.metrics.history)
  judge = ctl.sampling.judge(ctl.parts)
  assert [d.id for d in judge.engine.mesh.devices.flat] == [7]  # the last slice; trainer 0, sampler 1
  assert [d.id for d in ctl.sampler.mesh.devices.flat] == [1]
