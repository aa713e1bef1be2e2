"""A mixture-of-experts policy through the runtime (configs/demo.py:tiny_moe, 4 experts top-2): the experts
split over the trainer's fsdp axis, the sampler's routes replayed by every trainer forward, compiled ahead."""

import numpy as np

from rlax.models import expert_parallel
from rlax.runtime import Controller

from tiny import demo_config


def test_tiny_moe_trains_with_replayed_routes(tmp_path):
  c = demo_config(tmp_path, "tiny_moe", **{"controller.max_staleness": 0, "controller.steps": 3})
  ctl = Controller(c, progress=False)
  assert expert_parallel.expert_axes(dict(ctl.topo.trainer_mesh.shape), 4) == ("fsdp",)  # EP 2 in training
  out = ctl.run()
  rows = ctl.metrics.history
  assert out["steps"] == 3 and [r["step"] for r in rows] == list(range(3))
  # k = 0 and f32: the trainer's log-probs are the sampler's, token for token, through the same experts.
  assert max(r["logp_diff_max"] for r in rows) < 1e-4
  assert all(np.isfinite(r["loss"]) for r in rows) and [r["compiles"] for r in rows[1:]] == [0.0, 0.0]
