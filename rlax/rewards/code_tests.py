"""Tests run outside the sandbox: the solution computes values, the grader does everything else.

A test is Python statements (`assert f(2) == 4`; `x = f(3)` then `assert x[0] == 1`; a loop collecting
`f(i)`; a helper `def check(a, b): return f(a) == b`; `s = MinStack()`, `s.push(1)`, `assert s.top() == 1`).
The grader runs every statement here, with each subexpression that needs the solution — a call of one of its
functions, a name it defined — replaced by a *probe*: evaluated inside the sandbox
(rlax.rewards.sandbox.Oracle) on arguments computed here and sent in as plain values, and returned as
type-tagged JSON of exact builtin types (rlax.rewards.code_values). Anything else the solution returns stays
inside behind a `Ref`: it can be called, read, measured and iterated (each giving plain values), never
compared. Comparisons, expected values, the test's variables, helpers and classes, and the builtins and
trusted stdlib modules around the probes all stay here, on values the solution never held; a solution's own
`abs` or `sorted` is never called by the test. Mutable arguments a call changed in place come back changed.

So an object whose `__eq__` is always true, an `int` subclass, a patched builtin or module, a faked print or
reply, an early exit, a taken-over reply loop, or reading the tests from files, frames or `gc` gains nothing:
what enters the sandbox is the solution, the probed expressions and their argument values. Only imports of
modules outside TRUSTED_MODULES run inside (and calls into them are refused). A test without an `assert`, and
one that never calls the solution, fails.
"""

from __future__ import annotations

import ast
import builtins
import collections
import copy
import dataclasses
import importlib
from typing import Optional, Sequence

from rlax import pysource
from rlax.rewards import code_values
from rlax.rewards import sandbox

# Names a test uses around its probes, always evaluated here (a solution's own `abs` is never the test's).
SAFE_BUILTINS = ("abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "chr", "complex", "dict",
                 "divmod", "enumerate", "filter", "float", "format", "frozenset", "hash", "hex", "int",
                 "isinstance", "iter", "len", "list", "map", "max", "min", "next", "oct", "ord", "pow", "print",
                 "range", "repr", "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "type",
                 "zip", "True", "False", "None", "Exception", "ArithmeticError", "AssertionError", "ValueError",
                 "TypeError", "KeyError", "IndexError", "ZeroDivisionError", "RuntimeError", "StopIteration")
TRUSTED_MODULES = ("math", "cmath", "collections", "itertools", "functools", "operator", "string", "re",
                   "fractions", "decimal", "statistics", "heapq", "bisect", "random", "copy", "json", "datetime",
                   "contextlib", "typing", "dataclasses", "enum", "textwrap", "unicodedata")
_SCOPES = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda, ast.FunctionDef)
PROBE, ARG, HANDLE = "__rlax_probe__", "__rlax_a", "__rlax_h"


ProbeError = code_values.Failed  # a probe failed inside the sandbox (refused value, crash, timeout)


def _stored(node: ast.AST) -> set[str]:
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}


def _bound(node: ast.AST) -> set[str]:
  """Names a comprehension, lambda or function binds for its own body (they live here)."""
  out = set()
  for n in ast.walk(node):
    if isinstance(n, ast.comprehension):
      out |= _stored(n.target)
    elif isinstance(n, (ast.Lambda, ast.FunctionDef)):
      out |= {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
      if isinstance(n, ast.FunctionDef):
        out |= _stored(n) | {n.name}
  return out


def free_names(node: ast.AST) -> set[str]:
  used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
  return used - _bound(node)


class Split(ast.NodeTransformer):
  """Replaces the subtrees that need the solution by probe calls. `trusted`: names evaluated here that are
  no value of the test's (builtins, trusted modules); `local`: the test's own variables, which live here.
  `probes[k]` is (source evaluated inside, names of the values sent in, whether it constructs an object: a
  call of a capitalized name, `MinStack()`); one list for the whole test, so a helper function defined by one
  statement finds its probes when a later one calls it."""

  def __init__(self, trusted: set[str], local: set[str], probes: list):
    self.trusted, self.bound, self.probes = trusted, [set(local)], probes

  def tainted(self, node) -> bool:
    return any(n not in self.trusted and n not in self.bound[-1] for n in free_names(node))

  def visit(self, node):
    if not isinstance(node, ast.AST) or not self.tainted(node):
      return node
    if isinstance(node, _SCOPES):
      self.bound.append(self.bound[-1] | _bound(node))
      try:
        return self.generic_visit(node)
      finally:
        self.bound.pop()
    if isinstance(node, ast.Name) or isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
        self.tainted(node.func):
      return self.probe(node)  # `f(x)`, `Solution()`, a name the solution defined
    if isinstance(node, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
      return self.probe(node)
    return self.generic_visit(node)  # operators, calls of ours, `.attr` and `[i]` of a value or Ref: here

  def probe(self, node) -> ast.Call:
    """`node` evaluated inside; its call's arguments are computed here and sent as values (lambdas and
    comprehensions, which cannot cross, stay in the source with the values of the names they use)."""
    sent: dict[str, ast.expr] = {}

    def hoist(arg):
      if isinstance(arg, ast.Starred):
        return ast.Starred(hoist(arg.value), ast.Load())
      if any(isinstance(n, _SCOPES) for n in ast.walk(arg)):
        return arg
      name = f"{ARG}{len(self.probes)}_{len(sent)}"
      sent[name] = self.visit(arg)
      return ast.Name(name, ast.Load())

    ctor = False
    if isinstance(node, ast.Call):
      node = ast.Call(node.func, [hoist(a) for a in node.args], [ast.keyword(k.arg, hoist(k.value))
                                                                 for k in node.keywords])
      ctor = node.func.id[:1].isupper()
    for name in sorted(free_names(node) & self.bound[-1]):
      sent.setdefault(name, ast.Name(name, ast.Load()))
    self.probes.append((ast.unparse(node), tuple(sent), ctor))
    return ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(len(self.probes) - 1),
                                                  ast.Dict([ast.Constant(n) for n in sent], list(sent.values()))],
                    [])


def _imports(node) -> list[tuple[str, str, str, bool]]:
  """(name bound, module, attribute or '', whether the module is trusted) of an import statement; a `*` from
  a trusted module is expanded to its public names."""
  if isinstance(node, ast.Import):
    return [(a.asname or a.name.split(".")[0], a.name.split(".")[0], "", a.name.split(".")[0] in TRUSTED_MODULES)
            for a in node.names]
  trusted = node.module in TRUSTED_MODULES and not node.level
  out = []
  for a in node.names:
    if a.name == "*" and trusted:
      module = importlib.import_module(node.module)
      public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
      out += [(n, node.module, n, True) for n in public]
    else:
      out.append((a.asname or a.name, node.module or "", a.name, trusted))
  return out


def plan(test: str) -> ast.Module:
  """The parsed test; ValueError when it does not parse or has no assert."""
  try:
    tree = pysource.parse(test)
  except pysource.PARSE_ERRORS as e:
    raise ValueError(f"test {test[:80]!r} is not valid Python: {getattr(e, 'msg', e)}") from None
  if not any(isinstance(n, ast.Assert) for n in ast.walk(tree)):
    raise ValueError(f"test {test[:80]!r} has no assert statement, so it cannot fail; write tests with "
                     "`assert <expression>`")
  return tree


def validate(tests: Sequence[str]) -> list[ast.Module]:
  """Every test parsed (a record's tests are checked before any grading)."""
  return [plan(t) for t in tests]


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Outcome: status is 'ok' (the solution loaded and every test was graded), 'timeout', 'output_limit',
  'tampered' or 'crashed'; `passed` of `total` tests held."""
  status: str
  passed: int
  total: int
  error: str
  wall_s: float
  output: str

  @property
  def all_passed(self) -> bool:
    return self.status == "ok" and self.total > 0 and self.passed == self.total


def run_tests(code: str, tests: Sequence[str], limits=None) -> SandboxResult:
  """Grades `code` on `tests` (see the module docstring). Never raises for anything the code does; a test that
  cannot be parsed or has no assert is a ValueError before anything runs."""
  trees = validate(tests)
  limits = limits or sandbox.SandboxLimits()
  passed, error = 0, ""
  with sandbox.Oracle(code, limits) as oracle:
    if oracle.error:
      error = oracle.error
    else:
      for i, tree in enumerate(trees):
        why = _Test(oracle).run(tree)
        passed += not why
        error = error or (f"test {i}: {why}" if why else "")
    status, output = oracle.close()
  if status == "ok" and oracle.error and not oracle.error.startswith("solution"):
    status = "crashed"
  return SandboxResult(status, passed if status == "ok" else 0, len(tests),
                       error if status == "ok" else f"{status}: {error}" if error else status, oracle.wall_s,
                       output[-2000:])


class _Test:
  """One test's run: its statements here, its probes through the oracle, the solution's objects as Refs."""

  def __init__(self, oracle):
    self.oracle = oracle
    self.trusted = set(SAFE_BUILTINS)  # always ours: a solution's own `abs` never sees the test's values
    self.local: set[str] = set()
    safe = {n: getattr(builtins, n) for n in SAFE_BUILTINS if hasattr(builtins, n)}
    safe["__import__"] = _trusted_import
    safe["__build_class__"] = builtins.__build_class__  # the test's own classes (a dataclass of cases)
    self.scope = {"__builtins__": safe, PROBE: self._probe, "__name__": "rlax_test"}
    self.probes: list = []
    self.calls = 0  # requests made: each names its own handle

  def run(self, tree: ast.Module) -> str:
    """'' when every statement ran, every assert held and the solution was called, else the first failure
    (never raises)."""
    for node in tree.body:
      try:
        self._statement(node)
      except ProbeError as e:
        return str(e)[:300]
      except AssertionError:
        return f"assertion failed: {ast.unparse(node)[:200]}"
      except Exception as e:  # pylint: disable=broad-except  # the test's own code, on plain values
        return f"{type(e).__name__}: {str(e)[:200]}"
    return "" if self.calls else "the test never calls the solution"

  def _statement(self, node: ast.stmt):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      for name, mod, attr, trusted in _imports(node):
        self.local.discard(name)
        if not trusted:  # lives inside only
          self.trusted.discard(name)
          continue
        module = importlib.import_module(mod)
        self.scope[name] = getattr(module, attr) if attr else module
        self.trusted.add(name)
      why = self.oracle.exec(ast.unparse(node), {})  # the solution's probes may use the names too
      if why:
        raise ProbeError(why)
      return
    stored = _stored(node) | {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    self.local |= stored
    self.trusted -= stored
    new = Split(self.trusted, self.local, self.probes).visit(copy.deepcopy(node))  # the original, for messages
    code = compile(ast.fix_missing_locations(ast.Module([new], [])), "<test>", "exec")
    exec(code, self.scope)  # pylint: disable=exec-used  # the record's own test on plain values: trusted

  def request(self, src: str, values: dict, ctor: bool = False):
    """`src` evaluated inside with `values` bound: a plain value, or a Ref to what stays inside. Mutable
    arguments the evaluation changed in place are changed here too (`nums.sort()` in a solution)."""
    self.calls += 1
    handle = f"{HANDLE}{self.calls}"
    out = self.oracle.eval(src, self._encode(values), store=handle)
    for name, new in (out.get("after") or {}).items():
      if name in values:
        _update(values[name], self._decode(new))
    if out.get("stored"):
      return Ref(self, handle, ctor, str(out.get("type", "")), bool(out.get("callable")))
    if "value" not in out:
      raise code_values.raised(out)
    return self._decode(out["value"])

  def _probe(self, k: int, values: dict):
    src, _, ctor = self.probes[k]
    return self.request(src, values, ctor)

  @staticmethod
  def _encode(values: dict) -> dict:
    try:
      return {n: code_values.encode(v, refs=_handle_of) for n, v in values.items()}
    except ValueError as e:
      raise ProbeError(str(e)) from None

  @staticmethod
  def _decode(v):
    try:
      return code_values.decode(v)
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError, MemoryError,
            ArithmeticError) as e:
      raise ProbeError(f"malformed value: {type(e).__name__}") from None


def _update(obj, new) -> None:
  """Copies `new` into the test's mutable `obj` in place (a solution that sorts its argument)."""
  if type(obj) is not type(new) or type(obj) not in code_values.MUTABLE:
    return
  if isinstance(obj, (list, bytearray)):
    obj[:] = new
  else:
    obj.clear()
    (obj.extend if isinstance(obj, collections.deque) else obj.update)(new)


def _trusted_import(name, globals=None, locals=None, fromlist=(), level=0):  # pylint: disable=redefined-builtin
  """The test's `import` here: trusted stdlib modules only (others live inside, imported there)."""
  if level or name.split(".")[0] not in TRUSTED_MODULES:
    raise ImportError(f"the test cannot import {name} outside the sandbox")
  return importlib.__import__(name, globals, locals, fromlist, level)


def _handle_of(x) -> Optional[str]:
  return object.__getattribute__(x, "_handle") if type(x) is Ref else None


class Ref:
  """An object the solution made, which stays inside: calling it, reading its attributes and items, `len`,
  `str` and iteration run inside and give plain values (or more Refs). It never takes part in a comparison,
  a hash or a truth test here. Methods are called only on objects the test built itself from a class
  (`s = MinStack()`; `ctor`): a method of anything else (`f(2).startswith('a')` on an impostor of a str) would
  let the solution's object judge the test's value, and is refused."""
  __slots__ = ("_test", "_handle", "_ctor", "_type", "_callable")

  def __init__(self, test: _Test, handle: str, ctor: bool, type_name: str, is_callable: bool):
    for k, v in (("_test", test), ("_handle", handle), ("_ctor", ctor), ("_type", type_name),
                 ("_callable", is_callable)):
      object.__setattr__(self, k, v)

  def _ask(self, src: str, values: dict, ctor: bool = False):
    return object.__getattribute__(self, "_test").request(src, values, ctor)

  def _h(self) -> str:
    return object.__getattribute__(self, "_handle")

  def __getattr__(self, attr: str):
    if attr.startswith("__"):
      raise ProbeError(f"refused .{attr} of a solution's {object.__getattribute__(self, '_type')}")
    value = self._ask(f"{self._h()}.{attr}", {})
    get = object.__getattribute__
    if type(value) is Ref and get(value, "_callable") and not get(self, "_ctor"):
      raise ProbeError(f"refused .{attr}() of a {get(self, '_type')} the test did not build "
                       "(a method of it would judge the test's values inside)")
    return value

  def __setattr__(self, attr: str, value):
    self._ask(f"setattr({self._h()}, {attr!r}, __rlax_v)", {"__rlax_v": value})

  def __call__(self, *args, **kwargs):
    values = {f"__rlax_p{i}": a for i, a in enumerate(args)}
    values.update({f"__rlax_k{i}": v for i, v in enumerate(kwargs.values())})
    names = [f"__rlax_p{i}" for i in range(len(args))] + [f"{k}=__rlax_k{i}" for i, k in enumerate(kwargs)]
    return self._ask(f"{self._h()}({', '.join(names)})", values)

  def __getitem__(self, key):
    return self._ask(f"{self._h()}[__rlax_k]", {"__rlax_k": key})

  def __setitem__(self, key, value):
    self._ask(f"{self._h()}.__setitem__(__rlax_k, __rlax_v)", {"__rlax_k": key, "__rlax_v": value})

  def __len__(self):
    return self._ask(f"len({self._h()})", {})

  def __iter__(self):
    return iter(self._ask(f"list({self._h()})", {}))

  def __str__(self):
    return self._ask(f"str({self._h()})", {})

  def __repr__(self):
    return f"<the solution's {object.__getattribute__(self, '_type')}>"

  def _refuse(self, *_):
    raise ProbeError(f"a solution's {object.__getattribute__(self, '_type')} cannot be compared, hashed or "
                     "tested for truth (only plain values are)")

  __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __bool__ = __contains__ = _refuse
