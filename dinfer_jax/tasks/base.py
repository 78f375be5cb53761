"""Problems, the task interface and registry, and the train/test split.

A task draws random problems from a numpy Generator and verifies answer text. The split is fixed by
hashing each problem's *split keys* (not by the seed): a problem is a test problem iff every one of its
keys hashes below the task's test fraction, a training problem iff every key hashes above it, and is
dropped otherwise. So train and test are disjoint in every key, for every seed, by construction; e.g.
program-synthesis problems have two keys (the function and the prompt), so a held-out function is never
trained on with any inputs and a held-out prompt never appears in training even for another function.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
from typing import ClassVar, Literal

import numpy as np

Split = Literal["train", "test"]

# Part of every split hash. Changing it reshuffles which problems are held out, so it carries a version.
_SPLIT_SALT = "dinfer-jax/train_td/split/v1"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance.

  Attributes:
    task: Name of the task that made it.
    prompt: What the model sees, in the internal prompt format (e.g. "348+279").
    answer: Canonical reference answer text (e.g. "627", "x*3+2"), usable as a training target.
    split_keys: Canonical identities of the problem; the split is decided on these (see module doc).
    examples: Input/output pairs shown in the prompt (program synthesis), else empty.
    tests: Held-out input/output pairs the verifier also checks (program synthesis), else empty.
  """
  task: str
  prompt: str
  answer: str
  split_keys: tuple[str, ...]
  examples: tuple[tuple[int, int], ...] = ()
  tests: tuple[tuple[int, int], ...] = ()

  def __post_init__(self):
    for field in ("task", "prompt", "answer"):
      value = getattr(self, field)
      if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty str, got {value!r}")
    if not isinstance(self.split_keys, tuple) or not self.split_keys or not all(
        isinstance(k, str) and k for k in self.split_keys):
      raise ValueError(f"split_keys must be a non-empty tuple of non-empty str, got {self.split_keys!r}")
    for field in ("examples", "tests"):
      pairs = getattr(self, field)
      if not isinstance(pairs, tuple) or not all(
          isinstance(p, tuple) and len(p) == 2 and all(type(v) is int for v in p) for p in pairs):
        raise ValueError(f"{field} must be a tuple of (int, int) pairs, got {pairs!r}")


class Task(abc.ABC):
  """A family of verifiable problems.

  Subclasses set `name` (the registry key, also part of the split hash) and may set `test_fraction`.
  `check` must never raise on malformed answer text and must run model-written code only through
  `dinfer_jax.tasks.sandbox`.
  """
  name: ClassVar[str]
  test_fraction: ClassVar[float] = 0.1
  # Prompts in natural language, for the model's own chat template (train_td.prompting); False: the
  # internal format of train_td's character tokenizer ("348+279"), encoded as <|user|>prompt<|assistant|>.
  chat: ClassVar[bool] = False

  @abc.abstractmethod
  def generate(self, rng: np.random.Generator) -> Problem:
    """Draws one problem; deterministic given the generator's state."""

  @abc.abstractmethod
  def check(self, problem: Problem, answer_text: str) -> bool:
    """Whether `answer_text` (model output, untrusted) solves `problem`."""

  def split_of(self, problem: Problem) -> Split | None:
    """The split `problem` belongs to (None: neither); by default hashed on its split keys."""
    return problem_split(self, problem)

  def accepts(self, prompt: str) -> bool:
    """Whether `prompt` (in the task's own format, as the chat template writes it) is one this task draws:
    what a model trained on the task can be expected to answer. False by default (unknown)."""
    return False

  def split_size(self, split: Split) -> int | None:
    """How many distinct problems `split` holds, when the task knows (a finite file); None: too many to
    count (generated tasks)."""
    return None


_REGISTRY: dict[str, Task] = {}


def register_task(task: Task, *, replace: bool = False) -> Task:
  """Adds a task instance to the registry under `task.name`.

  Args:
    task: The task.
    replace: Allow overwriting a task of the same name.

  Returns:
    `task`, so that a module can write `ARITHMETIC = register_task(ArithmeticTask())`.

  Raises:
    ValueError: For a non-Task, a bad test_fraction, or a name already taken (unless replace).
  """
  if not isinstance(task, Task):
    raise ValueError(f"task must be a Task instance, got {task!r}")
  if not isinstance(getattr(task, "name", None), str) or not task.name:
    raise ValueError(f"task.name must be a non-empty str, got {getattr(task, 'name', None)!r}")
  if not 0.0 < task.test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {task.test_fraction!r}")
  if task.name in _REGISTRY and not replace:
    raise ValueError(f"name {task.name!r} is already registered")
  _REGISTRY[task.name] = task
  return task


def registered(name: str) -> Task | None:
  """The task registered as `name`, or None (tasks.get_task also makes tasks of JSONL files)."""
  return _REGISTRY.get(name)


def task_names() -> tuple[str, ...]:
  """Names of all registered tasks, sorted."""
  return tuple(sorted(_REGISTRY))


def key_split(task: Task, key: str) -> Split:
  """The split one key hashes to (a fixed function of task name and key; no seed involved)."""
  digest = hashlib.blake2b(f"{_SPLIT_SALT}|{task.name}|{key}".encode(), digest_size=8).digest()
  return "test" if int.from_bytes(digest, "big") / 2.0**64 < task.test_fraction else "train"


def problem_split(task: Task, problem: Problem) -> Split | None:
  """The split a problem belongs to, or None when its keys disagree (it is then used by neither)."""
  splits = {key_split(task, k) for k in problem.split_keys}
  return splits.pop() if len(splits) == 1 else None
