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
