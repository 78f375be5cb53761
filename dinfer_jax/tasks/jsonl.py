"""Tasks from a JSONL file of your own problems: math answers or Python code, verified like the built-ins.

`--task path/to/problems.jsonl` works wherever a task name does (collect, eval, distill). One JSON object
per line:

  {"prompt": "Natalia sold 48 clips ... How many clips did she sell?", "answer": "72"}
  {"prompt": "Write a function is_even(n) ...", "tests": ["assert is_even(2)", "assert not is_even(3)"],
   "setup": "import math"}

- math ("answer"): the model's final answer is its last \\boxed{...}, else what follows its last "####",
  else its last number; it must equal "answer" as a number (exact rationals: "0.5" == "1/2" == "\\frac{1}{2}",
  "1,234" == "1234"), or as text after removing spaces, "$" and a trailing "." when "answer" is not a number.
- code ("tests"): the model's program (its first ``` fenced block, else the whole answer) runs after "setup"
  in `dinfer_jax.tasks.sandbox` (never in-process), and `dinfer_jax.tasks.harness` decides: the asserts are evaluated
  outside the program's process over the plain data its functions returned, so an early exit, an
  atexit hook or an object whose `__eq__` always says True cannot pass. Every test must be one assert
  the harness can split (checked when the file is read). An optional "answer" holds a reference
  solution (unused by the verifier).
- "kind": "math" | "code" (default: "code" when "tests" is given), "id" (default: a hash of the prompt),
  "split": "train" | "test" (default: hashed on the id, 10% test, the same for any path of the file).

Prompts are natural language: collect and eval encode them with the model's own chat template
(`Task.chat`), so this is how a real checkpoint (LLaDA-MoE-7B-A1B with its HF tokenizer) gets its own
trajectories (train_td/README.md, "Ready for LLaDA-MoE-7B-A1B").
"""
from __future__ import annotations

import dataclasses
import fractions
import hashlib
import json
import os
import re
from typing import ClassVar

import numpy as np

from dinfer_jax.prompt_input import read_utf8
from dinfer_jax.tasks import harness, sandbox
from dinfer_jax.tasks.base import Problem, Split, Task

KINDS = ("math", "code")
# Per program: a test suite of a few asserts, not a benchmark harness. The output holds the probe record.
CODE_LIMITS = sandbox.Limits(cpu_seconds=5, wall_seconds=10.0, memory_bytes=512 * 2**20,
                             max_output_bytes=1 << 20)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|$)", re.S)


@dataclasses.dataclass(frozen=True)
class Record:
  id: str
  kind: str
  prompt: str
  answer: str
  tests: tuple[str, ...] = ()
  setup: str = ""
  split: Split | None = None


def _record(d, where: str) -> Record:
  if not isinstance(d, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
  def text(key, required=False):
    v = d.get(key)
    if v is None and not required:
      return None
    if not isinstance(v, str) or not v.strip():
      raise ValueError(f"{where}: {key!r} must be a non-empty string, got {v!r}")
    return v
  prompt = text("prompt", required=True)
  tests = d.get("tests")
  if tests is not None and (not isinstance(tests, list) or not tests or not all(
      isinstance(t, str) and t.strip() for t in tests)):
    raise ValueError(f"{where}: 'tests' must be a non-empty list of strings (asserts), got {tests!r}")
  kind = d.get("kind", "code" if tests is not None else "math")
  if kind not in KINDS:
    raise ValueError(f"{where}: 'kind' must be one of {KINDS}, got {kind!r}")
  answer = text("answer", required=kind == "math")
  if kind == "code" and tests is None:
    raise ValueError(f"{where}: a code problem needs 'tests' (a list of asserts)")
  split = d.get("split")
  if split not in (None, "train", "test"):
    raise ValueError(f"{where}: 'split' must be 'train' or 'test', got {split!r}")
  rid = d.get("id")
  if rid is None:
    rid = hashlib.blake2b(prompt.encode(), digest_size=8).hexdigest()
  elif not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) == "":
    raise ValueError(f"{where}: 'id' must be a non-empty string or an int, got {rid!r}")
  setup = d.get("setup", "")
  if not isinstance(setup, str):
    raise ValueError(f"{where}: 'setup' must be a string, got {setup!r}")
  if tests is not None:
    try:
      harness.split_tests(tests, setup)
    except harness.UnverifiableTest as e:
      raise ValueError(f"{where}: {e}") from None
  # A code problem without a reference solution still needs Problem.answer: the asserts stand in.
  return Record(id=str(rid), kind=kind, prompt=prompt, answer=answer or "\n".join(tests),
                tests=tuple(tests or ()), setup=setup, split=split)


class JsonlTask(Task):
  """The problems of one JSONL file (see the module doc); `name` is the path as given."""
  chat: ClassVar[bool] = True

  def __init__(self, name: str, records: list[Record]):
    if not records:
      raise ValueError(f"{name}: no problems")
    self.name = name
    self.records = records
    self._by_id: dict[str, Record] = {}
    for r in records:
      if r.id in self._by_id:
        raise ValueError(f"{name}: id {r.id!r} occurs twice")
      self._by_id[r.id] = r

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> "JsonlTask":
    records = []
    lines = read_utf8(path, "task file").splitlines()
    for no, line in enumerate(lines, 1):
      if not line.strip():
        continue
      try:
        d = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{no}: not valid JSON ({e.msg})") from None
      records.append(_record(d, f"{path}:{no}"))
    return cls(str(path), records)

  def record(self, problem: Problem) -> Record:
    return self._by_id[problem.split_keys[0]]

  def problem(self, r: Record) -> Problem:
    return Problem(task=self.name, prompt=r.prompt, answer=r.answer, split_keys=(r.id,))

  def generate(self, rng: np.random.Generator) -> Problem:
    return self.problem(self.records[int(rng.integers(len(self.records)))])

  def split_of(self, problem: Problem) -> Split | None:
    r = self.record(problem)
    if r.split is not None:
      return r.split
    # Hashed on the id alone (not the path): the same file splits the same wherever it lies.
    digest = hashlib.blake2b(f"dinfer-jax/train_td/jsonl/v1|{r.id}".encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") / 2.0**64 < self.test_fraction else "train"

  def split_size(self, split: Split) -> int:
    return sum(self.split_of(self.problem(r)) == split for r in self.records)

  def check(self, problem: Problem, answer_text: str) -> bool:
    r = self.record(problem)
    if r.kind == "math":
      return math_equal(final_answer(answer_text), r.answer)
    return harness.check_tests(extract_code(answer_text), r.tests, r.setup, limits=CODE_LIMITS).passed


def _last_boxed(text: str) -> str | None:
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  i, depth = start + len("\\boxed{"), 1
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


def final_answer(text: str) -> str:
  """The final answer of a math solution: last \\boxed{...}, else after the last '####', else the last
  number ('' when there is none)."""
  if not isinstance(text, str):
    return ""
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  if "####" in text:
    tail = text.rsplit("####", 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else ""
  nums = _NUMBER.findall(text)
  return nums[-1] if nums else ""


def _normalise(s: str) -> str:
  s = _FRAC.sub(r"\1/\2", s)
  s = s.replace("$", "").replace("\\!", "").replace(" ", "").strip()
  return s[:-1] if s.endswith(".") else s


def as_number(s: str) -> fractions.Fraction | None:
  """'1,234' / '-0.5' / '3/4' / '\\frac{3}{4}' -> an exact rational; None when `s` is not a number."""
  s = _normalise(s)
  if not _NUMBER.fullmatch(s):
    return None
  try:
    return fractions.Fraction(s.replace(",", ""))
  except (ValueError, ZeroDivisionError):
    return None


def math_equal(pred: str, ref: str) -> bool:
  want = as_number(ref)
  if want is not None:
    return as_number(pred) == want
  return _normalise(pred) == _normalise(ref) != ""


def extract_code(text: str) -> str:
  """The program in an answer: its first ``` fenced block (language tag dropped), else the whole text."""
  m = _FENCE.search(text) if isinstance(text, str) else None
  return m.group(1) if m else (text if isinstance(text, str) else "")
