"""The TD variant of a base model in one command: collect golden trajectories per task, train --td, export.

  python -m train_td distill --base default --out dinfer_jax/assets/default-td --work /work/runs/td \
      [--tasks split,arithmetic,program,add] [--n split=799,...] [--task-weights split=0.4,...] [--steps 1000 ...]

Every stage resumes: collect skips finished shards (under jax.distributed each process collects its share;
the training and export stages are single-process), the run resumes from its last checkpoint; an existing
--out is refused before any work unless --overwrite is given and it is a model directory. Trajectories are
decoded with the base model's own generation settings (generation_config.json and its prompt rules), the
setting the TD model is then evaluated at; the export ships the same generation_config.json, so base and TD
decode identically unless told otherwise (`--threshold`: a TD model commits several tokens per forward, and a
stricter threshold buys back the answers it mixes; the shipped default-td decodes at its base's 0.9).
The flags' defaults are the shipped default-td's recipe.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax

import dinfer_jax
from dinfer_jax import tasks as tasks_lib
from dinfer_jax.cli_common import PROMPT_RULES, generation_knobs, read_generation_file
from train_td import collect, evaluate, export, td_train


def parse_counts(spec: str, tasks: list[str]) -> dict[str, int]:
  counts = {}
  for item in (s for s in spec.split(",") if s):
    name, _, v = item.partition("=")
    if not v.isdigit():
      raise ValueError(f"--n: expected TASK=N items, got {item!r}")
    counts[name] = int(v)
  missing = [t for t in tasks if t not in counts]
  if missing:
    raise ValueError(f"--n gives no count for task(s) {missing}")
  return counts


def main(args) -> int:
  tasks = [t for t in args.tasks.split(",") if t]
  for t in tasks:
    tasks_lib.get_task(t)
  counts = parse_counts(args.n, tasks)
  weights = args.task_weights  # parsed by the CLI: ((task, weight), ...), () = by trajectories
  if weights and sorted(n for n, _ in weights) != sorted(tasks):
    raise ValueError(f"--task-weights must name exactly the --tasks {tasks}, got {[n for n, _ in weights]}")
  work = pathlib.Path(args.work)
  overwrite = args.overwrite
  # Refuse a bad --out now, not after an hour of collecting and training.
  export.check_out(args.out, overwrite=overwrite)
  base = dinfer_jax.load(args.base)
  gen = read_generation_file(base.path)
  if args.threshold is not None:
    gen = dict(gen, threshold=args.threshold)
    # Refused before any work if the settings it makes are invalid (e.g. the base's low_threshold above
    # it): the file's defaults and each prompt rule applied to them.
    for prefix in [None] + [r.get("prefix", "") for r in gen.get(PROMPT_RULES, [])]:
      dinfer_jax.GenerationConfig(**generation_knobs(gen, prefix))
  t0 = time.time()
  stages = {}
  dirs = []
  for t in tasks:
    gcfg = evaluate.task_generation_config(argparse.Namespace(), base.path, t, base.tokenizer, split="train",
                                           seed=args.seed)
    cc = collect.CollectConfig(model=args.base, task=t, n=counts[t], seed=args.seed, batch=args.batch,
                               generation=tuple(sorted(dataclasses.asdict(gcfg).items())))
    d = work / "data" / t
    ts = time.time()
    got = collect.collect(base, cc, d, progress=not args.no_progress, process_index=jax.process_index(),
                          process_count=jax.process_count())
    stages[f"collect_{t}"] = dict(got, seconds=round(time.time() - ts, 1))
    dirs.append(str(d))
  tdc = td_train.TDConfig(data=",".join(dirs), base=args.base, mdm_weight=args.mdm_weight, cf_weight=args.cf_weight,
                          task_weights=weights)
  ts = time.time()
  run = work / "run"
  out = td_train.train(tdc, run, progress=not args.no_progress, steps=args.steps, batch_size=args.batch_size,
                       lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed, ckpt_every=args.ckpt_every,
                       log_every=10)
  stages["train"] = {"step": out["step"], "seconds": round(time.time() - ts, 1)}
  stages["export"] = export.export_run(run, args.out, generation_config=gen or None, overwrite=overwrite)
  print(json.dumps({"stages": stages, "seconds": round(time.time() - t0, 1), "out": args.out}))
  return 0
