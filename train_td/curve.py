"""Accuracy versus tokens per forward over thresholds, per decoder, with and without iteration smoothing.

  python -m train_td.curve --model default --task arithmetic,program --n 200 --seed 0 \
      --md train_td/curve.md --png train_td/curve.png

Every point is one held-out evaluation (train_td.evaluate) with the dual cache; the table and the plot
are written together so the committed picture always has its numbers and its command next to it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

from dinfer_jax import cli_help
import dinfer_jax
from dinfer_jax.cli_common import model_generation_defaults
from dinfer_jax.engine.config import GenerationConfig
from train_td import evaluate
from train_td import prompting
from dinfer_jax import tasks as tasks_lib

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
# The entropy decoder sweeps its bound (nats) instead of a confidence threshold: H < 0.1 is about p > 0.98 for a
# two-way split, H < 1.0 lets through a near-uniform choice among three.
ENTROPY_BOUNDS = (0.05, 0.1, 0.2, 0.4, 0.7, 1.0)
DECODERS = ("threshold", "hierarchy", "credit", "entropy")
SMOOTHING = (0.0, 0.3)


def sweep(model, task: str, n: int, seed: int, thresholds=THRESHOLDS, decoders=DECODERS, smoothing=SMOOTHING,
          progress=None, cache: str = "dual", settings_from: str | None = None, name: str | None = None,
          entropy_bounds=ENTROPY_BOUNDS):
  """Rows of (decoder, smoothing, threshold) -> accuracy / TPF. The other knobs are the generation_config.json
  of `settings_from` (default: the model's own), with its prompt rule for the task (e.g. sort's long
  gen_length): comparing a TD model with its base at the base's settings passes the base's path."""
  probe = tasks_lib.test_problems(task, 1, 0)[0]
  base = model_generation_defaults(settings_from or model.path,
                                   prompting.prompt_text(model.tokenizer, tasks_lib.get_task(task), probe, model.path))
  base.update(cache=cache)
  rows = []
  for dec in decoders:
    for cw in smoothing:
      for thr in (entropy_bounds if dec == "entropy" else thresholds):
        knobs = dict(base, decoder=dec, cont_weight=cw)
        knobs.update(entropy_threshold=thr) if dec == "entropy" else knobs.update(threshold=thr)
        if dec == "hierarchy":
          knobs["low_threshold"] = round(max(0.3, thr - 0.3), 2)
        gcfg = GenerationConfig(**knobs)
        r = evaluate.evaluate(model, task, n, gcfg, seed=seed)
        rows.append({"model": name or model.path, "task": task, "decoder": dec, "smoothing": cw, "threshold": thr, "low_threshold": gcfg.low_threshold
                     if dec == "hierarchy" else None, "accuracy": r["accuracy"], "mean_tpf": r["mean_tpf"],
                     "mean_nfe": r["mean_nfe"], "tps": r["tps"]})
        if progress:
          progress(rows[-1])
  return rows


def to_markdown(rows, command: str, cache: str = "dual") -> str:
  out = [f"Command: `{command}`  ", f"Date: {datetime.date.today().isoformat()}; cache {cache}; held-out problems.",
         "", "| task | model | decoder | smoothing | threshold | accuracy | mean TPF | mean NFE | TPS |",
         "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    thr = (f"H < {r['threshold']}" if r["decoder"] == "entropy" else f"{r['threshold']}") + (
        f" (low {r['low_threshold']})" if r["low_threshold"] is not None else "")
    out.append(f"| {r['task']} | {r.get('model', '')} | {r['decoder']} | {r['smoothing']} | {thr} | {r['accuracy']:.3f} | "
               f"{r['mean_tpf']:.2f} | {r['mean_nfe']:.1f} | {r['tps']:.0f} |")
  return "\n".join(out) + "\n"


def plot(rows, path: str, title: str) -> None:
  """One panel per task: accuracy against mean TPF, a line per decoder x smoothing over the thresholds."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  task_names = list(dict.fromkeys(r["task"] for r in rows))
  models = list(dict.fromkeys(r.get("model") for r in rows))
  fig, axes = plt.subplots(1, len(task_names), figsize=(6.5 * len(task_names), 4.5), squeeze=False)
  for ax, task in zip(axes[0], task_names):
    for model in models:
      for dec in DECODERS:
        for cw in SMOOTHING:
          pts = sorted((r["mean_tpf"], r["accuracy"]) for r in rows if r["task"] == task and r.get("model") == model
                       and r["decoder"] == dec and r["smoothing"] == cw)
          if pts:
            who = f"{model}: " if len(models) > 1 else ""
            ax.plot(*zip(*pts), marker="o" if cw == 0 else "s", linestyle="-" if cw == 0 else "--",
                    label=f"{who}{dec}{' + smoothing ' + str(cw) if cw else ''}")
    ax.set_xlabel("mean tokens per forward")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"{task}: {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  ap.add_argument("--model", default="default", help="model, or several comma-separated (e.g. default,default-td: "
                  "base and TD on one plot per task, all decoded with the first model's generation settings)")
  ap.add_argument("--task", default="arithmetic,program", help="comma-separated task names")
  ap.add_argument("--n", type=int, default=100)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--md", required=True)
  ap.add_argument("--png", required=True)
  ap.add_argument("--json")
  ap.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)))
  ap.add_argument("--decoders", default=",".join(DECODERS))
  ap.add_argument("--cache", default="dual", choices=["none", "prefix", "dual"])
  ap.add_argument("--entropy-bounds", default=",".join(map(str, ENTROPY_BOUNDS)),
                  help="the entropy decoder's bounds (nats), in place of --thresholds")
  ap.add_argument("--smoothing", default=",".join(map(str, SMOOTHING)), help="iteration-smoothing caps (0: off)")
  a = ap.parse_args(argv)
  names = a.model.split(",")
  models = [dinfer_jax.load(m) for m in names]
  rows = [r for task in a.task.split(",") for name, model in zip(names, models)
          for r in sweep(model, task, a.n, a.seed, thresholds=[float(t) for t in a.thresholds.split(",")],
                         decoders=a.decoders.split(","), progress=lambda r: print(json.dumps(r), flush=True),
                         cache=a.cache, settings_from=models[0].path, name=name,
                         smoothing=[float(c) for c in a.smoothing.split(",")],
                         entropy_bounds=[float(b) for b in a.entropy_bounds.split(",")])]
  command = "python -m train_td.curve " + " ".join(argv if argv is not None else sys.argv[1:])
  with open(a.md, "w") as f:
    f.write(to_markdown(rows, command, a.cache))
  plot(rows, a.png, f"accuracy vs TPF (n={a.n}, cache {a.cache})")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
