"""`import rlax` is this checkout's package, not DeepMind's unrelated PyPI `rlax`."""

import ast
import os

import rlax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_resolves_to_this_checkout():
  assert os.path.realpath(rlax.__file__) == os.path.realpath(os.path.join(REPO, "rlax", "__init__.py"))


def test_distribution_name_is_not_rlax():
  with open(os.path.join(REPO, "setup.py")) as f:
    tree = ast.parse(f.read())
  names = [kw.value.value for node in ast.walk(tree) if isinstance(node, ast.Call)
           for kw in node.keywords if kw.arg == "name" and isinstance(kw.value, ast.Constant)]
  assert len(names) == 1
  assert names[0] != "rlax" and names[0].replace("_", "-").lower() != "rlax"


def test_every_module_rlax_imports_is_installed_by_its_core_or_an_extra():
  """A fresh `pip install -e .` holds what rlax imports, lazily imported modules too (jinja2, which renders
  every HF chat template, was once missing from it); optional integrations come from the extras."""
  import ast
  import importlib.metadata
  import pathlib
  import re
  import sys
  root = pathlib.Path(__file__).resolve().parent.parent
  setup = ast.parse((root / "setup.py").read_text())
  call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
  kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
  name = lambda req: re.split(r"[<>=\[;! ]", req, maxsplit=1)[0].lower().replace("_", "-")
  core = {name(r) for r in kw["install_requires"]}
  extras = {name(r) for reqs in kw["extras_require"].values() for r in reqs if name(r) != "pytest"} - {"torch"}
  dists = importlib.metadata.packages_distributions()
  missing = {}
  for path in (root / "rlax").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        mods = [node.module]
      else:
        continue
      for mod in mods:
        top = mod.split(".")[0]
        if top in sys.stdlib_module_names or top == "rlax":
          continue
        owners = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
        if not owners & (core | extras):
          missing.setdefault(top, str(path.relative_to(root)))
  assert not missing, f"imported by rlax but in no install_requires / extras_require: {missing}"
  assert "jinja2" in core
