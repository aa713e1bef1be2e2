"""Flag handling that turns a bad --config or override into one clear line instead of a traceback."""

import sys

from absl import flags
from ml_collections import config_flags


def _die(e: BaseException):
  text = str(e).replace("\\n", "\n")
  lines = [ln.strip().strip("'\"\\") for ln in text.splitlines() if ln.strip()]
  # Config-file errors embed a traceback whose last line is the error itself.
  msg = lines[-1] if "Traceback" in text else " ".join(lines)
  if lines and lines[0].startswith("flag --") and not msg.startswith("flag --"):
    msg = f"{lines[0].split(':')[0]}: {msg}"
  print(f"rlax: bad command line: {msg or type(e).__name__}", file=sys.stderr)
  sys.exit(2)


def define_config(default: str):
  """DEFINE_config_file; ml_collections checks `--config.x=` overrides here, so a typo exits at once."""
  try:
    return config_flags.DEFINE_config_file("config", default, "Config file (configs/*.py[:arg]).")
  except Exception as e:  # ml_collections raises AttributeError/KeyError/ValueError for bad overrides
    _die(e)


def parse_or_exit(argv):
  """absl `flags_parser` for `app.run`: parses argv, or prints one line and exits 2."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # absl wraps config errors in many types; all mean "bad command line".
    _die(e)
