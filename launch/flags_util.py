"""Flags that several entry points share, defined here once; a bad --config or override exits with one line."""

import ast
import importlib.util
import logging as py_logging
import os
import sys

from absl import flags
from absl import logging
from ml_collections import config_flags

flags.disclaim_key_flags()  # flags defined here belong to the calling entry point (its --help lists them)

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.py")


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
  sys.argv[:] = _take_open_dict_overrides(sys.argv)  # ml_collections reads sys.argv here
  try:
    return config_flags.DEFINE_config_file("config", default, "Config file (configs/*.py[:arg]).")
  except Exception as e:  # ml_collections raises AttributeError/KeyError/ValueError for bad overrides
    _die(e)


def config_args() -> dict[str, str]:
  """{"config": path, "config.<field>": value} as given on this command line, to pass on to launch.main."""
  fv = flags.FLAGS
  out = {"config": fv["config"].serialize().split("=", 1)[1]}
  for name in fv:
    if name.startswith("config.") and fv[name].present:
      arg = fv[name].serialize()  # booleans serialize as --config.x / --noconfig.x
      out[name] = arg.split("=", 1)[1] if "=" in arg else str(arg == f"--{name}").lower()
  out.update(_SET_AFTER)
  return out


def _quiet_orbax(record) -> bool:
  if "orbax" not in record.pathname:
    return True
  record.exc_info = record.exc_text = None
  return record.levelno >= logging.converter.STANDARD_WARNING


def quiet_library_logs() -> None:
  """Keeps libraries' noise off a user's console: orbax logs every file operation at INFO (its warnings stay,
  its errors without the traceback: rlax raises the same failure as one line), and JAX's failed TPU probe
  where no TPU software is installed. Callers: launch.main, launch.evaluate, launch.search_index."""
  logging.get_absl_handler().addFilter(_quiet_orbax)
  if importlib.util.find_spec("libtpu") is None:
    py_logging.getLogger("jax._src.xla_bridge").addFilter(
        lambda r: not r.getMessage().startswith("Unable to initialize backend 'tpu'"))


def define_cpu_devices(default: int = 8) -> flags.FlagHolder[int]:
  """--cpu_devices; `apply_cpu_devices` applies it (a `launch.multihost` job passes it to `init_from_env`)."""
  return flags.DEFINE_integer("cpu_devices", default, "Fake CPU devices when JAX runs on CPU (per process in a "
                              "launch.multihost job).")


def define_compilation_cache() -> flags.FlagHolder[str]:
  """--compilation_cache; `apply_compilation_cache` applies it."""
  return flags.DEFINE_string("compilation_cache", os.path.join("~", ".cache", "rlax", "xla"),
                             "Directory of XLA's persistent compilation cache (\"\" turns it off): a rerun, "
                             "a resume or the next evaluation loads its programs instead of compiling them.")


def apply_compilation_cache() -> None:
  """Points JAX's persistent compilation cache at --compilation_cache (unless JAX_COMPILATION_CACHE_DIR is set);
  programs that compile in under a second are not worth a file."""
  import jax
  path = flags.FLAGS.compilation_cache
  if not path or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def define_workdir(default, help_text: str) -> flags.FlagHolder[str]:
  """--workdir: a run's directory (default None: required)."""
  return flags.DEFINE_string("workdir", default, help_text, required=default is None)


def define_step(help_text: str) -> flags.FlagHolder[int]:
  """--step: a checkpoint step (default None: the newest)."""
  return flags.DEFINE_integer("step", None, help_text)


def define_task(default, help_text: str) -> flags.FlagHolder[str]:
  """--task: a task as data.task names it (a built-in generator, reasoning_gym:<dataset>, or a mixture)."""
  return flags.DEFINE_string("task", default, help_text)


def define_out(help_text: str) -> flags.FlagHolder[str]:
  """--out: where an entry point writes its result (required)."""
  return flags.DEFINE_string("out", None, help_text, required=True)


def apply_cpu_devices() -> None:
  """Gives JAX's CPU backend --cpu_devices devices; call after flag parsing, before the first JAX operation.

  JAX picks the CPU backend only when no accelerator is found, so the count is moot on TPU/GPU hosts. Skipped
  when jax_platforms excludes the CPU and in a `launch.multihost` job, whose processes get their devices
  from `rlax.multihost.init_from_env(cpu_devices=...)`.
  """
  import jax
  from rlax import multihost
  platforms = jax.config.jax_platforms
  if multihost.ENV_PROCESS_ID in os.environ or (platforms and "cpu" not in platforms.split(",")):
    return
  jax.config.update("jax_num_cpu_devices", flags.FLAGS.cpu_devices)


# `--config.model.overrides.<key>=v` (and algorithm's, and teacher.routes): these dicts hold only the keys a
# config file sets, so ml_collections cannot override any other key (`--config.model.overrides.dtype=bfloat16` on
# the demo); such flags are set after parsing instead, their values read as Python literals (else as strings).
_OPEN_DICTS = ("config.model.overrides.", "config.algorithm.overrides.", "config.teacher.routes.")
_SET_AFTER: dict[str, str] = {}


def _take_open_dict_overrides(argv: list[str]) -> list[str]:
  """argv without the `_OPEN_DICTS` overrides, which go to `_SET_AFTER`."""
  rest = []
  for arg in argv:
    name = arg[2:].split("=", 1)[0]
    if arg.startswith("--") and "=" in arg and name.startswith(_OPEN_DICTS) and name.count(".") == 3:
      _SET_AFTER[name] = arg.split("=", 1)[1]
    else:
      rest.append(arg)
  return rest


def _set_after_parsing() -> None:
  config = flags.FLAGS["config"].value
  try:
    config.keys()  # ml_collections hands back a stand-in that raises when the file failed to load
  except Exception as e:
    cause = e.__cause__ or e
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    print(f"rlax: bad command line: --config={flags.FLAGS['config'].serialize().split('=', 1)[-1]}: "
          f"{lines[-1] if lines else type(cause).__name__}", file=sys.stderr)
    sys.exit(2)
  for name, text in _SET_AFTER.items():
    _, section, field, key = name.split(".")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    with config.unlocked():
      config[section][field][key] = value


def parse_or_exit(argv):
  """absl `flags_parser` for `app.run`: parses argv, or prints one line and exits 2."""
  try:
    parsed = flags.FLAGS(_take_open_dict_overrides(argv) if "config" in flags.FLAGS else argv)
  except SystemExit as e:  # absl's --help/--helpfull print usage and exit 1; asking for help is no error
    sys.exit(0 if e.code == 1 else e.code)
  except Exception as e:  # absl wraps config errors in many types; all mean "bad command line".
    _die(e)
  if "config" in flags.FLAGS:
    _set_after_parsing()
  return parsed
