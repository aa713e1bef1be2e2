"""Code reward: extract the model's Python and run the record's tests in the sandbox.

The last fenced ```python (or bare ```) block is the solution; without a fence the whole
completion is. Reward is 1.0 when every test passes, or the passed fraction with `partial=True`.
"""

from __future__ import annotations

import functools
import re

from absl import logging

from rlax.rewards import sandbox

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
  """The last fenced code block, or the whole completion if there is none."""
  blocks = _FENCE.findall(completion)
  return blocks[-1] if blocks else completion


def code_reward(completion: str, record, limits: sandbox.SandboxLimits = sandbox.SandboxLimits(),
                partial: bool = False) -> tuple[float, dict]:
  """Runs `record.tests` against the extracted code in the sandbox; see module docstring."""
  if not record.tests:
    raise ValueError(f"record {record.id} has no tests for the code reward")
  res = sandbox.run_tests(extract_code(completion), record.tests, limits=limits)
  if res.status != "ok":
    logging.info("code reward 0 for %s: %s", record.id, res.error)
  if res.status == "ok" and res.total != len(record.tests):
    return 0.0, {"status": "tampered", "reason": f"ran {res.total} of {len(record.tests)} tests"}
  reward = (res.passed / res.total if partial else float(res.all_passed)) if res.status == "ok" else 0.0
  return reward, {"status": res.status, "passed": res.passed, "total": res.total,
                  "reason": res.error or "all tests passed", "wall_s": res.wall_s}


def make_code_reward(wall_s: float = 5.0, memory_mb: int = 512, partial: bool = False):
  """A `code_reward` with other limits, for configs."""
  limits = sandbox.SandboxLimits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb)
  return functools.partial(code_reward, limits=limits, partial=partial)
