"""The run's frozen models beside the policy (a distilling run's teacher, a judge): which ones the run loads,
the rules they impose across config sections, and the devices they run on.

placement "sampler": on the sampler's mesh, between its batches (small setups); "own": on the topology's
service slices (`topology.service_slices`), so scoring and judging overlap the sampler's decoding; while those
slices are lost the services share the sampler's mesh (rlax.topology.reassign_roles). Read by `config.validate`,
the sampler's role (rlax.runtime.sampling), the memory estimate (rlax.memory) and launch.plan.
"""

from __future__ import annotations

from typing import Any

import jax

PLACEMENTS = ("sampler", "own")


def placements(run) -> dict[str, str]:
  """{"teacher" / "judge": its placement} for the frozen models `run` loads."""
  out = {}
  if run.teacher.hf_checkpoint:
    out["teacher"] = run.teacher.placement
  if run.judge.hf_checkpoint:
    out["judge"] = run.judge.placement
  return out


def own_slices(run) -> bool:
  """Whether a frozen model of `run` runs on the service slices."""
  return "own" in placements(run).values()


def check(run) -> None:
  """The rules across sections that the services bring; raises one ValueError naming the fields."""
  algo, topo = run.algorithm, run.topology
  own = [f"{k}.placement='own'" for k, v in placements(run).items() if v == "own"]
  checks = [
      (algo.distills == bool(run.teacher.hf_checkpoint), f"algorithm.distill_coef={algo.distill_coef}, "
       f"forward_kl_coef={algo.forward_kl_coef} and teacher.hf_checkpoint={run.teacher.hf_checkpoint!r}: a "
       "distilling run needs a teacher, and only it"),
      (algo.teacher_top_k <= run.model.vocab_size, f"algorithm.forward_kl_top_k={algo.forward_kl_top_k} exceeds "
       f"the policy's vocabulary of {run.model.vocab_size}"),
      ((run.reward.name == "judge") == bool(run.judge.hf_checkpoint), f"reward.name={run.reward.name!r} and "
       f"judge.hf_checkpoint={run.judge.hf_checkpoint!r}: reward.name='judge' needs a judge, and only it reads one"),
      (run.reward.name != "judge" or (run.reward.answer == "auto" and not run.reward.format_weight
                                      and run.rollout.slots != -1),
       f"reward.name='judge' reads neither reward.answer={run.reward.answer!r} nor reward.format_weight="
       f"{run.reward.format_weight}, and needs rollout.slots sized (not -1: free memory is measured before the "
       "judge loads)"),
      (not own or topo.service_slices > 0,
       f"{' and '.join(own)} needs slices of its own: set topology.service_slices (0 now)"),
      (own or topo.service_slices == 0,
       f"topology.service_slices={topo.service_slices} but no teacher or judge has placement='own': those "
       "slices would idle"),
  ]
  for ok, msg in checks:
    if not ok:
      raise ValueError(msg)


def mesh(topology, placement: str) -> Any:
  """The mesh a frozen model with `placement` runs on in `topology`: the service mesh (its own slices, or the
  sampler's while they are lost) or the sampler's."""
  return topology.service_mesh if placement == "own" else topology.sampler_mesh


def local_mesh(topology, placement: str) -> Any:
  """`mesh`, checked to lie in this process: a multi-process job runs its teacher and judge in the sampler's."""
  m = mesh(topology, placement)
  owners = {d.process_index for d in m.devices.flat}
  if owners != {jax.process_index()}:
    knob = "placement='sampler'" if placement == "own" else "topology.slice_size to the devices per process"
    raise ValueError(f"the {placement} mesh lies in processes {sorted(owners)}: a teacher or judge runs in the "
                     f"sampler's process ({jax.process_index()}); give it the service slices too, or set {knob}")
  return m
