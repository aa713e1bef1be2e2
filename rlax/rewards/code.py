"""Code reward: extract the model's Python and grade it on the record's tests.

The last fenced ```python (or bare ```) block is the solution; without a fence the whole
completion is. The solution runs in the sandbox; the tests' comparisons run outside it
(`rlax.rewards.code_tests`). Reward is 1.0 when every test holds, or the held fraction with `partial=True`.
"""

from __future__ import annotations

import functools
import re

from absl import logging

from rlax.rewards import code_tests
from rlax.rewards import sandbox

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
  """The last fenced code block, or the whole completion if there is none."""
  blocks = _FENCE.findall(completion)
  return blocks[-1] if blocks else completion


def code_reward(completion: str, record, limits: sandbox.SandboxLimits = sandbox.SandboxLimits(),
                partial: bool = False) -> tuple[float, dict]:
  """Grades the extracted code on `record.tests`; see the module docstring."""
  if not record.tests:
    raise ValueError(f"record {record.id} has no tests for the code reward")
  res = code_tests.run_tests(extract_code(completion), record.tests, limits=limits)
  if res.status != "ok":
    logging.info("code reward 0 for %s: %s", record.id, res.error)
  reward = (res.passed / res.total if partial else float(res.all_passed)) if res.status == "ok" else 0.0
  return reward, {"status": res.status, "passed": res.passed, "total": res.total,
                  "reason": res.error or "all tests passed", "wall_s": res.wall_s}


def make_code_reward(wall_s: float = 5.0, memory_mb: int = 512, partial: bool = False):
  """A `code_reward` with other limits, for configs."""
  limits = sandbox.SandboxLimits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb)
  return functools.partial(code_reward, limits=limits, partial=partial)
