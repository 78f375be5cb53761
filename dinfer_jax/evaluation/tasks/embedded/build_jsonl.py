"""Writes the embedded model's held-out problems as the JSONL files its lm-eval tasks read:

    python -m dinfer_jax.evaluation.tasks.embedded.build_jsonl [--n 200] [--seed 0]

The same problems, in the same order, as `python -m train_td eval --task T --n N --seed S` (train_td's
held-out split), so the two evaluations score the same set.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import tempfile

from dinfer_jax import tasks as tasks_lib

HERE = pathlib.Path(__file__).parent
TASKS = ("arithmetic", "program")


def write(task: str, n: int, seed: int, out_dir: pathlib.Path = HERE) -> pathlib.Path:
  rows = [dataclasses.asdict(p) for p in tasks_lib.test_problems(task, n, seed)]
  path = out_dir / f"{task}_test.jsonl"
  fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  os.replace(tmp, path)  # atomic: a reader never sees half a file
  return path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m dinfer_jax.evaluation.tasks.embedded.build_jsonl")
  ap.add_argument("--n", type=int, default=200)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  for t in TASKS:
    print(write(t, args.n, args.seed))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
