"""Budgets for a run's memory estimate (rlax.memory): a check that refuses configs that cannot fit, naming the
knob to turn.

    memory_check.check(est, trainer_budget_bytes=16 * GIB, sampler_budget_bytes=16 * GIB)   # ValueError, one line
    memory_check.check_topology(run, topology)   # the estimate on a built topology's devices, checked
"""

from __future__ import annotations

from typing import Optional

from rlax import services
from rlax.config import RunConfig
from rlax.memory import GIB, MemoryEstimate, estimate
from rlax.sampler import sizing


def _trainer_knob(est: MemoryEstimate, run: Optional[RunConfig]) -> str:
  t = est.trainer
  state = t["params"] + t["opt_state"] + t["grads"] + t["ref_params"]
  if state >= t["activations"] + t["logits"]:
    knob = "spread the trainer over more devices (topology.trainer_slices, topology.trainer_mesh.fsdp)"
    if t["ref_params"]:
      knob += " or set algorithm.kl_coef=0 (drops the reference copy)"
    return knob
  if run is None:
    return "set model.overrides.remat=True and scan_layers=True or lower optimizer.micro_batch_tokens"
  cfg, o = run.model, run.optimizer
  knobs = []
  if t["activations"] >= t["logits"] and not (cfg.remat and cfg.scan_layers):
    knobs.append("set " + " and ".join(f"model.overrides.{k}=True" for k in ("remat", "scan_layers")
                                       if not getattr(cfg, k)))
  knobs.append("lower optimizer.micro_batch_tokens" if o.micro_batch_tokens else
               "set optimizer.micro_batch_tokens (0 now: the whole batch is one micro-batch)")
  knobs.append("shorten rollout.max_new_tokens")
  return " or ".join(knobs)


def _sampler_knob(est: MemoryEstimate, run: Optional[RunConfig]) -> str:
  s = est.sampler
  resident = sum(s[k] for k in ("weights", "spare_weights", "pristine_base", "fused", "teacher", "judge"))
  if resident >= s["kv_cache"] + s["scratch"]:
    return "shard the sampler's weights (topology.sampler_mesh.tensor > 1) or give it more devices"
  slots = "" if run is None else f" ({run.rollout.decode_slots(run.eval.n_samples)} decode slots)"
  return f"lower rollout.max_new_tokens or rollout.slots{slots}"


def check(est: MemoryEstimate, trainer_budget_bytes: int, sampler_budget_bytes: int, *,
          shared_host: bool = False, run: Optional[RunConfig] = None, service_budget_bytes: int = 0) -> None:
  """Raises ValueError (one line naming the knob to turn) when the estimate exceeds the budgets.

  Budgets are per device (a service device's, `service_budget_bytes`, defaults to a sampler device's). Colocated
  roles add up on each device. shared_host=True (fake CPU devices, one RAM): the sum over all devices is held
  against the sum of the budgets, so one role may use more than its even share. `run` (the estimate's config)
  makes the suggested knob specific.
  """
  service_budget = service_budget_bytes or sampler_budget_bytes
  gib = lambda x: f"{x / GIB:.1f} GiB"
  knob = lambda: (_trainer_knob(est, run) if est.trainer_bytes * est.trainer_devices
                  >= est.sampler_bytes * est.sampler_devices else _sampler_knob(est, run))
  if shared_host:
    budget = (trainer_budget_bytes * est.trainer_devices if est.colocated else
              trainer_budget_bytes * est.trainer_devices + sampler_budget_bytes * est.sampler_devices)
    budget += service_budget * est.service_devices
    services = f" + {est.service_devices} x {gib(est.service_bytes)} service" if est.service_devices else ""
    if est.total_bytes > budget:
      raise ValueError(f"trainer + sampler need ~{gib(est.total_bytes)} of host memory ({est.trainer_devices} x "
                       f"{gib(est.trainer_bytes)} trainer + {est.sampler_devices} x {gib(est.sampler_bytes)} "
                       f"sampler{services}) > {gib(budget)} available: {knob()}")
    return
  if est.service_bytes > service_budget:
    raise ValueError(f"the service slices (teacher / judge) need ~{gib(est.service_bytes)} per device > "
                     f"{gib(service_budget)} available: give them more devices (topology.service_slices) or shard "
                     "them (topology.service_mesh.tensor > 1)")
  if est.colocated:
    need = est.trainer_bytes + est.sampler_bytes
    if need > trainer_budget_bytes:
      raise ValueError(f"trainer + sampler (colocated) need ~{gib(need)} per device > {gib(trainer_budget_bytes)} "
                       f"available: {knob()}")
    return
  if est.trainer_bytes > trainer_budget_bytes:
    raise ValueError(f"trainer needs ~{gib(est.trainer_bytes)} per device > {gib(trainer_budget_bytes)} available: "
                     f"{_trainer_knob(est, run)}")
  if est.sampler_bytes > sampler_budget_bytes:
    raise ValueError(f"sampler needs ~{gib(est.sampler_bytes)} per device > {gib(sampler_budget_bytes)} available: "
                     f"{_sampler_knob(est, run)}")


def check_topology(run: RunConfig, topology) -> MemoryEstimate:
  """`estimate` on a built topology's meshes, checked against its devices' budgets; returns the estimate."""
  tdevs = list(topology.trainer_mesh.devices.flat)
  sdevs = list(topology.sampler_mesh.devices.flat)
  # Service slices lost: the services run beside the sampler, which `estimate` counts with service_devices=0.
  vdevs = list(topology.service_mesh.devices.flat) if topology.assignment.service and services.own_slices(run) else []
  platform = tdevs[0].platform
  est = estimate(run, len(tdevs), len(sdevs), service_devices=len(vdevs), platform=platform)
  if platform == "cpu":
    # Fake CPU devices share one RAM and idle ones hold nothing: the used devices split all of it.
    import psutil  # pylint: disable=g-import-not-at-top
    used = len(set(tdevs) | set(sdevs) | set(vdevs))
    share = psutil.virtual_memory().total // used
    check(est, share, share, shared_host=True, run=run)
  else:
    check(est, sizing.device_budget(tdevs[0]), sizing.device_budget(sdevs[0]), run=run,
          service_budget_bytes=sizing.device_budget(vdevs[0]) if vdevs else 0)
  return est
