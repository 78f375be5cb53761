"""Program synthesis from examples: "f(0..5)=2,5,8,11,14,17" -> "x*3+2".

The prompt lists the hidden function's outputs at the inputs 0..n_shown-1 (pairs (x, f(x)) with the
inputs implied by their order; this keeps the prompt short and every value at a fixed column). The
function comes from families with integer constants (x*a+b and x*x+c with |b|, |c| < 100, a-x, x%m, x//d,
abs(x-a), max(x,a), min(x,a)) over the integer domain 0..19; about 2100 distinct functions, 20% of them
held out. The model answers with a Python expression in x; the
verifier runs it in `dinfer_jax.tasks.sandbox` (never in-process) on the shown inputs and on every held-out input
n_shown..19, and accepts only if every output matches, so any equivalent expression is right.

Functions are identified by their values on the domain: constants that give the same function in two
families are one function, whose reference answer is the first family's spelling. A function is only
used if its shown outputs single it out among all functions of all families (the family ranges are chosen
so that with the default 6 shown inputs every one is), so the reference answer is the only function
consistent with the prompt. The train/test split holds out whole functions: a test function never occurs
in training, so the model must read its constants off the examples rather than recall them.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, ClassVar

import numpy as np

from dinfer_jax.tasks import sandbox
from dinfer_jax.tasks.base import Problem, Task

DOMAIN = tuple(range(20))


@dataclasses.dataclass(frozen=True)
class Family:
  """A parameterised function family.

  Attributes:
    name: Short family name.
    params: Parameter tuples to instantiate.
    fn: (x, *params) -> int, the function itself (trusted code: computes reference outputs).
    spell: (*params) -> canonical expression text in x.
  """
  name: str
  params: tuple[tuple[int, ...], ...]
  fn: Callable[..., int]
  spell: Callable[..., str]

  def __post_init__(self):
    if not self.name:
      raise ValueError("name must be non-empty")
    if not self.params:
      raise ValueError(f"params must be non-empty (family {self.name!r})")


def _signed(v: int) -> str:
  """'+3', '-3', or '' for 0: the tail of "x*2+3"."""
  return f"+{v}" if v > 0 else f"-{-v}" if v < 0 else ""


FAMILIES = (
    Family("linear", tuple((a, b) for a in range(1, 10) for b in range(-99, 100)),
           lambda x, a, b: a * x + b, lambda a, b: f"x{'' if a == 1 else f'*{a}'}{_signed(b)}"),
    Family("square", tuple((c,) for c in range(-99, 100)),
           lambda x, c: x * x + c, lambda c: f"x*x{_signed(c)}"),
    Family("reflect", tuple((a,) for a in range(1, 100)), lambda x, a: a - x, lambda a: f"{a}-x"),
    Family("mod", tuple((m,) for m in range(2, 6)), lambda x, m: x % m, lambda m: f"x%{m}"),
    Family("floordiv", tuple((d,) for d in range(2, 7)), lambda x, d: x // d, lambda d: f"x//{d}"),
    Family("distance", tuple((a,) for a in range(1, 5)), lambda x, a: abs(x - a), lambda a: f"abs(x-{a})"),
    Family("max", tuple((a,) for a in range(1, 10)), lambda x, a: max(x, a), lambda a: f"max(x,{a})"),
    Family("min", tuple((a,) for a in range(1, 5)), lambda x, a: min(x, a), lambda a: f"min(x,{a})"),
)


@dataclasses.dataclass(frozen=True)
class ProgramTask(Task):
  """Infer f from its outputs at 0..n_shown-1; answer with a Python expression in x.

  Attributes:
    n_shown: Inputs 0..n_shown-1 whose outputs the prompt shows; the rest of DOMAIN is held out for
      the verifier.
  """
  name: ClassVar[str] = "program"
  # The prompt is a function of the function, so one key (the function) decides the split.
  test_fraction: ClassVar[float] = 0.2

  n_shown: int = 6

  def __post_init__(self):
    if not isinstance(self.n_shown, int) or not 2 <= self.n_shown <= len(DOMAIN) - 2:
      raise ValueError(f"n_shown must be an int in [2, {len(DOMAIN) - 2}], got {self.n_shown!r}")

  def accepts(self, prompt: str) -> bool:
    """The format only: whether the outputs come from a trained function family is not known here."""
    n = self.n_shown
    return re.fullmatch(rf"f\(0\.\.{n - 1}\)=-?[0-9]+(,-?[0-9]+){{{n - 1}}}", prompt) is not None

  def generate(self, rng: np.random.Generator) -> Problem:
    table, spellings, members = _universe(self.n_shown)
    # Families weighted by sqrt(size): the big ones (x*a+b has ~1800 functions) dominate, as they must
    # for the model to learn to read constants off the examples rather than recall them, while the
    # small ones (x%m: 4) still appear often enough to be learned.
    sizes = np.sqrt([len(m) for m in members])
    family = members[int(rng.choice(len(members), p=sizes / sizes.sum()))]
    f = family[int(rng.integers(len(family)))]
    examples = tuple((x, int(table[f, x])) for x in DOMAIN[:self.n_shown])
    tests = tuple((x, int(table[f, x])) for x in DOMAIN[self.n_shown:])
    prompt = f"f(0..{self.n_shown - 1})=" + ",".join(str(y) for _, y in examples)
    return Problem(task=self.name, prompt=prompt, answer=spellings[f], split_keys=(f"fn:{spellings[f]}",),
                   examples=examples, tests=tests)

  def check(self, problem: Problem, answer_text: str) -> bool:
    """Runs the answer in the sandbox on shown and held-out inputs; True iff all outputs match."""
    pairs = problem.examples + problem.tests
    if not pairs:
      return False
    outputs = sandbox.eval_expression(answer_text, [x for x, _ in pairs])
    return outputs is not None and outputs == [y for _, y in pairs]


@functools.lru_cache(maxsize=None)
def _universe(n_shown: int):
  """Usable functions: (values table [n_fn, len(DOMAIN)], spellings, per-family member ids).

  Distinct functions (by their values on DOMAIN) of all families, keeping those whose first `n_shown`
  values no other function shares.
  """
  rows, spellings, family_of, seen = [], [], [], {}
  for k, family in enumerate(FAMILIES):
    for params in family.params:
      values = tuple(family.fn(x, *params) for x in DOMAIN)
      if values not in seen:  # first family to produce a function names it
        seen[values] = len(rows)
        rows.append(values)
        spellings.append(family.spell(*params))
        family_of.append(k)
  table = np.asarray(rows, dtype=np.int64)
  _, inverse, counts = np.unique(table[:, :n_shown], axis=0, return_inverse=True, return_counts=True)
  usable = counts[inverse.reshape(-1)] == 1
  members = tuple(m for m in (tuple(int(i) for i in np.flatnonzero(usable & (np.asarray(family_of) == k)))
                              for k in range(len(FAMILIES))) if m)
  return table, tuple(spellings), members


def canonical_functions(n_shown: int | None = None) -> dict[str, tuple[int, ...]]:
  """Canonical answer expressions with their values on `DOMAIN` (for tests and inspection): every
  distinct function, or with `n_shown` only those a prompt of that many examples identifies."""
  table, spellings, members = _universe(n_shown or len(DOMAIN))
  ids = range(len(spellings)) if n_shown is None else sorted(i for m in members for i in m)
  return {spellings[i]: tuple(int(v) for v in table[i]) for i in ids}
