"""Verdicts on model-written code that the code itself cannot fake.

A code problem is a program plus asserts ("assert add(2, 3) == 5"). Running the asserts after the
program in one interpreter lets the program decide its own verdict: exit 0 before the asserts
(`sys.exit(0)`, `os._exit(0)`, an atexit hook, a `__del__`), or return an object whose `__eq__` says True.
Here the harness decides, in two sandboxed runs (`dinfer_jax.tasks.sandbox`, the same isolation as before):

1. **Probe run** (untrusted): setup, the program, then only the *probes*: the sub-expressions of the
   asserts that need the program ("add(2, 3)"), never the comparisons or the expected values. Each
   probe's value is written out as plain data (None, bool, int, float, complex, str, bytes, list,
   tuple, dict, set, frozenset, range, an iterator's items; subclasses by their base type's own data,
   so an overridden `__eq__`/`__iter__`/`__repr__` is never called), or the name of the exception it
   raised. The record ends the run (`os._exit`, so no atexit hook or finaliser runs after it); a run
   that ends before writing it (an exit, a signal, a limit) fails every test.
2. **Verdict run** (trusted: setup and the asserts only, no program code): the asserts are evaluated
   with each probe replaced by its recorded data, and the verdicts are printed.

So the program never sees what its results are compared with (unless the expected value is itself an
argument of a call), no object of its making takes part in a comparison, and nothing it runs after the
probes matters. What it can still do is write a probe record of its choice, i.e. answer the probes
itself: that is solving the problem.

Asserts are split by the names they use: a name that is neither a builtin nor bound by the setup belongs
to the program. Calls, comparisons, boolean and arithmetic operators, subscripts, containers, f-strings
and comprehensions over trusted iterables are evaluated in the verdict run; anything else that involves
the program (a call of a program function, an attribute of a program value) is a probe. A builtin or setup
name stays trusted even where the program rebinds it (so `len` in an assert is Python's). Tests the
splitter cannot place (a lambda or walrus that uses the program, a comprehension that iterates over
program output, statements other than `assert`) are refused up front with `UnverifiableTest`.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import json
import secrets
from typing import Sequence

from dinfer_jax.tasks import sandbox

MAX_PROBES = 10_000
MAX_ITER_ITEMS = 100_000  # an iterator probe keeps at most this many items


class UnverifiableTest(ValueError):
  """A test the harness cannot split into trusted and program parts."""


@dataclasses.dataclass(frozen=True)
class CheckResult:
  """Outcome of one program against its tests.

  Attributes:
    passed: Every test passed.
    results: One verdict per test (all False when the probe run did not report).
    reason: "passed", "failed" (some test false), "no_report" (the program ended the probe run before the
      harness's record: an exit, a signal, an exception at top level), "timeout" (the probe run's wall
      clock), "limit" (another limit: CPU, output, memory), "unrunnable" (the program cannot be run at
      all: text that is not valid Unicode, or larger than the sandbox takes; nothing runs).
    probe_run: The probe run's sandbox result (stdout and stderr are the program's, for diagnostics).
  """
  passed: bool
  results: tuple[bool, ...]
  reason: str
  probe_run: sandbox.SandboxResult | None = None


# ----------------------------------------------------------------------------------------------------
# Splitting asserts.

_TRUSTED_BUILTINS = frozenset(n for n in dir(builtins) if not n.startswith("_")) | {"__import__"}
_RECURSE = (ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.IfExp, ast.Tuple, ast.List, ast.Set, ast.Dict,
            ast.JoinedStr, ast.FormattedValue, ast.Subscript, ast.Slice, ast.Starred, ast.Constant)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def setup_names(setup: str) -> frozenset[str]:
  """Names the setup binds at module level (for `from m import *`, the module's public names)."""
  try:
    tree = ast.parse(setup or "")
  except SyntaxError as e:
    raise UnverifiableTest(f"setup is not valid Python: {e.msg} (line {e.lineno})") from None
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      names.add(node.id)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      for alias in node.names:
        if alias.name == "*":
          try:
            module = importlib.import_module(node.module)
          except ImportError as e:
            raise UnverifiableTest(f"setup: cannot list the names of 'from {node.module} import *': {e}") from None
          names |= set(getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")]))
        else:
          names.add((alias.asname or alias.name).split(".")[0])
  return frozenset(names)


class _Splitter:
  """Rewrites one expression into (verdict-run expression, probe expressions)."""

  def __init__(self, trusted: frozenset[str], placeholder, in_comprehension: bool = False, offset: int = 0):
    self.trusted = trusted
    self.offset = offset  # record index of this splitter's first probe
    self.placeholder = placeholder  # index -> ast.expr that stands for probe `index` in the verdict run
    self.in_comprehension = in_comprehension
    self.probes: list = []  # phase-1 items: ast.expr, or ("rows", ast.ListComp of probe tuples)

  def tainted(self, node: ast.AST, local: frozenset[str] = frozenset()) -> bool:
    bound = set(local)
    for n in ast.walk(node):
      if isinstance(n, ast.Lambda):
        bound |= {a.arg for a in n.args.args + n.args.kwonlyargs + n.args.posonlyargs}
      elif isinstance(n, ast.comprehension):
        bound |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
    return any(isinstance(n, ast.Name) and n.id not in self.trusted and n.id not in bound for n in ast.walk(node))

  def probe(self, node: ast.expr) -> ast.expr:
    if len(self.probes) >= MAX_PROBES:
      raise UnverifiableTest(f"more than {MAX_PROBES} probes")
    self.probes.append(node)
    return self.placeholder(self.offset + len(self.probes) - 1)

  def split(self, node: ast.expr) -> ast.expr:
    if not self.tainted(node):
      return node
    if isinstance(node, _COMPREHENSIONS):
      return self.comprehension(node)
    if isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
      raise UnverifiableTest(f"a {type(node).__name__.lower()} that uses the program's names")
    if isinstance(node, ast.Call) and not self.tainted(node.func):
      return ast.Call(func=node.func, args=[self.split(a) for a in node.args],
                      keywords=[ast.keyword(arg=k.arg, value=self.split(k.value)) for k in node.keywords])
    if isinstance(node, _RECURSE):
      new = type(node)()
      for field, value in ast.iter_fields(node):
        if isinstance(value, ast.expr):
          value = self.split(value)
        elif isinstance(value, list):
          value = [self.split(v) if isinstance(v, ast.expr) else v for v in value]
        setattr(new, field, value)
      return new
    return self.probe(node)

  def comprehension(self, node) -> ast.expr:
    """A comprehension whose element uses the program: the probe run makes one row of element probes per
    iteration (same generators), the verdict run iterates again and takes the rows in order."""
    if self.in_comprehension:
      raise UnverifiableTest("a comprehension inside a comprehension that uses the program")
    local = set()
    for gen in node.generators:
      if self.tainted(gen.iter, frozenset(local)) or any(self.tainted(c, frozenset(local)) for c in gen.ifs):
        raise UnverifiableTest("a comprehension that iterates over (or filters by) the program's output")
      if gen.is_async:
        raise UnverifiableTest("an async comprehension")
      local |= {t.id for t in ast.walk(gen.target) if isinstance(t, ast.Name)}
    row = _name("__row")
    sub = _Splitter(self.trusted | frozenset(local),
                    lambda j: _call("__val", ast.Subscript(value=row, slice=ast.Constant(j), ctx=ast.Load())),
                    in_comprehension=True)
    elt = ast.Tuple(elts=[node.key, node.value], ctx=ast.Load()) if isinstance(node, ast.DictComp) else node.elt
    new_elt = sub.split(elt)
    rows = ast.ListComp(elt=ast.Tuple(elts=[_capture(p) for p in sub.probes], ctx=ast.Load()),
                        generators=node.generators)
    index = self.offset + len(self.probes)
    self.probes.append(("rows", rows))
    # (lambda __row: ELT)(__next_row(k)) for the same generators.
    per_row = ast.Call(func=ast.Lambda(args=_args("__row"), body=new_elt), args=[_call("__next_row", ast.Constant(index))],
                       keywords=[])
    if isinstance(node, ast.DictComp):
      return ast.Call(func=_name("dict"), args=[ast.GeneratorExp(elt=per_row, generators=node.generators)],
                      keywords=[])
    return type(node)(elt=per_row, generators=node.generators)


def _name(n: str) -> ast.Name:
  return ast.Name(id=n, ctx=ast.Load())


def _call(fn: str, *args: ast.expr) -> ast.Call:
  return ast.Call(func=_name(fn), args=list(args), keywords=[])


def _args(*names: str) -> ast.arguments:
  return ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in names], vararg=None, kwonlyargs=[],
                       kw_defaults=[], kwarg=None, defaults=[])


def _capture(expr: ast.expr) -> ast.expr:
  """__cap(lambda: EXPR): the probe's encoded value or the exception it raised."""
  return _call("__cap", ast.Lambda(args=_args(), body=expr))


@dataclasses.dataclass(frozen=True)
class SplitTests:
  verdict_exprs: tuple[str, ...]  # one verdict-run expression per test
  probe_exprs: tuple[str, ...]  # probe-run expressions, each evaluating to one encoded record item


def split_tests(tests: Sequence[str], setup: str = "") -> SplitTests:
  """Splits asserts into verdict-run expressions and probe-run expressions (see the module doc).

  Raises:
    UnverifiableTest: naming the test (1-based) and why.
  """
  trusted = _TRUSTED_BUILTINS | setup_names(setup)
  verdicts, probes = [], []
  for i, test in enumerate(tests, 1):
    try:
      tree = ast.parse(test)
    except SyntaxError as e:
      raise UnverifiableTest(f"test {i} is not valid Python: {e.msg}") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
      raise UnverifiableTest(f"test {i} must be one assert statement, got {test!r}")
    splitter = _Splitter(trusted, lambda j: _call("__probe", ast.Constant(j)), offset=len(probes))
    try:
      expr = splitter.split(tree.body[0].test)
    except UnverifiableTest as e:
      raise UnverifiableTest(f"test {i} ({test!r}) cannot be verified safely: {e}") from None
    verdicts.append(ast.unparse(ast.fix_missing_locations(expr)))
    for p in splitter.probes:
      if isinstance(p, tuple):
        probes.append(f"__rows(lambda: {ast.unparse(ast.fix_missing_locations(p[1]))})")
      else:
        probes.append(ast.unparse(ast.fix_missing_locations(_capture(p))))
  if len(probes) > MAX_PROBES:
    raise UnverifiableTest(f"the tests need {len(probes)} probes, at most {MAX_PROBES}")
  if tests and not probes:
    # Every name they use is a builtin or the setup's: an empty program passes them.
    raise UnverifiableTest("no test uses a name the program defines (they pass without the program)")
  return SplitTests(tuple(verdicts), tuple(probes))


# ----------------------------------------------------------------------------------------------------
# The two runs.

# Encodes a value as tagged plain data. It reads subclasses of the builtin types through the base type's
# own slots (int.__repr__, list.__iter__, dict.items, ...), so nothing the program overrode is called
# except an iterator's __next__ (whose items are encoded the same way).
_PROBE_PRELUDE = r'''
import json as __json, os as __os, sys as __sys
def __enc(v, depth=0):
  if depth > 200:
    raise RecursionError("value nested too deeply")
  e = lambda x: __enc(x, depth + 1)
  if v is None: return ["n"]
  if v is True or v is False: return ["b", v is True]
  if isinstance(v, int): return ["i", int.__repr__(v)]
  if isinstance(v, float): return ["f", float.__repr__(v)]
  if isinstance(v, complex):
    return ["c", float.__repr__(complex.real.__get__(v)), float.__repr__(complex.imag.__get__(v))]
  if isinstance(v, str): return ["s", str.__str__(v)]
  if isinstance(v, bytes): return ["y", bytes.hex(v)]
  if isinstance(v, bytearray): return ["Y", bytearray.hex(v)]
  if isinstance(v, list): return ["l", [e(x) for x in list.__iter__(v)]]
  if isinstance(v, tuple): return ["t", [e(x) for x in tuple.__iter__(v)]]
  if isinstance(v, dict): return ["d", [[e(k), e(x)] for k, x in dict.items(v)]]
  if isinstance(v, frozenset): return ["F", [e(x) for x in frozenset.__iter__(v)]]
  if isinstance(v, set): return ["S", [e(x) for x in set.__iter__(v)]]
  if type(v) is range: return ["r", v.start, v.stop, v.step]
  if hasattr(type(v), "__next__"):
    items = []
    for x in v:
      if len(items) >= @MAX_ITER@:
        break
      items.append(e(x))
    return ["g", items]
  raise TypeError("a probe returned a " + type(v).__name__ + ", not plain data")
def __cap(f):
  try:
    return __enc(f())
  except BaseException as exc:
    return ["e", type(exc).__name__]
def __rows(f):
  try:
    return ["R", f()]
  except BaseException as exc:
    return ["e", type(exc).__name__]
'''

_PROBE_EPILOGUE = r'''
__record = [@PROBES@]
__sys.stdout.flush()
__sys.stderr.flush()
__os.write(1, ("\n" + @NONCE@ + __json.dumps(__record) + "\n").encode())
__os._exit(0)
'''

# The verdict run: setup and the rewritten asserts over the recorded data; no program code.
_VERDICT_PROGRAM = r'''
import json as __json, sys as __sys
class ProbeFailed(Exception):
  pass
def __dec(x):
  t = x[0]
  if t == "n": return None
  if t == "b": return x[1] is True
  if t == "i": return int(x[1])
  if t == "f": return float(x[1])
  if t == "c": return complex(float(x[1]), float(x[2]))
  if t == "s": return str(x[1])
  if t == "y": return bytes.fromhex(x[1])
  if t == "Y": return bytearray.fromhex(x[1])
  if t == "l": return [__dec(i) for i in x[1]]
  if t == "t": return tuple(__dec(i) for i in x[1])
  if t == "d": return {__dec(k): __dec(v) for k, v in x[1]}
  if t == "S": return {__dec(i) for i in x[1]}
  if t == "F": return frozenset(__dec(i) for i in x[1])
  if t == "r": return range(int(x[1]), int(x[2]), int(x[3]))
  if t == "g": return iter([__dec(i) for i in x[1]])
  if t == "e": raise ProbeFailed(str(x[1]))
  raise ValueError("bad record item")
__RECORD = __json.loads(__sys.stdin.read())  # data only: never pasted into this program's text
__ROWS = {}
def __probe(i):
  return __dec(__RECORD[i])
def __val(item):
  return __dec(item)
def __next_row(i):
  if i not in __ROWS:
    rows = __RECORD[i]
    if rows[0] != "R":
      raise ProbeFailed(str(rows[1]))
    __ROWS[i] = iter(rows[1])
  return next(__ROWS[i])
@SETUP@
__results = []
for __src in @VERDICTS@:
  try:
    __results.append(bool(eval(__src)))
  except BaseException:
    __results.append(False)
print(@NONCE@ + __json.dumps(__results))
'''

VERDICT_LIMITS = sandbox.Limits(cpu_seconds=5, wall_seconds=10.0, memory_bytes=512 * 2**20,
                                max_output_bytes=1 << 20)


def _record_after(stdout: str, nonce: str):
  lines = [line for line in stdout.splitlines() if line.startswith(nonce)]
  if not lines:
    return None
  try:
    return json.loads(lines[-1][len(nonce):])
  except (ValueError, RecursionError):
    return None


def runnable(code: str, limits: sandbox.Limits) -> bool:
  """Whether the sandbox takes `code`: text it can write (a lone surrogate from the model's detokenised text
  cannot be) within its code size. A program that is not is a failed check, never an exception that ends an
  evaluation run."""
  try:
    return len(code.encode("utf-8", "surrogateescape")) <= sandbox.max_code_bytes(limits)
  except UnicodeEncodeError:
    return False


def check_tests(program: str, tests: Sequence[str], setup: str = "", *,
                limits: sandbox.Limits = sandbox.Limits(), mode: str | None = None,
                split: SplitTests | None = None) -> CheckResult:
  """Runs `program` against `tests` (asserts) as described in the module doc.

  Args:
    program: The untrusted program text.
    tests: Assert statements, one per string.
    setup: Trusted code run before the program (imports, helpers) in both runs.
    limits: Limits of the probe run (the verdict run has VERDICT_LIMITS).
    mode: Sandbox mode (None: the strongest available).
    split: `split_tests(tests, setup)`, when the caller already has it.

  Raises:
    UnverifiableTest: A test cannot be split (a problem of the tests, not of the program).
    sandbox.SandboxError: The sandbox cannot run here (fail closed).
  """
  split = split or split_tests(tests, setup)
  n = len(split.verdict_exprs)
  nonce = "#dinfer-harness-" + secrets.token_hex(16) + "#"
  probe_program = "\n".join([
      _PROBE_PRELUDE.replace("@MAX_ITER@", str(MAX_ITER_ITEMS)), setup or "", program, "",
      _PROBE_EPILOGUE.replace("@PROBES@", ", ".join(split.probe_exprs)).replace("@NONCE@", repr(nonce))])
  if not runnable(probe_program, limits):
    return CheckResult(False, (False,) * n, "unrunnable")
  run = sandbox.run_python(probe_program, limits=limits, mode=mode)
  record = _record_after(run.stdout, nonce)
  if not isinstance(record, list) or len(record) != len(split.probe_exprs):
    reason = ("timeout" if run.timed_out else "limit" if run.killed_reason is not None else "no_report")
    return CheckResult(False, (False,) * n, reason, run)
  verdict_nonce = "#dinfer-verdict-" + secrets.token_hex(16) + "#"
  verdict_program = (_VERDICT_PROGRAM.replace("@VERDICTS@", repr(list(split.verdict_exprs)))
                     .replace("@NONCE@", repr(verdict_nonce)).replace("@SETUP@", setup or ""))
  verdict = sandbox.run_python(verdict_program, stdin=json.dumps(record), limits=VERDICT_LIMITS, mode=mode)
  results = _record_after(verdict.stdout, verdict_nonce)
  if not verdict.ok or not isinstance(results, list) or len(results) != n:
    return CheckResult(False, (False,) * n, "limit", run)
  results = tuple(r is True for r in results)
  return CheckResult(all(results), results, "passed" if all(results) else "failed", run)
