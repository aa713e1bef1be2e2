"""Plain values as type-tagged JSON: how values cross between the grader and the code sandbox.

Only exact builtin types (and a few stdlib ones: OrderedDict, defaultdict of a builtin factory, Counter,
deque, Fraction, Decimal, range) are encoded; an object of any other type — a subclass of int, a class with
its own `__eq__` — is refused, so nothing a solution defines takes part in a comparison outside. Containers
are read through the C types' own methods, never through methods a solution could override.

The sandbox runner runs this same source (stdlib only, no rlax imports: `sandbox` prepends it to the
runner's), so the encoding is written once; `write_json` is the runner's writer (the `json` module would
import `re`, a third of a job's start-up). `decode` bounds depth, items and hash collisions, so a value
small as JSON cannot cost the grader more than linear time.
"""

import collections
import sys
import types

MAX_DEPTH = 64
MAX_ITEMS = 200000
_FACTORIES = {"int": int, "float": float, "str": str, "list": list, "dict": dict, "set": set, "tuple": tuple,
              "bool": bool, "None": None}
# Exceptions a solution raised that a test may catch by type (`except ValueError`). Not StopIteration: inside
# the test's `map` or generator it would end the iteration early, silently.
_RAISABLE = ("ArithmeticError", "AssertionError", "AttributeError", "EOFError", "Exception", "IndexError",
             "KeyError", "LookupError", "NotImplementedError", "OverflowError", "RecursionError",
             "RuntimeError", "TypeError", "ValueError", "ZeroDivisionError")
_SEQ = {list: "l", tuple: "t", set: "S", frozenset: "F", collections.deque: "q"}
_MAP = {dict: "d", collections.OrderedDict: "o", collections.Counter: "C", collections.defaultdict: "D"}
_SEQ_TYPES = {v: k for k, v in _SEQ.items()}
# Iterators a solution may return (a generator, `map(...)`): drained inside into a list, an iterator here.
_ITERATORS = frozenset((types.GeneratorType, map, filter, zip, enumerate, reversed, type(iter([])),
                        type(iter(())), type(iter(range(0))), type(iter("")), type(iter({})), type(iter(set()))))
MUTABLE = (list, dict, set, bytearray, collections.deque)  # arguments a call may change in place
_od_items, _dict_items, _type, _len = collections.OrderedDict.items, dict.items, type, len


class Refused(ValueError):
  """A value that is not plain data (or too big, or too deep) to cross."""


def encode(x, depth: int = 0, budget=None, refs=None) -> list:
  """`x` as type-tagged JSON; Refused for a type outside the list, a value deeper than MAX_DEPTH or with
  more than MAX_ITEMS items. refs(x): the handle of an object that lives inside (the grader's Refs), or None."""
  budget = budget if budget is not None else [MAX_ITEMS]
  if refs is not None:
    handle = refs(x)
    if handle is not None:
      return ["R", handle]
  budget[0] -= 1
  if depth > MAX_DEPTH or budget[0] < 0:
    raise Refused(f"a value deeper than {MAX_DEPTH} or with more than {MAX_ITEMS} items")
  t = _type(x)
  if x is None:
    return ["N"]
  if t is bool or t is int:
    return ["b" if t is bool else "i", hex(int.__index__(x))]
  if t is float:
    return ["f", float.hex(x)]
  if t is complex:
    return ["c", float.hex(x.real), float.hex(x.imag)]
  if t is str:
    return ["s", x]
  if t is bytes or t is bytearray:
    return ["y" if t is bytes else "Y", bytes.hex(x)]
  if t is range:
    return ["r", x.start, x.stop, x.step]
  fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")  # no import: none made, none here
  if fractions is not None and t is fractions.Fraction:
    return ["Q", hex(x.numerator), hex(x.denominator)]
  if decimal is not None and t is decimal.Decimal:
    return ["M", str(x)]
  if t in _SEQ:
    return [_SEQ[t], [encode(v, depth + 1, budget, refs) for v in list(x)]]
  if t in _ITERATORS:
    items = []
    for v in x:
      budget[0] -= 1
      if budget[0] < 0:
        raise Refused(f"an iterator of more than {MAX_ITEMS} items")
      items.append(encode(v, depth + 1, budget, refs))
    return ["I", items]
  if t in _MAP:
    pairs = [[encode(k, depth + 1, budget, refs), encode(v, depth + 1, budget, refs)]
             for k, v in (_od_items(x) if t is collections.OrderedDict else _dict_items(x))]
    if t is not collections.defaultdict:
      return [_MAP[t], pairs]
    factory = next((n for n, f in _FACTORIES.items() if f is x.default_factory), None)
    if factory is None:
      raise Refused("a defaultdict whose default_factory is not a builtin type")
    return ["D", pairs, factory]
  if tuple in t.__mro__:  # a namedtuple: its items, read through tuple's own slot, compare as a tuple
    try:
      return ["t", [encode(v, depth + 1, budget, refs) for v in tuple.__getitem__(x, slice(None))]]
    except TypeError:
      pass
  raise Refused(f"a value of type {t.__name__} (only builtin types are compared)")


def decode(v, depth: int = 0, budget=None, refs=None):
  """The value of type-tagged JSON `v`; ValueError (or TypeError, IndexError) when malformed. Bounded so the
  grader's work on it stays linear: range lengths, Decimal exponents and Fraction sizes are capped, and
  containers of many colliding hashes are refused. refs(handle): the object a ["R", handle] stands for."""
  budget = budget if budget is not None else [MAX_ITEMS]
  budget[0] -= 1
  if depth > MAX_DEPTH or budget[0] < 0 or _type(v) is not list or not v:
    raise ValueError("malformed value")
  tag = v[0]
  if tag == "N":
    return None
  if tag in ("b", "i"):
    i = int(v[1], 16)
    return bool(i) if tag == "b" else i
  if tag == "f":
    return float.fromhex(v[1])
  if tag == "c":
    return complex(float.fromhex(v[1]), float.fromhex(v[2]))
  if tag == "s" and _type(v[1]) is str:
    return v[1]
  if tag in ("y", "Y"):
    return (bytes if tag == "y" else bytearray).fromhex(v[1])
  if tag == "r" and all(_type(a) is int for a in v[1:4]) and _len(range(v[1], v[2], v[3])) <= MAX_ITEMS:
    return range(v[1], v[2], v[3])
  if tag == "Q" and _len(v[1]) < 2500 and _len(v[2]) < 2500:
    import fractions  # pylint: disable=g-import-not-at-top  # the sandbox side never decodes one
    return fractions.Fraction(int(v[1], 16), int(v[2], 16))
  if tag == "M" and _type(v[1]) is str and _len(v[1]) < 5000:
    import decimal  # pylint: disable=g-import-not-at-top
    d = decimal.Decimal(v[1])
    if d.is_finite() and abs(d.adjusted()) > 10000:
      raise ValueError("a Decimal of more than 10000 digits")
    return d
  if tag == "R" and refs is not None and _type(v[1]) is str:
    return refs(v[1])
  if tag in _SEQ_TYPES or tag == "I":
    items = [decode(x, depth + 1, budget, refs) for x in v[1]]
    _spread(items)
    return iter(items) if tag == "I" else _SEQ_TYPES[tag](items)
  if tag in ("d", "o", "C", "D"):
    pairs = [(decode(k, depth + 1, budget, refs), decode(x, depth + 1, budget, refs)) for k, x in v[1]]
    _spread([k for k, _ in pairs])
    if tag == "D":
      return collections.defaultdict(_FACTORIES[v[2]], pairs)
    return {"d": dict, "o": collections.OrderedDict, "C": collections.Counter}[tag](pairs)
  raise ValueError(f"malformed value tag {tag!r}")


def _spread(keys: list) -> None:
  """Refuses many items whose hashes collide (a set of k * (2**61 - 1) costs quadratic time to build, here
  or in the test's `set(f(x))`); unhashable items are left alone."""
  if _len(keys) <= 64:
    return
  try:
    distinct = _len({hash(k) for k in keys})
  except TypeError:
    return
  if distinct * 2 < _len(keys):
    raise ValueError("items with colliding hashes")


def raised(reply: dict) -> Exception:
  """The exception a failed evaluation stands for here: the builtin type the solution raised (so a test's
  `except ValueError` works), else a ProbeError-like RuntimeError subclass carrying the reason."""
  name, why = reply.get("raised"), str(reply.get("error", "no value"))[:300]
  if name in _RAISABLE:
    why = why[len(name) + 2:] if why.startswith(name + ": ") else why
    import builtins  # pylint: disable=g-import-not-at-top
    return getattr(builtins, name)(why)
  return Failed(why)


class Failed(Exception):
  """An evaluation inside the sandbox failed (refused value, crash, timeout, tampering)."""


def write_json(obj) -> str:
  """JSON of a reply (dicts with str keys, lists, str, int, bool, None: what `encode` makes), without the
  `json` module."""
  import _json  # pylint: disable=g-import-not-at-top  # C: imports nothing
  out = []

  def put(v):
    t = _type(v)
    if t is str:
      out.append(_json.encode_basestring_ascii(v))
    elif v is None or t is bool:
      out.append("null" if v is None else "true" if v else "false")
    elif t is int:
      out.append(int.__repr__(v))
    elif t is list or t is tuple:
      out.append("[")
      for i, x in enumerate(v):
        out.append("," if i else "")
        put(x)
      out.append("]")
    elif t is dict:
      out.append("{")
      for i, (k, x) in enumerate(v.items()):
        out.append(("," if i else "") + _json.encode_basestring_ascii(str(k)) + ":")
        put(x)
      out.append("}")
    else:
      raise Refused(f"a reply holding a {t.__name__}")
  put(obj)
  return "".join(out)
