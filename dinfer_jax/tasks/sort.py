"""Sorting a list of digits: "sort:4,0,9,1,0,1,2,7,0,9,0,1" -> "0,0,0,0,1,1,1,2,4,7,9,9".

The long-answer task: 12..24 numbers give answers of 23..47 characters, decoded in several blocks, which is
where parallel decoding (and trajectory distillation) has room to act; the arithmetic and program answers
fit in one or two blocks of 4.

Format: numbers in columns, every one written with `digits` characters (zero padded), separated by commas,
so the k-th number of the answer always sits at characters (digits+1)k.. whatever the values. The default is
one digit: a short trial of the shipped architecture (300 steps of 32 lists, same settings) reached a
masked-token accuracy of 0.94 on 12-24 single digits against 0.69 on 8-16 two-digit numbers (whose
answers are as long): sorting digits is counting, which a 4-layer model picks up much sooner than ranking
two-digit numbers. `SortTask(digits=2, min_len=8, max_len=16)` is the harder variant with the same answer
length. The chat template and `format_prompt` write a user's "sort 4, 0 9" as "sort:4,0,9"; the verifier
parses the answer's integers, so padding does not matter.

Split: one key, the sorted list (the multiset), so a held-out list is never trained on in any order.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from dinfer_jax.tasks.base import Problem, Task

PREFIX = "sort:"
_ANSWER = re.compile(r"[0-9]+(,[0-9]+)*")
_MAX_ANSWER_CHARS = 256  # bounds the parse of untrusted text; any right answer is far shorter


@dataclasses.dataclass(frozen=True)
class SortTask(Task):
  """Sort n non-negative integers (n uniform in [min_len, max_len]) ascending, duplicates kept.

  Attributes:
    min_len: Fewest numbers in a list.
    max_len: Most numbers in a list.
    digits: Width every number is written with (values are uniform in [0, 10**digits)).
  """
  name: ClassVar[str] = "sort"
  # ~10^8 distinct multisets at the defaults: 5% held out is plenty.
  test_fraction: ClassVar[float] = 0.05

  min_len: int = 12
  max_len: int = 24
  digits: int = 1

  def __post_init__(self):
    if not isinstance(self.digits, int) or isinstance(self.digits, bool) or not 1 <= self.digits <= 4:
      raise ValueError(f"digits must be an int in [1, 4], got {self.digits!r}")
    for f in ("min_len", "max_len"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or not 2 <= v <= 64:
        raise ValueError(f"{f} must be an int in [2, 64], got {v!r}")
    if self.min_len > self.max_len:
      raise ValueError(f"min_len={self.min_len} must not exceed max_len={self.max_len}")

  @property
  def answer_chars(self) -> int:
    """Characters of the longest answer (max_len numbers and the commas between them)."""
    return self.max_len * (self.digits + 1) - 1

  @property
  def prompt_chars(self) -> int:
    """Characters of the longest prompt."""
    return len(PREFIX) + self.answer_chars

  def accepts(self, prompt: str) -> bool:
    if not prompt.startswith(PREFIX):
      return False
    items = prompt[len(PREFIX):].split(",")
    return self.min_len <= len(items) <= self.max_len and all(
        len(x) == self.digits and x.isascii() and x.isdigit() for x in items)

  def write(self, values) -> str:
    return ",".join(f"{int(v):0{self.digits}d}" for v in values)

  def generate(self, rng: np.random.Generator) -> Problem:
    n = int(rng.integers(self.min_len, self.max_len + 1))
    values = [int(v) for v in rng.integers(0, 10**self.digits, size=n)]
    answer = self.write(sorted(values))
    return Problem(task=self.name, prompt=PREFIX + self.write(values), answer=answer,
                   split_keys=(f"sorted:{answer}",))

  def check(self, problem: Problem, answer_text: str) -> bool:
    """The answer's comma-separated integers equal the sorted list (padding and surrounding space free)."""
    if not isinstance(answer_text, str) or len(answer_text) > _MAX_ANSWER_CHARS:
      return False
    text = answer_text.strip()
    if not _ANSWER.fullmatch(text):
      return False
    return [int(v) for v in text.split(",")] == [int(v) for v in problem.answer.split(",")]
