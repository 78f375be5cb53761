"""Splitting a number: "split:573" -> any two non-negative numbers that add up to it, e.g. "215+358".

The task with many right answers, which is what real text is like and the other tasks are not. Every answer
of `arithmetic`, `program` and `add` is a function of its prompt, so a model trained on them is confident in
every answer position at once and decodes each block in one forward: trajectory distillation has nothing to
compress there (train_td/README.md). Here the training answers draw the first addend uniformly from 0..N, so
the masked-diffusion model learns a *spread* marginal over the addend's digits: no digit is confident until
the ones committed before it pin the rest down, and the threshold decoder commits about one digit per forward.
The model's own trajectory picks one answer per prompt (the engine is greedy), and its compressed transitions
teach the TD model to commit to that answer in one go: the setting in which dInfer's LLaDA-MoE-TD doubles the
tokens per forward of a real LLM.

Answers are written in columns as the arithmetic task writes them: both addends right-aligned to `digits`
columns around the "+" (`" 15+558"`), 2 * digits + 1 characters + <|eos|> = one block of 8 at 3 digits, so
the second addend's digit k always sits at a fixed offset from the first's and from N's (b = N - a, column by
column). Any spacing is accepted by the verifier.

Split: one key, N itself, so a held-out number is never trained on with any answer.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from train_td.tasks.base import Problem, Task

PREFIX = "split:"
_ANSWER = re.compile(r"\s*([0-9]+)\s*\+\s*([0-9]+)\s*")
_MAX_ANSWER_CHARS = 64  # bounds the parse of untrusted text; any right answer is far shorter


@dataclasses.dataclass(frozen=True)
class SplitTask(Task):
  """N uniform in [0, 10**digits), the training answer a + (N - a) with a uniform in [0, N].

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

  def write_answer(self, a: int, b: int) -> str:
    return f"{a:>{self.digits}}+{b:>{self.digits}}"

  def generate(self, rng: np.random.Generator) -> Problem:
    n = int(rng.integers(0, 10**self.digits))
    a = int(rng.integers(0, n + 1))
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
