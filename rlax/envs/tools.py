"""Tools from plain Python functions, run in the verifier processes so that no call can stall the run.

    def calculator(expression: str) -> str:
      '''Evaluates an arithmetic expression of integers with + - * / ** and parentheses.'''
    tool = Tool.from_function(calculator)     # name, description, JSON schema of the typed arguments
    runner = ToolRunner(pool, [tool], timeout_s=5, output_chars=1000)
    results = await runner.run(calls)         # [ToolResult(output, outcome)], one per call, in order

A call runs in a grading process of the `VerifierPool` under its deadline and address-space cap, and like
every job there its whole process tree dies with it (`rlax.rewards.processes`); its output is cut to
`output_chars` inside that process (a 10 MB answer never crosses the pipe) and comes back as JSON. A tool
whose function is a coroutine (`async def`) is a client of a service the run owns (the search tool's
retrieval service): it runs on the episode's event loop under the same deadline, never on policy code. A tool
that cannot be pickled (sent to a worker) is refused when the ToolRunner is built, with one ValueError line,
unless `in_process=True` opts in to run it in threads of this process, where a hung call cannot be stopped
and no memory cap applies. A malformed call, an unknown tool, bad or too long arguments, an exception, a
timeout or the memory cap become an error observation with an outcome from `rlax.envs.base.CALL_OUTCOMES`,
never a crash or a dropped turn. Tools that run policy-written code go through the code sandbox (`python`).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import json
import operator
import typing
from typing import Callable, Optional, Sequence

from absl import logging

from rlax import pysource
from rlax.envs.renderers import ToolCall
from rlax.rewards import pool, processes
from rlax.rewards import sandbox

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclasses.dataclass(frozen=True)
class Tool:
  name: str
  fn: Callable
  description: str
  parameters: dict  # JSON schema of the arguments
  version: str = ""  # what else its results depend on (a corpus's key): part of the journal's fingerprint

  @classmethod
  def from_function(cls, fn: Callable, name: Optional[str] = None, version: str = "") -> "Tool":
    """A tool named after `fn` (or `name`), described by its docstring's first paragraph, with a JSON schema
    from its type hints (str, int, float, bool, list, dict); arguments without a default are required."""
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
      typ = hints.get(p.name, str)
      if typ not in _JSON_TYPES:
        raise ValueError(f"tool {fn.__name__}: argument {p.name} has type {typ}; use one of "
                         f"{', '.join(t.__name__ for t in _JSON_TYPES)}")
      props[p.name] = {"type": _JSON_TYPES[typ]}
      if p.default is inspect.Parameter.empty:
        required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    return cls(name or fn.__name__, fn, doc.split("\n\n")[0].strip(),
               {"type": "object", "properties": props, "required": required}, version)

  @property
  def is_async(self) -> bool:
    return inspect.iscoroutinefunction(self.fn)

  def schema(self) -> dict:
    """The OpenAI-style function schema chat templates take as `tools=`."""
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}

  def check(self, arguments: dict) -> Optional[str]:
    """Why `arguments` do not fit the schema, or None."""
    props, req = self.parameters["properties"], self.parameters["required"]
    missing = [k for k in req if k not in arguments]
    extra = [k for k in arguments if k not in props]
    if missing or extra:
      return f"{self.name}: missing arguments {missing}, unknown arguments {extra}"
    for k, v in arguments.items():
      want = next(t for t, n in _JSON_TYPES.items() if n == props[k]["type"])
      if not isinstance(v, want) or (want is int and isinstance(v, bool)):
        return f"{self.name}: argument {k} must be {props[k]['type']}, got {type(v).__name__}"
    return None


@dataclasses.dataclass(frozen=True)
class ToolResult:
  output: str
  outcome: str  # one of rlax.envs.base.CALL_OUTCOMES


class _Invoke:
  """What a grading process runs for one call: `fn(**json.loads(arguments))`, its text cut to `limit` chars."""

  def __init__(self, fn: Callable, limit: int):
    self.fn, self.limit = fn, limit
    self.sandbox_wall_s = pool.sandbox_wall_s(fn)  # the pool's deadline covers it

  def __call__(self, arguments: str, record) -> tuple[float, dict]:
    out = str(self.fn(**json.loads(arguments)))
    return 0.0, {"output": out[:self.limit], "truncated": len(out) > self.limit}


class ToolRunner:
  """Runs tool calls in a VerifierPool; see the module docstring. available=False answers every call
  "unavailable" without running it (a control run: what the policy gains without the tool). With a
  `journal` (rlax.envs.journal.ToolJournal), a turn's results are journaled under its key and replayed when
  the same turn comes again (a resumed run). in_process=True: the opt-in for tools that cannot be pickled."""

  def __init__(self, pool, tools: Sequence[Tool], *, timeout_s: float = 5.0, output_chars: int = 1000,
               available: bool = True, journal=None, in_process: bool = False):
    self.pool, self.timeout_s, self.output_chars, self.available = pool, timeout_s, output_chars, available
    self.journal = journal if journal is None else journal.bind(tools, available, output_chars, timeout_s)
    self.in_process = in_process
    self.tools = {t.name: t for t in tools}
    self._invoke = {t.name: _Invoke(t.fn, output_chars) for t in tools if not t.is_async}
    for name, invoke in self._invoke.items():
      try:
        processes.dumps(invoke)
      except Exception as e:  # pylint: disable=broad-except
        if not in_process:
          why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
          raise ValueError(f"tool {name!r} cannot be sent to a grading process ({why}): make it a module-level "
                           "function, or opt in with ToolRunner(in_process=True) to run it in this process with "
                           "no kill and no memory cap") from None

  def check(self, call: ToolCall) -> Optional[ToolResult]:
    """The error observation of a call that cannot run (unknown tool, arguments off the schema), or None."""
    tool = self.tools.get(call.name)
    if tool is None:
      return ToolResult(f"error: unknown tool {call.name[:64]!r}; tools: {', '.join(self.tools)}", "unknown_tool")
    bad = tool.check(call.arguments) if isinstance(call.arguments, dict) else "the arguments must be an object"
    return ToolResult(f"error: {bad}", "bad_arguments") if bad else None

  async def run(self, calls: Sequence[ToolCall], key: Optional[Sequence[int]] = None) -> list[ToolResult]:
    """One result per call, in order, whatever the calls hold (never raises); the valid calls run in parallel
    in the pool. `key` (a turn's `Turn.key`): the journal's entry for the turn, replayed or written."""
    try:
      raw = [c.raw or json.dumps([c.name, c.arguments], default=repr) for c in calls]
      if self.journal is not None and key is not None:
        hit = self.journal.get(key, raw)
        if hit is not None:
          return [ToolResult(*r) for r in hit]
      results = await self._run(calls)
      if self.journal is not None and key is not None and calls:
        self.journal.put(key, raw, [[r.output, r.outcome] for r in results])
      return results
    except Exception as e:  # pylint: disable=broad-except
      logging.exception("tool calls failed")
      return [ToolResult(f"error: the tool runner failed: {type(e).__name__}", "tool_error") for _ in calls]

  async def _run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
    results: list[Optional[ToolResult]] = [self.check(c) for c in calls]
    if not self.available:
      return [r or ToolResult("error: the tool is unavailable", "tool_error") for r in results]
    here = [i for i, r in enumerate(results) if r is None and self.tools[calls[i].name].is_async]
    todo = [i for i, r in enumerate(results) if r is None and i not in here]
    served = asyncio.gather(*(self._serve(calls[i]) for i in here))
    if todo:
      batch = self.pool.submit([self._invoke[calls[i].name] for i in todo],
                               [json.dumps(calls[i].arguments) for i in todo], [None] * len(todo), self.timeout_s,
                               quiet=True,  # outcomes are counted per step (env/calls_<outcome>)
                               in_process=self.in_process)
      graded = await asyncio.to_thread(batch.results)
      for i, (_, info) in zip(todo, graded):
        results[i] = _result(info, self.timeout_s)
    for i, r in zip(here, await served):
      results[i] = r
    return results

  async def _serve(self, call: ToolCall) -> ToolResult:
    """An async tool's call on this event loop, under the deadline; its output cut as in a process."""
    try:
      out = str(await asyncio.wait_for(self.tools[call.name].fn(**call.arguments), self.timeout_s))
    except asyncio.TimeoutError:
      return ToolResult(f"error: the tool did not finish within {self.timeout_s:g}s", "timeout")
    except Exception as e:  # pylint: disable=broad-except
      return ToolResult(f"error: {type(e).__name__}: {e}"[:500], "tool_error")
    if len(out) > self.output_chars:
      return ToolResult(out[:self.output_chars], "truncated")
    return ToolResult(out, "ok")


def _result(info: dict, timeout_s: float) -> ToolResult:
  """A call's observation from what the pool gave back."""
  if info.get("timeout"):
    return ToolResult(f"error: the tool did not finish within {info.get('deadline_s', timeout_s):g}s", "timeout")
  if info.get("too_long"):
    size = str(info.get("reason", "")).removeprefix("completion too long: ")
    return ToolResult(f"error: the arguments are too long: {size}"[:500], "bad_arguments")
  if info.get("error"):
    reason = str(info.get("reason", "")).removeprefix("grader error: ")
    return ToolResult(f"error: {reason}"[:500], "tool_error")
  if not isinstance(info.get("output"), str):
    return ToolResult("error: the tool gave no output", "tool_error")
  return ToolResult(info["output"], "truncated" if info.get("truncated") else "ok")


PYTHON_LIMITS = sandbox.SandboxLimits()  # the `python` tool's jobs


def python(code: str) -> str:
  """Runs a Python program (standard library only, no network) and returns what it printed.

  Policy-written code: it runs in the code sandbox (`rlax.rewards.sandbox.run_program`, the only way a tool
  may run it), whose wall clock the pool's deadline for the call covers."""
  res = sandbox.run_program(code, limits=PYTHON_LIMITS)
  return res.output if res.status == "ok" else f"{res.output}\n[{res.status} after {res.wall_s:.1f}s]".lstrip("\n")


python.sandbox_wall_s = PYTHON_LIMITS.wall_s


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _eval(node):
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
    return node.value
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    return -_eval(node.operand) if isinstance(node.op, ast.USub) else _eval(node.operand)
  raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression of numbers with + - * / // % ** and parentheses.

  Runs in a verifier process: a huge power (9**9**9**9) runs into the call's deadline or memory cap there."""
  value = _eval(pysource.parse(expression.replace("×", "*").replace("x", "*"), mode="eval"))
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  return str(value)
