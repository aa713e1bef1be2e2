"""What a newcomer sees: no tcmalloc re-exec line and no math-verify 'timeout disabled' warning."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = """
from absl import logging
logging.set_verbosity(logging.INFO)
logging.use_absl_handler()
from rlax.allocator import set_up
set_up()
from rlax import rewards
from rlax.data.records import Record
rec = Record(id="1", prompt="p", answer="1")
assert rewards.math_reward(r"\\boxed{1}", rec)[0] == 1.0
with rewards.VerifierPool(num_workers=1, timeout_s=60) as pool:
  assert pool.grade(rewards.math_reward, [r"\\boxed{2}"], [rec])[0][0] == 0.0
print("done")
"""


def test_startup_and_grading_are_quiet():
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RLAX_TCMALLOC")}
  out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]
  assert "re-executing" not in out.stderr
  assert "Timeout is disabled" not in out.stderr
