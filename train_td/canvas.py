"""Does the answer depend on the canvas? Held-out accuracy, TPF and forwards per canvas length.

  python -m train_td.canvas --model default --task arithmetic,program,add,split \
      --n arithmetic=400,program=433,add=400,split=200 --seed 7 --gen-lengths 8,16,32,64 [--block-lengths 8] \
      --md train_td/canvas.md

A user who asks for more room (`--max-new-tokens 64`, or gen_length 64) gets a longer canvas of masks after
the answer; a model trained on one canvas length may answer differently on another. Every other knob is the
model's generation_config.json with its prompt rule for the task; a task whose answer region does not fit a
canvas (a 26-token long sum in 8 or 16) is skipped there. The spread column is the largest accuracy
difference between two canvases of a task; the last column counts the problems answered with the same text on
every canvas.
"""
from __future__ import annotations

import argparse
import datetime
import sys

import dinfer_jax
from dinfer_jax import tasks as tasks_lib
from train_td import data as data_lib, distill, evaluate


def _ints(text: str) -> tuple[int, ...]:
  out = tuple(int(v) for v in text.split(",") if v.strip())
  if not out or min(out) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers like 8,16,32, got {text!r}")
  return out


def sweep(model, task: str, n: int, seed: int, gen_lengths, block_lengths, batch: int = 100, progress=None):
  """Rows (task, gen_length, block_length, accuracy, mean TPF, mean NFE) over the canvases that hold the
  task's answer region."""
  args = argparse.Namespace()
  base = evaluate.task_generation_config(args, model.path, task, model.tokenizer)
  need = data_lib.DataConfig().answer_len_for(task)
  problems = tasks_lib.test_problems(task, n, seed)
  rows = []
  for L in gen_lengths:
    for blk in block_lengths:
      if L < need or L % blk:
        continue
      gcfg = base.replace(gen_length=L, block_length=blk)
      r = evaluate.evaluate(model, task, n, gcfg, seed=seed, batch=batch, problems=problems)
      rows.append({"task": task, "gen_length": L, "block_length": blk, "accuracy": r["accuracy"],
                   "correct": r["correct"], "n": r["n"], "mean_tpf": r["mean_tpf"], "mean_nfe": r["mean_nfe"],
                   "answers": list(r["answers"])})
      if progress:
        progress(rows[-1])
  return rows


def spread(rows, task: str) -> float:
  acc = [r["accuracy"] for r in rows if r["task"] == task]
  return max(acc) - min(acc) if acc else 0.0


def same_answers(rows, task: str) -> tuple[int, int]:
  """(problems whose answer text is the same on every canvas of `task`, problems): accuracy can match while
  answers differ (one right answer lost at 64, another gained), so this is the stricter reading."""
  runs = [r["answers"] for r in rows if r["task"] == task and "answers" in r]
  if not runs:
    return 0, 0
  return sum(len(set(per)) == 1 for per in zip(*runs)), len(runs[0])


def to_markdown(rows, command: str) -> str:
  out = [f"Command: `{command}`  ", f"Date: {datetime.date.today().isoformat()}; held-out problems; the model's "
         "own settings otherwise.", "", "| task | gen_length | block | accuracy | mean TPF | mean NFE |",
         "|---|---|---|---|---|---|"]
  for r in rows:
    out.append(f"| {r['task']} | {r['gen_length']} | {r['block_length']} | {r['accuracy']:.4f} ({r['correct']}/"
               f"{r['n']}) | {r['mean_tpf']:.2f} | {r['mean_nfe']:.2f} |")
  out += ["", "| task | accuracy spread over canvases (points) | same answer on every canvas |", "|---|---|---|"]
  for task in dict.fromkeys(r["task"] for r in rows):
    same, n = same_answers(rows, task)
    out.append(f"| {task} | {100 * spread(rows, task):.2f} | " + (f"{same}/{n} ({same / n:.3f}) |" if n else "- |"))
  return "\n".join(out) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train_td.canvas", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--task", default="arithmetic,program,add,split")
  p.add_argument("--n", default="400", help="held-out problems per task: N, or TASK=N,... (e.g. program=433, "
                 "every held-out program function)")
  p.add_argument("--seed", type=int, default=7)
  p.add_argument("--batch", type=int, default=100)
  p.add_argument("--gen-lengths", type=_ints, default=(8, 16, 32, 64))
  p.add_argument("--block-lengths", type=_ints, default=(8,))
  p.add_argument("--md", default=None, help="write the table here")
  args = p.parse_args(argv)
  tasks = [t for t in args.task.split(",") if t]
  try:
    counts = {t: int(args.n) for t in tasks} if args.n.isdigit() else distill.parse_counts(args.n, tasks)
  except ValueError as e:
    p.error(str(e))
  model = dinfer_jax.load(args.model)
  rows = []
  for task in tasks:
    rows += sweep(model, task, counts[task], args.seed, args.gen_lengths, args.block_lengths, args.batch,
                  progress=lambda r: print(f"{r['task']} gen {r['gen_length']} block {r['block_length']}: "
                                           f"accuracy {r['accuracy']:.4f} TPF {r['mean_tpf']:.2f} "
                                           f"NFE {r['mean_nfe']:.2f}", flush=True))
  md = to_markdown(rows, "python -m train_td.canvas " + " ".join(argv if argv is not None else sys.argv[1:]))
  print(md)
  if args.md:
    with open(args.md, "w") as f:
      f.write(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
