"""launch.make_data: the --out suffix picks the format, and bad flags or paths give one line, no traceback."""

import os
import subprocess
import sys

import pytest

from rlax.data import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  return subprocess.run([sys.executable, "-m", "launch.make_data", "--task=arithmetic", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_parquet_out_is_parquet(tmp_path):
  out = tmp_path / "x.parquet"
  r = _run("--n=4", f"--out={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  assert out.read_bytes()[:4] == b"PAR1" and len(records.read_records(str(out))) == 4


@pytest.mark.parametrize("flag, message", [
    ("--n=-5", "rlax: bad command line: flag --n=-5: -5 is not a positive integer"),
    ("--difficulty=0", "rlax: bad command line: flag --difficulty=0: 0 is not a positive integer"),
    ("--out={tmp}", "make_data: cannot write records to {tmp}: it is a directory"),
    ("--out={tmp}/x.csv", "make_data: unsupported record file '{tmp}/x.csv': expected .jsonl or .parquet"),
    ("--out=/proc/rlax-x.jsonl", "make_data: cannot write records to /proc/rlax-x.jsonl: "),
])
def test_bad_flags_and_paths_are_one_line(tmp_path, flag, message):
  flag = flag.format(tmp=tmp_path)
  r = _run("--n=3", flag, *([] if flag.startswith("--out") else [f"--out={tmp_path}/y.jsonl"]))
  assert r.returncode == 2
  assert r.stderr.strip().startswith(message.format(tmp=tmp_path)), r.stderr
  assert len(r.stderr.strip().splitlines()) == 1
