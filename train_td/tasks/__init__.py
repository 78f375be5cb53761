"""Verifiable tasks for training and evaluating small diffusion LMs.

Usage:

  from train_td import tasks
  task = tasks.get_task("arithmetic")
  train = tasks.train_problems(task, 10_000, seed=0)   # or tasks.iter_problems(task, "train", seed)
  test = tasks.test_problems(task, 500)                  # disjoint from every training draw
  ok = task.check(test[0], model_answer_text)

Built-in tasks ("arithmetic", "program", "sort", "add", "split") are registered on import. To add one, subclass `Task`
(`name`, `generate`, `check`) and call `register_task(MyTask())`.
"""
from train_td.tasks.arithmetic import ArithmeticTask
from train_td.tasks.base import (Problem, Split, Task, check_all, get_task, iter_problems, key_split,
                                 problem_split, register_task, task_names, test_problems,
                                 train_problems, trained_task_of)
from train_td.tasks.longadd import LongAddTask
from train_td.tasks.program import DOMAIN, FAMILIES, Family, ProgramTask, canonical_functions
from train_td.tasks.sort import SortTask
from train_td.tasks.split import SplitTask

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
