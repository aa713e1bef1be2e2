"""`python -m launch.main` from a clone whose project is not installed yet: install it into this interpreter
(`pip install -e <clone>`, what the README's one command does first), then run the same command again.
Imports only the standard library, so it runs before any dependency exists."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NEEDED = ("absl", "ml_collections", "jax", "flax", "optax", "orbax", "grain", "tokenizers", "jinja2")
_GUARD = "RLAX_BOOTSTRAPPED"  # set for the re-run: install once, never loop


def ensure_installed() -> None:
  missing = [m for m in _NEEDED if importlib.util.find_spec(m) is None]
  if not missing:
    return
  how = f"pip install -e {ROOT}"
  if os.environ.get(_GUARD) or not os.path.exists(os.path.join(ROOT, "setup.py")):
    print(f"rlax: {', '.join(missing)} not installed; install the project first: {how}", file=sys.stderr)
    sys.exit(2)
  print(f"rlax: {', '.join(missing)} not installed; running `{how}` first", file=sys.stderr, flush=True)
  if subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", ROOT]).returncode:
    print(f"rlax: `{how}` failed (see above); the project's dependencies are not installed", file=sys.stderr)
    sys.exit(2)
  os.environ[_GUARD] = "1"
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
