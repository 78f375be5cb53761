"""Integer arithmetic with carries: "348+279" -> "627".

Operand sizes: for + and -, each operand gets a digit count drawn uniformly from 1..max_digits and then a
uniform value with that many digits (so small problems, which users also type, are not vanishingly
rare next to 3-digit ones). For *, the pair of digit counts is drawn uniformly from those whose sum is
at most max_product_digits (2-by-2, 3-by-1, 1-by-3, 2-by-1, ...). Subtraction may go negative
("27-348" -> "-321") unless allow_negative=False, in which case the operands are ordered so that the
result is >= 0: users ask both ways round, and the sign is one extra token to learn.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from train_td.tasks.base import Problem, Task

_INTEGER = re.compile(r"-?[0-9]+")
_MAX_ANSWER_CHARS = 64  # longer text is wrong anyway; bounds the int() parse


@dataclasses.dataclass(frozen=True)
class ArithmeticTask(Task):
  """Addition, subtraction and multiplication of small non-negative integers.

  Attributes:
    ops: Operators to draw from, a subset of "+-*".
    max_digits: Most digits of an operand.
    max_product_digits: Most digits of both multiplication operands together.
    allow_negative: Whether a-b may be drawn with b > a.
  """
  name: ClassVar[str] = "arithmetic"
  # The problem space is large (~10^6 sums alone); 5% held out is plenty and keeps most small
  # problems trainable.
  test_fraction: ClassVar[float] = 0.05

  ops: str = "+-*"
  max_digits: int = 3
  max_product_digits: int = 4
  allow_negative: bool = True

  def __post_init__(self):
    if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set("+-*") or len(set(
        self.ops)) != len(self.ops):
      raise ValueError(f"ops must be distinct characters from '+-*', got {self.ops!r}")
    if not isinstance(self.max_digits, int) or not 1 <= self.max_digits <= 9:
      raise ValueError(f"max_digits must be an int in [1, 9], got {self.max_digits!r}")
    mpd = self.max_product_digits
    if not isinstance(mpd, int) or not 2 <= mpd <= 2 * self.max_digits:
      raise ValueError(f"max_product_digits must be an int in [2, 2*max_digits], got {mpd!r}")
    if not isinstance(self.allow_negative, bool):
      raise ValueError(f"allow_negative must be a bool, got {self.allow_negative!r}")

  def generate(self, rng: np.random.Generator) -> Problem:
    op = self.ops[int(rng.integers(len(self.ops)))]
    if op == "*":
      shapes = [(i, j) for i in range(1, self.max_digits + 1) for j in range(1, self.max_digits + 1)
                if i + j <= self.max_product_digits]
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
    return Problem(task=self.name, prompt=f"{a}{op}{b}", answer=str(result), split_keys=(key,))

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
