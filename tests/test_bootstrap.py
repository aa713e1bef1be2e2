"""`python -m launch.main` from a clone not installed yet installs the project, then runs the command again;
once (a failed install or a second miss ends with one line naming the command to run)."""

import subprocess
import sys

import pytest

from launch import _bootstrap


def test_nothing_happens_when_installed(monkeypatch):
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
  _bootstrap.ensure_installed()


def test_missing_module_installs_the_clone_then_reruns_the_command(monkeypatch):
  ran = []
  monkeypatch.setattr(_bootstrap, "_NEEDED", ("absl", "no_such_module_rlax"))
  monkeypatch.delenv(_bootstrap._GUARD, raising=False)
  monkeypatch.setattr(subprocess, "run", lambda cmd: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
  monkeypatch.setattr(_bootstrap.os, "execv", lambda exe, argv: ran.append(argv) or sys.exit(7))
  with pytest.raises(SystemExit) as e:
    _bootstrap.ensure_installed()
  assert e.value.code == 7
  assert ran[0] == [sys.executable, "-m", "pip", "install", "-q", "-e", _bootstrap.ROOT]
  assert ran[1] == [sys.executable, *sys.orig_argv[1:]] and _bootstrap.os.environ[_bootstrap._GUARD] == "1"


@pytest.mark.parametrize("guard,pip_rc,says", [("1", 0, "install the project first: pip install -e"),
                                               ("", 1, "failed (see above)")])
def test_one_line_when_it_cannot_install(monkeypatch, capsys, guard, pip_rc, says):
  monkeypatch.setattr(_bootstrap, "_NEEDED", ("no_such_module_rlax",))
  monkeypatch.setenv(_bootstrap._GUARD, guard)
  monkeypatch.setattr(subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, pip_rc))
  monkeypatch.setattr(_bootstrap.os, "execv", lambda *a: pytest.fail("re-ran"))
  with pytest.raises(SystemExit) as e:
    _bootstrap.ensure_installed()
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and says in err[-1] and "no_such_module_rlax" in " ".join(err)
