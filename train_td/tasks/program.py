"""Program synthesis from examples: "f(2)=8;f(5)=17;f(9)=29" -> "x*3+2".

The hidden function comes from small families with small constants (x*a+b and x+b, x*x+c, (x+a)*b, x%m,
x//d, abs(x-a), max(x,a), min(x,a), a-x) over the integer domain 0..19. The model answers with a Python
expression in x; the verifier runs it in `train_td.sandbox` (never in-process) on the shown inputs and
on held-out inputs and accepts only if every output matches.

Functions are identified by their values on the domain: constants that give the same function in two
families (e.g. (x+1)*2 and x*2+2) are one function, whose reference answer is the first family's
spelling. Shown inputs are drawn until they single the function out among all functions of all
families, so the reference answer is always the only function consistent with the prompt.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import numpy as np

from train_td import sandbox
from train_td.tasks.base import Problem, Task

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


_NONZERO = tuple(v for v in range(-9, 10) if v)

FAMILIES = (
    Family("linear", tuple((a, b) for a in range(1, 10) for b in range(-9, 10)),
           lambda x, a, b: a * x + b, lambda a, b: f"x{'' if a == 1 else f'*{a}'}{_signed(b)}"),
    Family("square", tuple((c,) for c in range(-9, 10)),
           lambda x, c: x * x + c, lambda c: f"x*x{_signed(c)}"),
    Family("shift_scale", tuple((a, b) for a in _NONZERO for b in range(2, 10)),
           lambda x, a, b: (x + a) * b, lambda a, b: f"(x{_signed(a)})*{b}"),
    Family("mod", tuple((m,) for m in range(2, 10)), lambda x, m: x % m, lambda m: f"x%{m}"),
    Family("floordiv", tuple((d,) for d in range(2, 10)), lambda x, d: x // d, lambda d: f"x//{d}"),
    Family("distance", tuple((a,) for a in range(1, 19)), lambda x, a: abs(x - a), lambda a: f"abs(x-{a})"),
    Family("max", tuple((a,) for a in range(1, 19)), lambda x, a: max(x, a), lambda a: f"max(x,{a})"),
    Family("min", tuple((a,) for a in range(1, 19)), lambda x, a: min(x, a), lambda a: f"min(x,{a})"),
    Family("reflect", tuple((a,) for a in range(1, 20)), lambda x, a: a - x, lambda a: f"{a}-x"),
)


@dataclasses.dataclass(frozen=True)
class ProgramTask(Task):
  """Infer f from a few input/output pairs; answer with a Python expression in x.

  Attributes:
    n_shown: Input/output pairs in the prompt.
    n_tests: Held-out pairs (inputs not shown) the verifier also checks.
  """
  name: ClassVar[str] = "program"
  # Two keys (function, prompt) must both land in the test split, so a test problem is drawn with
  # probability test_fraction^2 = 4%; 20% keeps that affordable while ~80% of draws are trainable.
  test_fraction: ClassVar[float] = 0.2

  n_shown: int = 3
  n_tests: int = 5

  def __post_init__(self):
    if not isinstance(self.n_shown, int) or not 1 <= self.n_shown <= len(DOMAIN) // 2:
      raise ValueError(f"n_shown must be an int in [1, {len(DOMAIN) // 2}], got {self.n_shown!r}")
    if not isinstance(self.n_tests, int) or not 1 <= self.n_tests <= len(DOMAIN) - self.n_shown:
      raise ValueError(f"n_tests must be an int in [1, {len(DOMAIN) - self.n_shown}], got {self.n_tests!r}")

  def generate(self, rng: np.random.Generator) -> Problem:
    table, spellings, members = _universe()
    domain = np.asarray(DOMAIN)
    while True:
      family = members[int(rng.integers(len(members)))]
      f = family[int(rng.integers(len(family)))]
      for _ in range(30):
        perm = rng.permutation(len(DOMAIN))
        shown = np.sort(perm[:self.n_shown])
        # Unique among all functions: otherwise the prompt does not determine the answer.
        if np.count_nonzero((table[:, shown] == table[f, shown]).all(axis=1)) == 1:
          break
      else:
        continue  # this function is hard to pin down with n_shown points; draw another
      held_out = np.sort(perm[self.n_shown:self.n_shown + self.n_tests])
      examples = tuple((int(domain[i]), int(table[f, i])) for i in shown)
      tests = tuple((int(domain[i]), int(table[f, i])) for i in held_out)
      prompt = ";".join(f"f({x})={y}" for x, y in examples)
      return Problem(task=self.name, prompt=prompt, answer=spellings[f],
                     split_keys=(f"fn:{spellings[f]}", f"prompt:{prompt}"), examples=examples, tests=tests)

  def check(self, problem: Problem, answer_text: str) -> bool:
    """Runs the answer in the sandbox on shown and held-out inputs; True iff all outputs match."""
    pairs = problem.examples + problem.tests
    if not pairs:
      return False
    outputs = sandbox.eval_expression(answer_text, [x for x, _ in pairs])
    return outputs is not None and outputs == [y for _, y in pairs]


_UNIVERSE = None


def _universe():
  """All distinct functions: (values table [n_fn, len(DOMAIN)], spellings, per-family member ids)."""
  global _UNIVERSE
  if _UNIVERSE is None:
    rows, spellings, members, seen = [], [], [], {}
    for family in FAMILIES:
      ids = []
      for params in family.params:
        values = tuple(family.fn(x, *params) for x in DOMAIN)
        if values not in seen:  # first family to produce a function names it
          seen[values] = len(rows)
          rows.append(values)
          spellings.append(family.spell(*params))
          ids.append(seen[values])
      if ids:
        members.append(tuple(ids))
    _UNIVERSE = (np.asarray(rows, dtype=np.int64), tuple(spellings), tuple(members))
  return _UNIVERSE


def canonical_functions() -> dict[str, tuple[int, ...]]:
  """Every canonical answer expression with its values on `DOMAIN` (for tests and inspection)."""
  table, spellings, _ = _universe()
  return {s: tuple(int(v) for v in row) for s, row in zip(spellings, table)}
