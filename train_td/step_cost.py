"""Seconds per training step of each task's batches, to size a run before starting it.

  python -m train_td.step_cost --mix arithmetic=0.58,program=0.32,sort=0.10 --batch-size 128 --max-position 128 \
      [--steps 4400] [--rounds 6]

Compiles the train step once per task's batch shape, then runs the tasks' batches in interleaved rounds
(the first round is warm-up), so that load from other processes hits every task alike; prints the median
seconds per step of each task, their mix-weighted mean, and with --steps the estimated wall time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np

from dinfer_jax import cli_help
from train_td import data as data_lib, trainer


def measure(tc, rounds: int = 6) -> dict[str, float]:
  dc = tc.data_config()
  step = trainer._default_step(tc)
  params, opt_state = trainer.init_state(tc)
  # One batch of each task: the data config with only that task in its mix.
  batches = {name: data_lib.get_batch(dataclasses.replace(dc, mix=((name, 1.0),)), 0)[1] for name, _ in tc.mix}
  times: dict[str, list[float]] = {name: [] for name in batches}
  key = jax.random.PRNGKey(0)
  for r in range(rounds):
    for name, b in batches.items():
      t = time.perf_counter()
      params, opt_state, m = step(params, opt_state, b, key)
      jax.block_until_ready(m["loss"])
      if r:
        times[name].append(time.perf_counter() - t)
  return {name: float(np.median(v)) for name, v in times.items()}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  ap.add_argument("--mix", required=True, help="e.g. arithmetic=0.58,program=0.32,sort=0.10")
  ap.add_argument("--batch-size", type=int, default=128)
  ap.add_argument("--max-position", type=int, default=64)
  ap.add_argument("--steps", type=int, default=0, help="print the estimated wall time of a run this long")
  ap.add_argument("--rounds", type=int, default=6)
  a = ap.parse_args(argv)
  if a.rounds < 2:
    raise SystemExit("error: --rounds must be >= 2 (the first round is warm-up)")
  mix = tuple((n, float(w)) for n, w in (item.split("=") for item in a.mix.split(",")))
  tc = trainer.TrainConfig(mix=mix, batch_size=a.batch_size, max_position=a.max_position)
  per_task = measure(tc, a.rounds)
  total = sum(w for _, w in mix)
  mean = sum(per_task[n] * w / total for n, w in mix)
  out = {"seconds_per_step": {n: round(s, 3) for n, s in per_task.items()}, "mix_mean": round(mean, 3)}
  if a.steps:
    out["estimated_minutes"] = round(mean * a.steps / 60, 1)
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
