"""Long addition: "add:  482139017771234567890123+..." -> the sum, right-aligned in columns.

The long-answer task that replaced `sort` as the default model's third task. Both operands have 8..24
digits and are right-aligned to 24 columns, the answer to 25 (`answer_chars`), so answer digit k always
sits at a fixed offset from the two operand digits of its column, as in the `arithmetic` task. 25
characters + <|eos|> fill four blocks of 8 at generation time.

Why addition and not sorting: an answer digit depends on its own column and on the carry from the columns
to its right, which nearly always is decided by the next column alone (a carry runs further only through
columns summing to 9). A small model learns that local rule quickly; sorting needs counting over the whole
list, which the 4-layer default model did not learn in a full training run (0/200 held-out lists exact,
train_td/README.md). The carries are also what makes parallel decoding interesting here: a digit whose
column sums to 9 is uncertain until the column to its right is known, so the base model commits most digits
at once and the rest a few at a time, and trajectory distillation has something to compress.

Split: one key, the unordered pair of operands, so a held-out sum is never trained on in either order.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from dinfer_jax.tasks.base import Problem, Task

PREFIX = "add:"
_MAX_ANSWER_CHARS = 128  # bounds the parse of untrusted text; any right answer is far shorter


@dataclasses.dataclass(frozen=True)
class LongAddTask(Task):
  """a + b for operands of min_digits..max_digits digits (length uniform, then value uniform).

  Attributes:
    min_digits: Fewest digits of an operand.
    max_digits: Most digits of an operand; also the column width operands are right-aligned to.
  """
  name: ClassVar[str] = "add"
  test_fraction: ClassVar[float] = 0.05

  min_digits: int = 8
  max_digits: int = 24

  def __post_init__(self):
    for f in ("min_digits", "max_digits"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 40:
        raise ValueError(f"{f} must be an int in [1, 40], got {v!r}")
    if self.min_digits > self.max_digits:
      raise ValueError(f"min_digits={self.min_digits} must not exceed max_digits={self.max_digits}")

  @property
  def answer_chars(self) -> int:
    """Width of every answer (the sum right-aligned)."""
    return self.max_digits + 1

  @property
  def prompt_chars(self) -> int:
    return len(PREFIX) + 2 * self.max_digits + 1

  def write(self, a: int, b: int) -> str:
    return f"{PREFIX}{a:>{self.max_digits}}+{b:>{self.max_digits}}"

  def accepts(self, prompt: str) -> bool:
    w = self.max_digits
    m = re.fullmatch(rf"{PREFIX}([ 0-9]{{{w}}})\+([ 0-9]{{{w}}})", prompt)
    if m is None:
      return False
    ops = [x.strip() for x in (m[1], m[2])]
    return all(o.isdigit() and not o.startswith("0") and self.min_digits <= len(o) <= w for o in ops) and (
        self.write(int(ops[0]), int(ops[1])) == prompt)

  def _operand(self, rng: np.random.Generator) -> int:
    n = int(rng.integers(self.min_digits, self.max_digits + 1))
    # digit by digit: 10**24 overflows int64 sampling
    digits = [int(rng.integers(1, 10))] + [int(d) for d in rng.integers(0, 10, size=n - 1)]
    return int("".join(map(str, digits)))

  def generate(self, rng: np.random.Generator) -> Problem:
    a, b = self._operand(rng), self._operand(rng)
    return Problem(task=self.name, prompt=self.write(a, b), answer=f"{a + b:>{self.answer_chars}}",
                   split_keys=(f"pair:{min(a, b)}+{max(a, b)}",))

  def check(self, problem: Problem, answer_text: str) -> bool:
    """The answer, stripped of its alignment spaces, is the decimal sum."""
    if not isinstance(answer_text, str) or len(answer_text) > _MAX_ANSWER_CHARS:
      return False
    text = answer_text.strip()
    return text.isascii() and text.isdigit() and int(text) == int(problem.answer)
