"""Tasks by name: the registry's lookups (a registered name, or a FILE.jsonl of your own problems) and the
helpers that take a task or its name."""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from dinfer_jax.tasks.base import Problem, Split, Task, register_task, registered, task_names
from dinfer_jax.tasks.jsonl import JsonlTask


def get_task(name: str) -> Task:
  """The registered task called `name`; a path ending in .jsonl is a task of that file's problems
  (tasks.jsonl, registered under the path on first use). ValueError listing the known ones otherwise."""
  task = registered(name) if isinstance(name, str) else None
  if task is not None:
    return task
  if isinstance(name, str) and name.endswith(".jsonl"):
    return register_task(JsonlTask.from_file(name))
  raise ValueError(f"name: unknown task {name!r}; known: {sorted(task_names())} or a FILE.jsonl of your own "
                   "problems")


def iter_problems(task: Task | str, split: Split, seed: int, *, unique: bool = False,
                  max_attempts: int | None = None) -> Iterator[Problem]:
  """Endless stream of problems of one split, deterministic for (task, split, seed).

  Args:
    task: A task or a registered name.
    split: "train" or "test".
    seed: Sampling seed. It does not move the split: held-out problems stay held out for every seed.
    unique: Skip problems whose prompt was already yielded.
    max_attempts: Stop (RuntimeError) after this many draws without a new problem; default scales
      with the rarity of the split.

  Yields:
    Problems `p` with `problem_split(task, p) == split`.
  """
  task = get_task(task) if isinstance(task, str) else task
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  if max_attempts is None:
    max_attempts = 100_000
  # Different streams for train and test so that the same seed does not pair them up.
  rng = np.random.default_rng([seed, 0 if split == "train" else 1])
  seen: set[str] = set()
  misses = 0
  size = task.split_size(split) if unique else None
  while True:
    if size is not None and len(seen) >= size:
      raise RuntimeError(f"{task.name}: no new {split} problem (found all {size} distinct ones; ask for at most "
                         "that many)")
    problem = task.generate(rng)
    if task.split_of(problem) != split or (unique and problem.prompt in seen):
      misses += 1
      if misses >= max_attempts:
        found = f" (found {len(seen)} distinct ones; ask for at most that many)" if unique else ""
        raise RuntimeError(f"{task.name}: no new {split} problem in {max_attempts} draws{found}")
      continue
    misses = 0
    if unique:
      seen.add(problem.prompt)
    yield problem


def train_problems(task: Task | str, n: int, seed: int) -> list[Problem]:
  """`n` training problems (repeats possible, as in sampling), deterministic for the seed."""
  return _take(iter_problems(task, "train", seed), n)


def test_problems(task: Task | str, n: int, seed: int = 0) -> list[Problem]:
  """`n` distinct held-out problems, none of which can occur in any `train_problems` output."""
  return _take(iter_problems(task, "test", seed, unique=True), n)


# pytest would otherwise collect `test_problems` from any test module that imports it by name.
test_problems.__test__ = False


def _take(it: Iterator[Problem], n: int) -> list[Problem]:
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"n must be an int >= 0, got {n!r}")
  return [next(it) for _ in range(n)]


def check_all(task: Task | str, problems: Sequence[Problem], answers: Sequence[str]) -> list[bool]:
  """`task.check` over paired problems and answers."""
  task = get_task(task) if isinstance(task, str) else task
  if len(problems) != len(answers):
    raise ValueError(f"answers: {len(answers)} answers for {len(problems)} problems")
  return [task.check(p, a) for p, a in zip(problems, answers)]


def trained_task_of(task_names, prompt: str) -> str | None:
  """The first of `task_names` (registered tasks) whose problems `prompt` could be, or None."""
  for name in task_names:
    if get_task(name).accepts(prompt):
      return name
  return None
