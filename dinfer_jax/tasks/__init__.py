"""Verifiable tasks for training and evaluating diffusion LMs: problem generators with held-out splits, their
answer checks, and the sandbox and harness that run model-written code (sandbox.py, harness.py). They live in
the library because both sides use them: train_td trains and collects on them, evaluation/ scores with them,
and a model's generation_config.json names the ones it was trained on (trained_task_of).

Usage:

  from dinfer_jax import tasks
  task = tasks.get_task("arithmetic")
  train = tasks.train_problems(task, 10_000, seed=0)   # or tasks.iter_problems(task, "train", seed)
  test = tasks.test_problems(task, 500)                  # disjoint from every training draw
  ok = task.check(test[0], model_answer_text)

Built-in tasks ("arithmetic", "program", "sort", "add", "split") are registered on import. To add one, subclass `Task`
(`name`, `generate`, `check`) and call `register_task(MyTask())`.
"""
from dinfer_jax.tasks.arithmetic import ArithmeticTask
from dinfer_jax.tasks.base import Problem, Split, Task, key_split, problem_split, register_task, task_names
from dinfer_jax.tasks.registry import (check_all, get_task, iter_problems, test_problems, train_problems,
                                       trained_task_of)
from dinfer_jax.tasks.longadd import LongAddTask
from dinfer_jax.tasks.program import DOMAIN, FAMILIES, Family, ProgramTask, canonical_functions
from dinfer_jax.tasks.sort import SortTask
from dinfer_jax.tasks.split import SplitTask

ARITHMETIC = register_task(ArithmeticTask())
PROGRAM = register_task(ProgramTask())
SORT = register_task(SortTask())
ADD = register_task(LongAddTask())
SPLIT = register_task(SplitTask())

__all__ = [
    "ADD", "ARITHMETIC", "ArithmeticTask", "LongAddTask", "DOMAIN", "FAMILIES", "Family", "PROGRAM", "Problem", "ProgramTask",
    "SORT", "SPLIT", "SortTask", "SplitTask", "Split", "Task", "canonical_functions", "check_all", "get_task", "iter_problems", "key_split",
    "problem_split", "register_task", "task_names", "test_problems", "train_problems", "trained_task_of",
]
