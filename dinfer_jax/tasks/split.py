"""Splitting a number: "split:573" -> any two non-negative numbers that add up to it, e.g. "251+322".

The task with many right answers, which is what real text is like and the other tasks are not. Every answer
of `arithmetic`, `program` and `add` is a function of its prompt, so a model trained on them is confident in
every answer position at once and decodes each block in one forward: trajectory distillation has nothing to
compress there (train_td/README.md). Here the training answers split N column by column without carries
(each column's digit n is split into a uniform a in 0..n and n - a), so the masked-diffusion model learns a
*spread* marginal over the first addend's digits: a column is not confident until one of its two digits is
committed, and the threshold decoder commits about one digit per forward. The model's own trajectory picks
one answer per prompt (the engine is greedy), and its compressed transitions teach the TD model to commit to
that answer in one go: the setting in which dInfer's LLaDA-MoE-TD doubles the tokens per forward of a real LLM.

Why without carries: a split with carries (a uniform in 0..N) makes every digit depend on the digits to its
right through the borrow, and the 4-layer model fine-tuned on it for 1000 steps wrote consistent pairs for 6%
of held-out numbers; column by column, a digit depends only on its own column's other digit.

Answers are written in columns: both addends zero-padded to `digits` columns around the "+" (`"251+322"`),
2 * digits + 1 characters + <|eos|> = one block of 8 at 3 digits, so the digits of a column sit at fixed
offsets from each other and from N's digit. The verifier accepts any two numbers that add up to N, however
written (carries, spaces, no padding).

Split: one key, N itself, so a held-out number is never trained on with any answer.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from dinfer_jax.tasks.base import Problem, Task

PREFIX = "split:"
_ANSWER = re.compile(r"\s*([0-9]+)\s*\+\s*([0-9]+)\s*")
_MAX_ANSWER_CHARS = 64  # bounds the parse of untrusted text; any right answer is far shorter


@dataclasses.dataclass(frozen=True)
class SplitTask(Task):
  """N uniform in [0, 10**digits), the training answer a + b split column by column: a's digit uniform in
  0..N's digit, b's the rest.

  Attributes:
    digits: Most digits of N; also the column width of N and of both addends.
  """
  name: ClassVar[str] = "split"
  test_fraction: ClassVar[float] = 0.2

  digits: int = 3

  def __post_init__(self):
    if not isinstance(self.digits, int) or isinstance(self.digits, bool) or not 1 <= self.digits <= 6:
      raise ValueError(f"digits must be an int in [1, 6], got {self.digits!r}")

  @property
  def answer_chars(self) -> int:
    """Width of every training answer (both addends right-aligned, and the "+")."""
    return 2 * self.digits + 1

  def write(self, n: int) -> str:
    return f"{PREFIX}{n:>{self.digits}}"

  def accepts(self, prompt: str) -> bool:
    body = prompt[len(PREFIX):] if prompt.startswith(PREFIX) else ""
    return len(body) == self.digits and body.strip().isascii() and body.strip().isdigit() and (
        self.write(int(body)) == prompt)

  def write_answer(self, a: int, b: int) -> str:
    return f"{a:0{self.digits}d}+{b:0{self.digits}d}"

  def generate(self, rng: np.random.Generator) -> Problem:
    n = int(rng.integers(0, 10**self.digits))
    cols = [int(c) for c in f"{n:0{self.digits}d}"]
    a_cols = [int(rng.integers(0, c + 1)) for c in cols]
    a = int("".join(map(str, a_cols)))
    return Problem(task=self.name, prompt=self.write(n), answer=self.write_answer(a, n - a),
                   split_keys=(f"n:{n}",))

  def check(self, problem: Problem, answer_text: str) -> bool:
    """Two decimal numbers joined by "+" (spaces anywhere around them) whose sum is the prompt's N."""
    if not isinstance(answer_text, str) or len(answer_text) > _MAX_ANSWER_CHARS or not answer_text.isascii():
      return False
    m = _ANSWER.fullmatch(answer_text)
    if m is None:
      return False
    return int(m[1]) + int(m[2]) == int(problem.prompt[len(PREFIX):])
