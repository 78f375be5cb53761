"""TD loss ablation: compressed transition alone, + masked-diffusion mix, + certainty forcing.

  python -m train_td.ablation --base default --data WORK/data/arithmetic,WORK/data/program,WORK/data/add \
      --work WORK/ablation --tasks arithmetic,program,add --n 200 --steps 1500 --md train_td/ablation.md

Each variant is a TD run on the same trajectories with the same schedule and seed (train_td.td_train;
resumed if its run directory has checkpoints), exported next to it and evaluated with the base model next
to it on the same held-out problems, all decoded with the base model's generation settings
(generation_config.json + its prompt rule per task, e.g. the long gen_length of add).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

from dinfer_jax import cli_help
import dinfer_jax
from dinfer_jax import tasks as tasks_lib
from dinfer_jax.cli_common import read_generation_file
from train_td import evaluate, export, td_train

VARIANTS = (("transition", 0.0, 0.0), ("transition+mdm", 0.5, 0.0), ("transition+mdm+cf", 0.5, 0.5))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  ap.add_argument("--base", default="default")
  ap.add_argument("--data", required=True, help="collect directories, comma-separated")
  ap.add_argument("--work", required=True)
  ap.add_argument("--tasks", default="arithmetic,program,add")
  ap.add_argument("--n", type=int, default=200, help="held-out problems per task")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--eval-batch", type=int, default=100)
  ap.add_argument("--steps", type=int, default=1500)
  ap.add_argument("--batch-size", type=int, default=128)
  ap.add_argument("--lr", type=float, default=5e-4)
  ap.add_argument("--warmup-steps", type=int, default=50)
  ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
  ap.add_argument("--md", required=True)
  ap.add_argument("--no-progress", action="store_true")
  a = ap.parse_args(argv)

  known = {v[0]: v for v in VARIANTS}
  chosen = [known[v] for v in a.variants.split(",")] if all(v in known for v in a.variants.split(",")) else None
  if chosen is None:
    raise SystemExit(f"error: --variants: choose from {', '.join(known)}")
  tasks = a.tasks.split(",")
  base = dinfer_jax.load(a.base)
  work = pathlib.Path(a.work)
  models = [("base", base)]
  for name, mdm, cf in chosen:
    run = work / name
    tdc = td_train.TDConfig(data=a.data, base=a.base, mdm_weight=mdm, cf_weight=cf)
    td_train.train(tdc, run, progress=not a.no_progress, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                   warmup_steps=a.warmup_steps, seed=a.seed, ckpt_every=max(1, a.steps // 6), log_every=10)
    export.export_run(run, work / f"{name}-hf", generation_config=read_generation_file(base.path) or None)
    models.append((name, dinfer_jax.load(work / f"{name}-hf")))
  rows = []
  for task in tasks:
    gcfg = evaluate.task_generation_config(argparse.Namespace(), base.path, task)
    problems = tasks_lib.test_problems(task, a.n, a.seed)
    for name, model in models:
      r = evaluate.evaluate(model, task, a.n, gcfg, seed=a.seed, batch=a.eval_batch, problems=problems)
      rows.append({"variant": name, "task": task, "accuracy": r["accuracy"], "mean_tpf": r["mean_tpf"],
                   "mean_nfe": r["mean_nfe"]})
      print(json.dumps(rows[-1]), flush=True)
  command = "python -m train_td.ablation " + " ".join(argv if argv is not None else sys.argv[1:])
  out = [f"Command: `{command}`  ", f"Date: {datetime.date.today().isoformat()}; held-out problems; base "
         "model's generation settings for every row.", "",
         "| task | variant | accuracy | mean TPF | mean NFE | TPF vs base |", "|---|---|---|---|---|---|"]
  for task in tasks:
    b = next(r for r in rows if r["task"] == task and r["variant"] == "base")
    for r in (r for r in rows if r["task"] == task):
      out.append(f"| {task} | {r['variant']} | {r['accuracy']:.3f} | {r['mean_tpf']:.2f} | {r['mean_nfe']:.2f} | "
                 f"{r['mean_tpf'] / max(b['mean_tpf'], 1e-9):.2f}x |")
  pathlib.Path(a.md).write_text("\n".join(out) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
