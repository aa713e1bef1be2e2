"""Background work of a run (the trainer's compile-ahead, the starting policy's evaluation beside the first steps):
its value, its error, a tolerated error, and the summary of a run whose starting evaluation lost its slice."""

import threading

import pytest

from rlax.run.compiles import Background
from rlax.runtime import summary as summary_lib
from rlax.topology import SliceLostError


def test_value_error_and_readiness():
  gate = threading.Event()
  job = Background(lambda: gate.wait() and {"pass@1": 0.5})
  assert not job.ready()
  gate.set()
  assert job.wait() == {"pass@1": 0.5} and job.ready()
  assert Background.done(3).ready() and Background.done(3).wait() == 3

  def lost():
    raise SliceLostError(2)

  with pytest.raises(SliceLostError):
    Background(lost).wait()
  assert Background(lost, "eval-before", (SliceLostError,)).wait() is None  # logged, not raised


def test_a_lost_starting_evaluation_is_reported_as_none():
  summary = {}
  after = {"pass@1": 0.6, "pass@8": 0.75}
  summary_lib.add_evals(summary, None, after, 8, [{"step": 0}, {"step": 1, "eval_pass1": 0.4}, {"step": 2}])
  assert summary["pass1_before"] is None and summary["pass8_before"] is None and summary["pass1_after"] == 0.6
  assert summary["curve"] == {"step": [0, 2, 3], "pass1": [None, 0.4, 0.6]}
