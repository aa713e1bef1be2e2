"""rlax.memory: exact parts against hand counts and the runtime's own accounting, the modelled parts against
XLA's compiled programs (`memory_analysis()`) within a stated factor, and the check's one-line refusals."""

import dataclasses
import re
import types

import jax
import psutil
import pytest

from rlax import builders
from rlax import compiled as compiled_lib
from rlax import config as config_lib
from rlax import memory
from rlax import memory_check
from rlax import run as run_lib
from rlax import topology
from rlax import models
from rlax.sampler import Temperature, sizing
from rlax.topology import build_topology

GIB = memory.GIB
BASE = dict(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=512)
# The estimate against the compiled programs' peaks: never more than 20% under, at most 60% over.
LOW, HIGH = 0.8, 1.6


def _run(model=None, rollout=None, optimizer=None, topology=None, algorithm=None, eval_samples=1, **top):
  return config_lib.load(dict(
      workdir="unused", model=dict(preset="w1", overrides={**BASE, **(model or {})}),
      rollout={**dict(prompts_per_step=4, samples_per_prompt=4, max_prompt_len=32, max_new_tokens=96),
               **(rollout or {})},
      optimizer=optimizer or {}, algorithm={**dict(name="grpo", kl_coef=0.0), **(algorithm or {})},
      eval=dict(n_samples=eval_samples),
      topology={**dict(slice_size=None, trainer_slices=1, colocated=False), **(topology or {})}, **top))


def _peak(compiled) -> int:
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def _mesh(run, role, devices):
  shape = topology.abstract_mesh(getattr(run.topology, f"{role}_mesh"), len(devices), role).shape
  return models.make_mesh(devices, **dict(shape))


def _sampler(run, mesh):
  """The engine the runtime builds on `mesh`."""
  return builders.sampler(run, mesh, types.SimpleNamespace(eos_ids=[0], pad_id=0))


def test_exact_parts_match_hand_counts_and_the_engine():
  run = _run(model=dict(dtype="bfloat16"), algorithm=dict(kl_coef=0.04), eval_samples=4)
  cfg, n = run.model, run.model.num_params()
  est = memory.estimate(run, 1, 1)
  t, s = est.trainer, est.sampler
  assert t["params"] == 4 * n and t["ref_params"] == 4 * n  # f32 master weights, and the reference copy
  assert 2 * t["params"] <= t["opt_state"] <= 2 * t["params"] + 64  # Adam's two moments + step counters
  assert s["weights"] == 2 * n and s["spare_weights"] == 2 * n  # bf16; one version arriving next to the one in use
  B, S = 16, 32 + 96  # the batch's 16 rows, in whole groups of 4 (rollout and eval)
  assert s["kv_cache"] == 2 * cfg.n_layers * B * S * cfg.n_kv_heads * cfg.head_dim * 2
  # Sharded: the engine's own accounting on a real 4-device sampler mesh (data 2 x tensor 2).
  run = _run(model=dict(dtype="bfloat16"), eval_samples=4, topology=dict(sampler_mesh=dict(data=-1, fsdp=1, tensor=2)))
  est = memory.estimate(run, 4, 4)
  engine = _sampler(run, _mesh(run, "sampler", jax.devices()[4:])).memory
  assert est.sampler["kv_cache"] == engine["cache"] and est.sampler["weights"] == engine["params"]
  # The trainer's layout: FSDP over 4 devices splits every weight with a dimension divisible by 4.
  norms = 2 * cfg.n_layers * cfg.d_model + cfg.d_model  # replicated; everything else splits 4 ways
  assert est.trainer["params"] == 4 * (n - norms) // 4 + 4 * norms
  assert est.trainer_mesh == {"data": 1, "fsdp": 4, "tensor": 1}


CASES = {
    # f32, no remat, reference policy (held outside the step), eval rows dominate the sampler.
    "f32": (dict(model={}, algorithm=dict(kl_coef=0.04), eval_samples=4), 1, 1),
    # remat over unrolled layers: XLA:CPU keeps every layer's activations anyway (estimated as no remat).
    "remat_unrolled": (dict(model=dict(remat=True)), 1, 1),
    # bf16 compute, scanned remat layers, tied 8k vocab, longer rows, 8 scanned micro-batches.
    "bf16_scan_remat_tied": (dict(model=dict(dtype="bfloat16", remat=True, scan_layers=True, vocab_size=8192,
                                             tie_embeddings=True),
                                  rollout=dict(prompts_per_step=2, max_prompt_len=64, max_new_tokens=192),
                                  optimizer=dict(micro_batch_tokens=256)), 1, 1),
    # 4 + 4 devices: trainer fsdp 2 x tensor 2 with 2 unrolled micro-batches, sampler data 2 x tensor 2,
    # decode in chunks (a weight swap recomputes the cache: the refill program).
    "sharded_chunked": (dict(topology=dict(slice_size=4, trainer_slices=1, sampler_slices=1,
                                           trainer_mesh=dict(data=1, fsdp=-1, tensor=2),
                                           sampler_mesh=dict(data=-1, fsdp=1, tensor=2)),
                             optimizer=dict(micro_batch_tokens=1024), rollout=dict(decode_chunk=16)), 4, 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_within_factor_of_compiled_programs(case):
  kw, n_t, n_s = CASES[case]
  run = _run(**kw)
  est = memory.estimate(run, n_t, n_s)
  r = run.rollout
  devs = jax.devices()
  trainer = builders.trainer(run, _mesh(run, "trainer", devs[:n_t]))
  batch = run_lib.train_plan(run, trainer).largest_abstract(trainer, with_ref=run.algorithm.kl_coef > 0)  # the largest micro-batch
  step = trainer.lower_step(trainer.abstract_state(), batch).compile()
  ratio = (est.trainer_bytes - est.trainer["ref_params"]) / _peak(step)
  assert LOW <= ratio <= HIGH, (case, "trainer", ratio, est.summary())

  sampler = _sampler(run, _mesh(run, "sampler", devs[8 - n_s:]))
  G = min(r.samples_per_prompt, run.eval.n_samples)  # the estimate's largest prefill: most distinct prompts
  admit = sampler.lower_admit(sampler.slots // G, G, Temperature(1.0))
  peaks = [_peak(admit["prefill"].compile()), _peak(admit["admit"].compile()),
           _peak(sampler.lower_decode(Temperature(1.0)).compile()), _peak(sampler.lower_recompute().compile())]
  ratio = (est.sampler_bytes - est.sampler["spare_weights"]) / max(peaks)
  assert LOW <= ratio <= HIGH, (case, "sampler", ratio, peaks, est.summary())


def test_remat_and_micro_batches_on_cpu_and_elsewhere():
  acts = lambda platform, **model: memory.estimate(_run(model=model), 1, 1, platform=platform).trainer["activations"]
  none = acts("cpu")
  assert acts("cpu", remat=True, scan_layers=True) < none / 2
  assert acts("cpu", remat=True) == none  # XLA:CPU hoists the recomputation of unrolled layers
  assert acts("tpu", remat=True) < acts("tpu") / 2
  # Micro-batches are a scan: one is live, on CPU as elsewhere.
  est = lambda tokens, platform="cpu": memory.estimate(_run(optimizer=dict(micro_batch_tokens=tokens)), 1, 1,
                                                       platform=platform).trainer
  assert est(1024)["activations"] == pytest.approx(est(0)["activations"] / 2, rel=1e-6)
  assert est(1024)["grads"] == 1.5 * est(0)["grads"]
  assert est(1024, "tpu")["activations"] == pytest.approx(est(0, "tpu")["activations"] / 2, rel=1e-6)
  assert est(256)["activations"] == pytest.approx(est(0)["activations"] / 8, rel=1e-6)


def test_the_estimate_is_sized_for_the_programs_largest_micro_batch():
  """A run has one packed program per row length and the padded one where packing may not pay; the estimate
  is sized for the program whose micro-batch holds the most tokens, and its compiled step is the largest."""
  run = _run(rollout=dict(prompts_per_step=4, samples_per_prompt=4, max_prompt_len=32, max_new_tokens=48),
             optimizer=dict(pack_tokens=320, micro_batch_tokens=1024, share_prompts=False))
  trainer = builders.trainer(run, None)
  plan = run_lib.train_plan(run, trainer)
  assert [(p.rows, p.length, p.micro_batches) for p in plan.programs] == [(18, 320, 6), (16, 80, 2)]
  big = plan.largest_micro_batch(None)
  est = memory.estimate(run, 1, 1)
  assert f"at most {big.micro_rows} rows x {big.length} tokens" in est.notes["trainer.activations"]
  peaks = [_peak(trainer.lower_step(trainer.abstract_state(), b).compile())
           for b, _ in plan.abstract(trainer, with_ref=run.algorithm.kl_coef > 0)]
  assert max(peaks) == _peak(trainer.lower_step(trainer.abstract_state(),
                                                plan.largest_abstract(trainer, with_ref=run.algorithm.kl_coef > 0)).compile())
  assert LOW <= est.trainer_bytes / max(peaks) <= HIGH, est.summary()


def test_peak_memory_falls_as_micro_batch_tokens_fall():
  """The compiled train step's peak (XLA:CPU's memory_analysis) and the estimate fall with every halving of
  optimizer.micro_batch_tokens: 1, 2, 4 and 8 micro-batches of the 16 x 128-token batch."""
  peaks, ests = [], []
  for tokens in (0, 1024, 512, 256):
    run = _run(model=dict(vocab_size=512, n_layers=2), optimizer=dict(micro_batch_tokens=tokens))
    r = run.rollout
    trainer = builders.trainer(run, None)
    step = trainer.lower_step(trainer.abstract_state(),
                              run_lib.train_plan(run, trainer).largest_abstract(trainer, with_ref=run.algorithm.kl_coef > 0)).compile()
    peaks.append(_peak(step))
    ests.append(memory.estimate(run, 1, 1).trainer_bytes)
    assert trainer.num_micro_batches(r.rows, 128) == max(1, 2048 // max(tokens, 1) if tokens else 1)
  assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks
  assert all(a > b for a, b in zip(ests, ests[1:])), ests


def test_check_refuses_in_one_line_naming_the_knob():
  line = re.compile(r"^trainer needs ~[\d.]+ GiB per device > [\d.]+ GiB available: (.*)$")
  run = _run()
  est = memory.estimate(run, 1, 1)
  memory_check.check(est, est.trainer_bytes, est.sampler_bytes)  # exactly enough
  with pytest.raises(ValueError) as e:
    memory_check.check(est, 2 ** 20, GIB, run=run)
  knob = line.match(str(e.value)).group(1)
  assert "model.overrides.remat=True and model.overrides.scan_layers=True" in knob
  assert "set optimizer.micro_batch_tokens" in knob
  # With remat and scan on and micro-batches set, what is left is the micro-batch size and the sequence.
  run = _run(model=dict(remat=True, scan_layers=True), optimizer=dict(micro_batch_tokens=4096),
             rollout=dict(max_new_tokens=1024))
  with pytest.raises(ValueError) as e:
    memory_check.check(memory.estimate(run, 1, 1), 2 ** 20, GIB, run=run)
  assert line.match(str(e.value)).group(1) == "lower optimizer.micro_batch_tokens or shorten rollout.max_new_tokens"
  # A big model on short rows: the train state dominates, so more devices (and no reference copy).
  run = _run(model=dict(d_model=1024, mlp_dim=4096, n_heads=8, head_dim=128), rollout=dict(max_prompt_len=4,
             max_new_tokens=4), algorithm=dict(kl_coef=0.04))
  with pytest.raises(ValueError, match=r"topology.trainer_mesh.fsdp.*algorithm.kl_coef=0") as e:
    memory_check.check(memory.estimate(run, 1, 1), 2 ** 20, GIB, run=run)
  assert "\n" not in str(e.value)
  # Many eval rows x long generations: the sampler's KV cache.
  run = _run(rollout=dict(max_new_tokens=2048), eval_samples=64)
  est = memory.estimate(run, 1, 1)
  assert est.sampler["kv_cache"] > est.sampler["weights"]
  with pytest.raises(ValueError, match=r"^sampler needs ~[\d.]+ GiB per device > [\d.]+ GiB available: lower "
                                       r"rollout.max_new_tokens or rollout.slots \(64 decode slots\)$"):
    memory_check.check(est, est.trainer_bytes, est.sampler_bytes - 1, run=run)


def test_engine_cache_is_its_slots():
  run = _run(model=dict(dtype="bfloat16"), eval_samples=8)
  s = memory.estimate(run, 1, 1).sampler
  B, S = 16, 32 + 96  # 4 prompts x 4 samples, already whole groups of lcm(4, 8) = 8
  assert s["kv_cache"] == 2 * run.model.n_layers * B * S * run.model.n_kv_heads * run.model.head_dim * 2
  r = run.rollout
  engine = _sampler(run, None)
  assert engine.slots == B and engine.memory["cache"] == s["kv_cache"]
  with pytest.raises(ValueError, match=r"lower rollout.max_new_tokens or rollout.slots \(16 decode slots\)$"):
    memory_check.check(memory.estimate(run, 1, 1), GIB, s["weights"], run=run)
  assert r.decode_slots(8) == 16 and _run(rollout=dict(prompts_per_step=3), eval_samples=8).rollout.decode_slots(8) == 16


@pytest.mark.parametrize("budget_mib", [5, 6, None])
def test_slots_sized_from_memory_agree_between_the_estimate_and_the_engine(budget_mib):
  """rollout.slots=-1: the estimate and the engine the runtime builds size the same slots and bytes (one sizing
  function), on a 4-device sampler mesh; the budget caps them, else this batch and the next one's prompts do."""
  run = _run(rollout=dict(slots=-1), eval_samples=4, topology=dict(sampler_mesh=dict(data=-1, fsdp=1, tensor=2)))
  mesh = _mesh(run, "sampler", jax.devices()[4:])
  budget = None if budget_mib is None else budget_mib << 20
  est = memory.estimate(run, 4, 4, sampler_budget_bytes=budget)
  slots = builders.slots(run, mesh, budget)
  engine = builders.sampler(run, mesh, types.SimpleNamespace(eos_ids=[0], pad_id=0)) if budget is None else None
  if engine is not None:
    assert engine.slots == slots and engine.memory["cache"] == est.sampler["kv_cache"]
  assert slots % 4 == 0  # whole groups (4) on whole row shards (data 2)
  one = memory.estimate(run.replace(rollout=dataclasses.replace(run.rollout, slots=8)), 4, 4).sampler["kv_cache"]
  assert est.sampler["kv_cache"] == one * slots // 8
  cap = run.rollout.rows + run.rollout.ahead * run.rollout.samples_per_prompt
  if budget is None:
    assert slots == cap
  else:
    per = sizing.sampler_memory(run.model, builders.make_layout(run.model, "auto", 32, 96), 4, 128, mesh)
    assert slots == min(cap, (budget - per["params"]) // (per["cache"] + per["transient"]) * 4) < cap
  with pytest.raises(ValueError, match="one group of 4 slots x 128 tokens needs"):
    builders.slots(run, mesh, 1 << 10)


def test_colocated_roles_add_up_on_each_device():
  est = memory.estimate(_run(topology=dict(colocated=True)), 2, 2, platform="tpu")  # devices only
  assert est.colocated
  both = est.trainer_bytes + est.sampler_bytes
  memory_check.check(est, both, 0)  # the sampler's budget is the trainer's: same devices
  with pytest.raises(ValueError, match=r"^trainer \+ sampler \(colocated\) need ~[\d.]+ GiB per device"):
    memory_check.check(est, both - 1, both)
  apart = memory.estimate(_run(), 2, 2, platform="tpu")
  memory_check.check(apart, both - 1, both)  # disjoint devices: each role alone must fit
  assert est.total_bytes == 2 * both == apart.total_bytes


def test_shared_host_compares_the_sum_over_devices():
  est = memory.estimate(_run(), 2, 2, platform="tpu")  # the devices' sum (host items: test below)
  t, s = est.trainer_bytes, est.sampler_bytes
  assert est.total_bytes == 2 * t + 2 * s
  # Even shares of one RAM: the trainer may use more than its share while the sampler uses less.
  share = (t + s) // 2 + 1
  with pytest.raises(ValueError, match="^trainer needs"):
    memory_check.check(est, share, share)
  memory_check.check(est, share, share, shared_host=True)
  with pytest.raises(ValueError, match=r"^trainer \+ sampler need ~[\d.]+ GiB of host memory \(2 x [\d.]+ GiB "
                                       r"trainer \+ 2 x [\d.]+ GiB sampler\) > [\d.]+ GiB available: "):
    memory_check.check(est, share - 2, share - 2, shared_host=True)


def test_device_budget():
  cpu = jax.devices()[0]
  assert sizing.device_budget(cpu) == psutil.virtual_memory().total // len(jax.devices())
  gpu = types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 80 * GIB, "bytes_in_use": GIB})
  assert sizing.device_budget(gpu) == 80 * GIB and sizing.device_budget(gpu, free=True) == 79 * GIB
  odd = types.SimpleNamespace(platform="tpu", memory_stats=lambda: None)
  with pytest.raises(ValueError, match="bytes_limit"):
    sizing.device_budget(odd)


def test_bad_device_counts():
  with pytest.raises(ValueError, match=r"^topology.colocated=True: trainer_devices=4 and sampler_devices=2"):
    memory.estimate(_run(topology=dict(colocated=True)), 4, 2)
  run = _run(topology=dict(trainer_mesh=dict(data=1, fsdp=-1, tensor=3)))
  with pytest.raises(ValueError, match=r"^topology.trainer_mesh=.* does not fit 4 trainer device\(s\)$"):
    memory.estimate(run, 4, 4)


def test_ppo_counts_its_value_model():
  grpo, ppo = (memory.estimate(_run(algorithm=dict(name=n)), 1, 1) for n in ("grpo", "ppo"))
  assert grpo.trainer["critic"] == 0
  # The critic is the policy's trunk (f32 here) plus a [d_model] head and a bias: params, 2 Adam moments and
  # the gradients (counted twice, as the policy's) = 5 copies of the trunk and head, plus the optimizer's
  # scalars.
  trunk = grpo.trainer["params"]
  head = (BASE["d_model"] + 1) * 4
  assert 5 * (trunk + head) <= ppo.trainer["critic"] <= 5 * (trunk + head) + 64
  assert ppo.trainer_bytes - grpo.trainer_bytes == ppo.trainer["critic"]
  assert "value model" in ppo.summary()


def test_summary_lists_every_item_in_gib():
  est = memory.estimate(_run(algorithm=dict(kl_coef=0.04)), 1, 1)
  text = est.summary()
  for item in memory.TRAINER_ITEMS + memory.SAMPLER_ITEMS:
    assert re.search(rf"^  {item} +\d+\.\d{{3}}  ", text, re.M), item
  assert f"  params{est.trainer['params'] / GIB:17.3f}" in text
  assert f"{est.trainer_bytes / GIB:.3f}" in text and f"{est.total_bytes / GIB:.3f} GiB" in text


def test_check_topology_on_fake_cpu_devices():
  run = _run(topology=dict(slice_size=2, trainer_slices=2, sampler_slices=2))
  topo = build_topology(run.topology)
  est = memory_check.check_topology(run, topo)
  assert (est.trainer_devices, est.sampler_devices) == (4, 4)
  huge = _run(topology=dict(slice_size=2, trainer_slices=2, sampler_slices=2),
              model=dict(d_model=8192, mlp_dim=32768, n_heads=64, head_dim=128, n_layers=32))
  with pytest.raises(ValueError, match="of host memory"):
    memory_check.check_topology(huge, build_topology(huge.topology))


def test_idle_fake_cpu_devices_leave_their_ram_to_the_used_ones(monkeypatch):
  import collections  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  run = _run(topology=dict(slice_size=1, trainer_slices=1, sampler_slices=1))
  topo = build_topology(run.topology)  # 2 of the 8 fake devices
  need = memory.estimate(run, 1, 1, platform="cpu").total_bytes
  mem = collections.namedtuple("mem", "total")
  monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(int(need * 1.5)))
  memory_check.check_topology(run, topo)  # 8 even shares would give these two devices 0.375x what they need
  monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(int(need * 0.9)))
  with pytest.raises(ValueError, match="of host memory"):
    memory_check.check_topology(run, topo)


def test_host_items_add_to_the_total_where_devices_are_host_memory():
  """On fake CPU devices the process's own memory and a checkpoint's host copy of the train state share the
  RAM with the devices; on an accelerator they are host RAM, apart from the devices' totals."""
  run = _run()
  cpu, tpu = memory.estimate(run, 1, 1, platform="cpu"), memory.estimate(run, 1, 1, platform="tpu")
  state = cpu.trainer["params"] + cpu.trainer["opt_state"]
  transients = cpu.trainer["grads"] + cpu.trainer["activations"] + cpu.trainer["logits"]
  # CPU saves block between steps, so the copy only counts beyond the step's transients; elsewhere it is whole.
  assert cpu.host["checkpoint"] == max(0, state - transients) and set(cpu.host) == set(memory.HOST_ITEMS)
  assert tpu.host["checkpoint"] == tpu.trainer["params"] + tpu.trainer["opt_state"]
  devices = lambda e: e.trainer_bytes + e.sampler_bytes
  assert cpu.total_bytes == devices(cpu) + sum(cpu.host.values())
  assert tpu.total_bytes == devices(tpu)
  assert "host (this process" in cpu.summary()


def test_the_runtime_counts_the_programs_the_sampler_warms_up():
  """The host's runtime item holds a heap per compiled program, counted without building the sampler: recomputing
  the cache on a weight swap adds the engine's recompute programs (one per slot bucket), each a fixed part and
  one per layer."""
  from rlax.sampler import warmup
  keep, swap = _run(rollout=dict(on_swap="keep")), _run(rollout=dict(on_swap="recompute"))
  engines = [_sampler(r, _mesh(r, "sampler", jax.devices()[:1])) for r in (keep, swap)]
  uses = builders.sampler_uses(swap)
  n_keep, n_swap = (len(warmup.programs(e.warm_up_calls(uses))) for e in engines)
  a, b = (memory.estimate(r, 1, 1, platform="cpu").host["runtime"] for r in (keep, swap))
  assert n_swap - n_keep == len(engines[1].slot_buckets) > 1
  counted = compiled_lib.programs(swap, *topology.role_meshes(swap.topology, 1, 1), "cpu", None)
  assert counted[0] == (n_swap, swap.model.n_layers)
  each = compiled_lib.PROGRAM_BYTES + swap.model.n_layers * compiled_lib.PROGRAM_LAYER_BYTES
  assert b - a == (n_swap - n_keep) * each
