"""Test statements run outside the sandbox: the solution computes values, the grader does everything else.

A test is Python statements (`assert f(2) == 4`; `x = f(3)` then `assert x[0] == 1`; a loop collecting
`f(i)`; a helper `def check(a, b): return f(a) == b`). The grader runs them here, statement by statement, with
every subexpression that needs the solution — a call of one of its functions, a name it defined, a method of
an object it made — replaced by a *probe*: evaluated inside the sandbox (rlax.rewards.sandbox.Oracle) on
arguments computed here and sent in as plain values, and returned as type-tagged JSON of exact builtin types
(rlax.rewards.code_values). Comparisons, expected values, the test's variables and helpers, and the builtins
and stdlib calls around the probes all stay here, on values the solution never held.

So an object whose `__eq__` is always true, an `int` subclass, a patched builtin or module, a faked print or
reply, an early exit, or reading the tests from files, frames or `gc` gains nothing: what enters the sandbox
is the solution, the probed expressions and their argument values. A statement that cannot run here (a class
definition, `with`, an import of a module outside the trusted stdlib list, an assignment into an object the
solution made) runs inside, with the values of the test variables it names; `s = Solution()` keeps the
object inside and later probes use it there. A test with no top-level `assert` is refused (ValueError).
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import importlib
from typing import Optional, Sequence

from rlax.rewards import code_values

# Names a test may use around its probes, evaluated here, unless the solution defines them at top level.
SAFE_BUILTINS = ("abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "chr", "complex", "dict",
                 "divmod", "enumerate", "filter", "float", "format", "frozenset", "hash", "hex", "int",
                 "isinstance", "iter", "len", "list", "map", "max", "min", "next", "oct", "ord", "pow", "print",
                 "range", "repr", "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "type",
                 "zip", "True", "False", "None", "Exception", "ArithmeticError", "AssertionError", "ValueError",
                 "TypeError", "KeyError", "IndexError", "ZeroDivisionError", "RuntimeError", "StopIteration")
TRUSTED_MODULES = ("math", "cmath", "collections", "itertools", "functools", "operator", "string", "re",
                   "fractions", "decimal", "statistics", "heapq", "bisect", "random", "copy")
# Nodes evaluated here when they hold a probe; a tainted node of any other kind becomes a probe.
_OUTSIDE = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Tuple, ast.List, ast.Set, ast.Dict,
            ast.Subscript, ast.Slice, ast.Starred, ast.JoinedStr, ast.FormattedValue, ast.keyword)
_SCOPES = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda, ast.FunctionDef)
# Statements run here (with probes); any other kind runs inside.
_HERE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.For, ast.While, ast.If, ast.Try, ast.Assert,
         ast.Pass, ast.Break, ast.Continue, ast.FunctionDef, ast.Return, ast.Delete)
PROBE, MEMBER, ARG = "__rlax_probe__", "__rlax_member__", "__rlax_a"
# Methods of plain values: on an object the solution made they would compare inside, so they are refused.
_PLAIN_ATTRS = frozenset(a for t in (str, bytes, int, float, complex, list, tuple, dict, set, frozenset) for a in dir(t))


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
  `probes[k]` is (source evaluated inside, names of the values sent in); one list for the whole test, so a
  helper function defined by one statement finds its probes when a later one calls it."""

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
    if not isinstance(node, ast.expr) or isinstance(node, _OUTSIDE + (ast.comprehension,)):
      return self.generic_visit(node)
    if isinstance(node, ast.Call) and not self.tainted(node.func):
      return self.generic_visit(node)  # `sorted(f(x))`, `math.isclose(f(x), 1.0)`, `res.append(f(i))`: ours
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute) and self.tainted(target.value):  # `f(x).strip()`, `s.solve(3)`
      receiver = self.probe(target.value)
      call = isinstance(node, ast.Call)
      args = ast.Tuple([self.visit(a) for a in node.args] if call else [], ast.Load())
      kw = ast.Dict([ast.Constant(k.arg) for k in node.keywords] if call else [],
                    [self.visit(k.value) for k in node.keywords] if call else [])
      return ast.Call(ast.Name(MEMBER, ast.Load()), [*receiver.args, ast.Constant(target.attr), ast.Constant(call),
                                                      args, kw], [])
    return self.probe(node)

  def probe(self, node) -> ast.Call:
    """`node` evaluated inside; the untainted arguments of its calls are computed here and sent as values."""
    sent: dict[str, ast.expr] = {}

    def hoist(arg):
      if isinstance(arg, ast.Starred):
        return ast.Starred(hoist(arg.value), ast.Load())
      if self.tainted(arg) or isinstance(arg, ast.Lambda) or any(isinstance(n, _SCOPES) for n in ast.walk(arg)):
        return arg
      name = f"{ARG}{len(self.probes)}_{len(sent)}"
      sent[name] = self.visit(arg)
      return ast.Name(name, ast.Load())

    class Hoist(ast.NodeTransformer):
      def visit_Call(self, call):  # pylint: disable=invalid-name
        self.generic_visit(call)
        call.args = [hoist(a) for a in call.args]
        call.keywords = [ast.keyword(k.arg, hoist(k.value)) for k in call.keywords]
        return call

    inner = Hoist().visit(node)
    for name in sorted(free_names(inner) & self.bound[-1]):
      sent[name] = ast.Name(name, ast.Load())
    self.probes.append((ast.unparse(inner), tuple(sent)))
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
  """The parsed test; ValueError when it does not parse or has no top-level assert."""
  try:
    tree = ast.parse(test)
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise ValueError(f"test {test[:80]!r} is not valid Python: {getattr(e, 'msg', e)}") from None
  if not any(isinstance(n, ast.Assert) for n in tree.body):
    raise ValueError(f"test {test[:80]!r} has no top-level assert statement, so it cannot be graded outside "
                     "the sandbox; write tests as `assert <expression>` lines")
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
  from rlax.rewards import sandbox  # pylint: disable=g-import-not-at-top  # sandbox imports the jail
  trees = validate(tests)
  limits = limits or sandbox.SandboxLimits()
  passed, error = 0, ""
  with sandbox.Oracle(code, limits) as oracle:
    if oracle.error:
      error = oracle.error
    else:
      for i, tree in enumerate(trees):
        why = _Test(oracle, set(oracle.defined)).run(tree)
        passed += not why
        error = error or (f"test {i}: {why}" if why else "")
    status, output = oracle.close()
  if status == "ok" and oracle.error and not oracle.error.startswith("solution"):
    status = "crashed"
  return SandboxResult(status, passed if status == "ok" else 0, len(tests),
                       error if status == "ok" else f"{status}: {error}" if error else status, oracle.wall_s,
                       output[-2000:])


class _Test:
  """One test's run: its variables here, its probes through the oracle."""

  def __init__(self, oracle, defined: set[str]):
    self.oracle = oracle
    self.trusted = set(SAFE_BUILTINS) - defined  # a solution's own `max` is probed, not ours
    self.local: set[str] = set()
    safe = {n: getattr(builtins, n) for n in SAFE_BUILTINS if hasattr(builtins, n)}
    self.scope = {"__builtins__": safe, PROBE: self._probe, MEMBER: self._member}
    self.probes: list = []

  def run(self, tree: ast.Module) -> str:
    """'' when every statement ran and every assert held, else the first failure (never raises)."""
    self.constructed = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    for node in tree.body:
      try:
        self._statement(node)
      except ProbeError as e:
        return str(e)[:300]
      except AssertionError:
        return f"assertion failed: {ast.unparse(node)[:200]}"
      except Exception as e:  # pylint: disable=broad-except  # the test's own code, on plain values
        return f"{type(e).__name__}: {str(e)[:200]}"
    return ""

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
      self._inside(node)  # the solution's probes may use the names too
      return
    stored = _stored(node) | ({node.name} if isinstance(node, ast.FunctionDef) else set())
    if not self._here(node):
      self._inside(node)
      self.local -= stored
      self.trusted -= stored
      return
    self.local |= stored
    self.trusted -= stored
    split = Split(self.trusted, self.local, self.probes)
    if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        and split.tainted(node.value) and not isinstance(node.value, _OUTSIDE)):
      self._bind_or_keep(node, split)
      return
    new = split.visit(copy.deepcopy(node))  # the original stays as written, for messages
    code = compile(ast.fix_missing_locations(ast.Module([new], [])), "<test>", "exec")
    exec(code, self.scope)  # pylint: disable=exec-used  # the record's own test on plain values: trusted

  def _here(self, node) -> bool:
    """Whether `node` can run here: statements of _HERE kinds, all through, whose stores go to plain names
    or into the test's own variables (never into an object the solution made)."""
    for n in ast.walk(node):
      if isinstance(n, ast.stmt) and not isinstance(n, _HERE):
        return False
      if isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, (ast.Store, ast.Del)):
        base = n
        while isinstance(base, (ast.Attribute, ast.Subscript)):
          base = base.value
        if not (isinstance(base, ast.Name) and base.id in self.local | _stored(node)):
          return False
    return True

  def _bind_or_keep(self, node: ast.Assign, split: Split) -> None:
    """`x = <needs the solution>`: the value comes here when it is plain data, else (`s = Solution()`) it
    stays inside under its name."""
    name = node.targets[0].id
    call = split.probe(copy.deepcopy(node.value))
    sent = eval(compile(ast.fix_missing_locations(ast.Expression(call.args[1])), "<test>", "eval"),  # pylint: disable=eval-used
                self.scope)
    out = self.oracle.eval(self.probes[-1][0], self._encode(sent), store=name)
    if out.get("stored"):
      self.local.discard(name)
    else:
      self.scope[name] = self._value(out)

  def _inside(self, node):
    sent = {n: self.scope[n] for n in sorted(free_names(node) & self.local) if n in self.scope}
    why = self.oracle.exec(ast.unparse(node), self._encode(sent))
    if why:
      raise ProbeError(why)

  @staticmethod
  def _encode(values: dict) -> dict:
    try:
      return {n: code_values.encode(v) for n, v in values.items()}
    except ValueError as e:
      raise ProbeError(str(e)) from None

  @staticmethod
  def _value(out: dict):
    if "value" not in out:
      raise code_values.raised(out)
    try:
      return code_values.decode(out["value"])
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError, MemoryError,
            ArithmeticError) as e:
      raise ProbeError(f"malformed value: {type(e).__name__}") from None

  def _probe(self, k: int, values: dict):
    return self._value(self.oracle.eval(self.probes[k][0], self._encode(values)))

  def _member(self, k: int, values: dict, attr: str, call: bool, args: tuple, kwargs: dict):
    """`<probe k>.attr(*args)`: here on a plain receiver, inside on an object the solution keeps there."""
    out = self.oracle.eval(self.probes[k][0], self._encode(values), store="__rlax_receiver__")
    if not out.get("stored"):
      value = getattr(self._value(out), attr)
      return value(*args, **kwargs) if call else value
    cls = str(out.get("type", ""))
    if attr.startswith("_") or attr in _PLAIN_ATTRS and not (cls[:1].isupper() and cls in self.constructed):
      # A method named like a str/list/set one (`.startswith`, `.issubset`) on an object the test did not
      # build from a class (`MinStack()`) is an impostor judging itself: refused.
      raise ProbeError(f"refused .{attr} of a {cls or 'value'} that is not plain data")
    expr = f"__rlax_receiver__.{attr}(*__rlax_args__, **__rlax_kwargs__)" if call else f"__rlax_receiver__.{attr}"
    return self._value(self.oracle.eval(expr, self._encode({"__rlax_args__": tuple(args),
                                                            "__rlax_kwargs__": dict(kwargs)})))
