"""A user's object named by import path, "module:attr", as configs name rewards and environments."""

from __future__ import annotations

import importlib
from typing import Any


def by_path(spec: str, label: str, kind: str) -> Any:
  """The callable at "module:attr"; one ValueError starting with `label` when it does not import or is not
  callable (`kind`: what it should be, e.g. "a function")."""
  module, _, attr = spec.partition(":")
  try:
    obj = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"{label}: cannot import it ({type(e).__name__}: {e})") from None
  if not callable(obj):
    raise ValueError(f"{label} is not {kind}")
  return obj
