"""The progress bar times the steps, not the start-up before the first one: its first rate is the first step's; the
peak-memory metric counts GB."""

import re
import time

import pytest

from rlax import metrics


@pytest.mark.parametrize("done", [0, 2])
def test_the_first_rate_is_the_first_steps_own(tmp_path, capsys, done):
  w = metrics.MetricsWriter(str(tmp_path), total_steps=4, progress=True, history=[{"step": i} for i in range(done)])
  time.sleep(1.5)  # start-up: loading, compiling, the evaluation before
  w.write(done, {"step_s": 2.0})
  w.close()
  err = capsys.readouterr().err
  shown = re.findall(rf"{done + 1}/4 \[(\d\d):(\d\d)<[^,]*, +([\d.]+)s/it", err)
  assert shown, err
  minutes, seconds, per_step = shown[-1]
  assert int(minutes) * 60 + int(seconds) == 2 and 1.9 < float(per_step) < 2.5


def test_the_peak_rss_metric_is_in_gb():
  from rlax.runtime import step
  with open("/proc/self/status") as f:  # VmHWM: the peak resident set, in kB (KiB)
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
  # ru_maxrss counts KiB: / 1e6 would read 2.4% low
  assert abs(step.peak_rss_gb() - hwm * 1024 / 1e9) < 0.01 * hwm * 1024 / 1e9
