"""Integer arithmetic with carries, written in columns: "348+279" -> "627".

Format: operands right-aligned to `max_digits` characters and the answer right-aligned to
`max_digits + 1` (space padded, as in column arithmetic): "348+279" -> " 627", " 40+  2" -> "  42". Every
digit then sits at a fixed offset from the digits it depends on, whatever the operand lengths, which is
what a model of a few million parameters needs to learn carries from a few hundred thousand examples
(with ragged, left-aligned numbers it must first work out where each column is). The verifier strips the
padding, so " 627" and "627" are both correct; the chat template pads a user's "348 + 279" the same way.

Operand sizes: for + and -, each operand gets a digit count drawn uniformly from 1..max_digits and then a
uniform value with that many digits (so small problems, which users also type, are not vanishingly
rare next to 3-digit ones). For *, one operand has at most `max_multiplier_digits` digits and the
product at most max_digits + 1 (3-by-1, 2-by-1, 1-by-3, ...). Subtraction may go negative ("27-348" ->
"-321") only with allow_negative=True; by default the operands are ordered so that the result is >= 0.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from dinfer_jax.tasks.base import Problem, Task

_INTEGER = re.compile(r"-?[0-9]+")
_MAX_ANSWER_CHARS = 64  # longer text is wrong anyway; bounds the int() parse


@dataclasses.dataclass(frozen=True)
class ArithmeticTask(Task):
  """Addition, subtraction and multiplication of small non-negative integers.

  Attributes:
    ops: Operators to draw from, a subset of "+-*".
    max_digits: Most digits of an operand (also the width operands are right-aligned to).
    max_multiplier_digits: Most digits of the shorter multiplication operand.
    allow_negative: Whether a-b may be drawn with b > a.
    op_weights: Relative frequency of each operator of `ops` (same order); None draws them uniformly.
      Training may weight the harder operator up; the registered task (and so every held-out set)
      stays uniform. The split does not depend on it.
  """
  name: ClassVar[str] = "arithmetic"
  # The problem space is large (~10^6 sums alone); 5% held out is plenty and keeps most small
  # problems trainable.
  test_fraction: ClassVar[float] = 0.05

  ops: str = "+-*"
  max_digits: int = 3
  max_multiplier_digits: int = 1
  allow_negative: bool = False
  op_weights: tuple[float, ...] | None = None

  def __post_init__(self):
    if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set("+-*") or len(set(
        self.ops)) != len(self.ops):
      raise ValueError(f"ops must be distinct characters from '+-*', got {self.ops!r}")
    if not isinstance(self.max_digits, int) or not 1 <= self.max_digits <= 9:
      raise ValueError(f"max_digits must be an int in [1, 9], got {self.max_digits!r}")
    mmd = self.max_multiplier_digits
    if not isinstance(mmd, int) or not 1 <= mmd <= self.max_digits:
      raise ValueError(f"max_multiplier_digits must be an int in [1, max_digits], got {mmd!r}")
    if not isinstance(self.allow_negative, bool):
      raise ValueError(f"allow_negative must be a bool, got {self.allow_negative!r}")
    w = self.op_weights
    if w is not None and (not isinstance(w, tuple) or len(w) != len(self.ops) or not all(
        isinstance(x, (int, float)) and np.isfinite(x) and x > 0 for x in w)):
      raise ValueError(f"op_weights must be a tuple of {len(self.ops)} positive numbers (one per op of "
                       f"{self.ops!r}), got {w!r}")

  @property
  def answer_width(self) -> int:
    """Characters of a right-aligned answer: a sum carries into one more digit; a product is kept to it."""
    return self.max_digits + 1

  def generate(self, rng: np.random.Generator) -> Problem:
    if self.op_weights is None:
      op = self.ops[int(rng.integers(len(self.ops)))]
    else:
      p = np.asarray(self.op_weights, np.float64)
      op = self.ops[int(rng.choice(len(self.ops), p=p / p.sum()))]
    if op == "*":
      # The product must fit answer_width digits: 10^(da+db) <= 10^(max_digits+1).
      shapes = [(i, j) for i in range(1, self.max_digits + 1) for j in range(1, self.max_digits + 1)
                if min(i, j) <= self.max_multiplier_digits and i + j <= self.answer_width]
      da, db = shapes[int(rng.integers(len(shapes)))]
    else:
      da, db = (int(d) for d in rng.integers(1, self.max_digits + 1, size=2))
    a, b = _with_digits(rng, da), _with_digits(rng, db)
    if op == "-" and not self.allow_negative and a < b:
      a, b = b, a
    result = a + b if op == "+" else a - b if op == "-" else a * b
    # a+b and b+a (a*b, b*a) are one problem for the split: a held-out sum must not be trained on
    # with its operands swapped.
    key = f"{op}:{min(a, b)},{max(a, b)}" if op in "+*" else f"{op}:{a},{b}"
    w = self.max_digits
    return Problem(task=self.name, prompt=f"{a:>{w}}{op}{b:>{w}}", answer=f"{result:>{self.answer_width}}",
                   split_keys=(key,))

  def accepts(self, prompt: str) -> bool:
    w = self.max_digits
    m = re.fullmatch(rf"([ 0-9]{{{w}}})([-+*])([ 0-9]{{{w}}})", prompt)
    if m is None or m[2] not in self.ops:
      return False
    a, b = m[1].strip(), m[3].strip()
    if not (a.isdigit() and b.isdigit()) or f"{int(a):>{w}}" != m[1] or f"{int(b):>{w}}" != m[3]:
      return False
    if m[2] == "-":
      return self.allow_negative or int(a) >= int(b)
    if m[2] == "*":
      return min(len(a), len(b)) <= self.max_multiplier_digits and len(a) + len(b) <= self.answer_width
    return True

  def check(self, problem: Problem, answer_text: str) -> bool:
    """Exact integer match after stripping whitespace ("0627" counts as 627; "627.0", "+627" do not)."""
    if not isinstance(answer_text, str) or len(answer_text) > _MAX_ANSWER_CHARS:
      return False
    text = answer_text.strip()
    return bool(_INTEGER.fullmatch(text)) and int(text) == int(problem.answer)


def _with_digits(rng: np.random.Generator, digits: int) -> int:
  """Uniform integer with exactly `digits` decimal digits (0..9 for one digit)."""
  low = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(low, 10**digits))
