"""Environments by name, so configs select them as they select rewards: `env.name="calculator"`, or a user's
class by import path, `env.name="my_pkg.envs:MyEnv"` (built as `MyEnv(ctx)` once per episode)."""

from __future__ import annotations

from typing import Callable

from rlax import imports
from rlax.envs.base import EnvContext, Environment
from rlax.envs.search_env import SearchEnv
from rlax.envs.tool_env import CalculatorEnv, RetryEnv, SingleTurnEnv

EnvFactory = Callable[[EnvContext], Environment]

_REGISTRY: dict[str, EnvFactory] = {"single_turn": SingleTurnEnv, "calculator": CalculatorEnv, "retry": RetryEnv,
                                       "search": SearchEnv}


def register(name: str, factory: EnvFactory, overwrite: bool = False) -> None:
  """Adds an environment class (or factory of ctx) under `name`."""
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"environment {name!r} is already registered")
  _REGISTRY[name] = factory


def get(name: str) -> EnvFactory:
  """The factory named `name`, or the class at "module:Class"; one ValueError naming what is wrong."""
  if ":" in name:
    return imports.by_path(name, f"env.name={name!r}", "a class or factory")
  if name not in _REGISTRY:
    raise ValueError(f"env.name={name!r}: unknown environment; registered: {', '.join(sorted(_REGISTRY))} "
                     "(or 'module:Class')")
  return _REGISTRY[name]


def names() -> list[str]:
  return sorted(_REGISTRY)
