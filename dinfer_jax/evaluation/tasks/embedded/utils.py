"""lm-eval hooks of the embedded model's tasks: the local JSONL held-out sets and train_td's own checks
(exact integer match for arithmetic, the sandboxed program run for program synthesis)."""
from __future__ import annotations

import json
import pathlib

import datasets

from dinfer_jax import tasks as tasks_lib
from dinfer_jax.tasks.base import Problem

HERE = pathlib.Path(__file__).parent


def _load(task: str):
  rows = [json.loads(l) for l in (HERE / f"{task}_test.jsonl").read_text().splitlines() if l.strip()]
  return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_arithmetic(**_):
  return _load("arithmetic")


def load_program(**_):
  return _load("program")


def _problem(doc):
  pairs = lambda v: tuple((int(a), int(b)) for a, b in (v or ()))
  return Problem(task=doc["task"], prompt=doc["prompt"], answer=doc["answer"],
                 split_keys=tuple(doc["split_keys"]), examples=pairs(doc["examples"]), tests=pairs(doc["tests"]))


def process_results(doc, results):
  return {"acc": float(bool(tasks_lib.get_task(doc["task"]).check(_problem(doc), results[0])))}
