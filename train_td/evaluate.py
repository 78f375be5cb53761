"""Held-out evaluation: batched generation through dinfer_jax.generate, answers verified by the task.

  python -m train_td eval --model PATH[,PATH] --task NAME[,NAME] --n N --seed S [GenerationConfig flags] [--json]

GenerationConfig knobs not given on the command line come from the model directory's
generation_config.json (the defaults the model ships with), then from GenerationConfig's own defaults.
Reported per problem set: accuracy, mean TPF (generated tokens before EOS / forwards the row took part
in, averaged over problems), aggregate TPF (sums), mean NFE per problem and TPS (generated tokens per
second of generation wall time, compile excluded by a warm-up call).
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Sequence

import numpy as np

import dinfer_jax
from dinfer_jax import api, diagnostics, tasks as tasks_lib
from dinfer_jax.cli_common import generation_config, knob_sources
from dinfer_jax.engine.config import GenerationConfig
from train_td import data as data_lib, prompting, tokenizer as tok_lib


def decode(ids: Sequence[int], tokenizer=None) -> str:
  if tokenizer is not None:
    return tokenizer.decode(list(ids), skip_special_tokens=True)
  inv = {v: k for k, v in data_lib._vocab().items()}
  return "".join(inv[i] for i in ids if i >= len(tok_lib.SPECIAL_TOKENS) and i in inv
                 and not inv[i].startswith("<|"))


def evaluate(model, task: str, n: int, gcfg: GenerationConfig, *, seed: int = 0, batch: int = 64,
             tokenizer=None, problems=None, warmup: bool = True) -> dict[str, Any]:
  """Accuracy and decoding statistics of `model` ((params, cfg) or a dinfer_jax Model) on held-out problems."""
  task_obj = tasks_lib.get_task(task)
  problems = list(problems) if problems is not None else tasks_lib.test_problems(task, n, seed)
  if tokenizer is None:
    tokenizer = getattr(model, "tokenizer", None)
  prompts = prompting.prompt_ids(model, task_obj, problems)
  answers, ok, num_tokens, row_nfe, calls_nfe = [], [], [], [], []
  gen_s, warm_s = 0.0, 0.0
  batch = max(1, min(batch, len(prompts)))
  for start in range(0, len(prompts), batch):
    chunk = prompts[start:start + batch]
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch - real)  # one batch shape: one compiled program per bucket
    if warmup and start == 0:
      t = time.perf_counter()
      dinfer_jax.generate(model, chunk, gcfg)
      warm_s = time.perf_counter() - t
    t = time.perf_counter()
    res = dinfer_jax.generate(model, chunk, gcfg)
    gen_s += time.perf_counter() - t
    calls_nfe.append(res.nfe)
    for r in range(real):
      text = decode(res.tokens[r], tokenizer)
      answers.append(text)
      ok.append(bool(task_obj.check(problems[start + r], text)))
      num_tokens.append(res.num_tokens[r])
      row_nfe.append(res.row_nfe[r])
  nt, nf = np.asarray(num_tokens, float), np.asarray(row_nfe, float)
  return {
      "task": task, "n": len(problems), "seed": seed,
      "accuracy": float(np.mean(ok)) if ok else 0.0,
      "correct": int(np.sum(ok)),
      "mean_tpf": float(np.mean(nt / np.maximum(nf, 1))) if len(nt) else 0.0,
      "tpf": float(nt.sum() / max(nf.sum(), 1)),
      "mean_nfe": float(nf.mean()) if len(nf) else 0.0,
      "mean_tokens": float(nt.mean()) if len(nt) else 0.0,
      "tps": float(nt.sum() / gen_s) if gen_s > 0 else 0.0,
      "batch_nfe": float(np.mean(calls_nfe)) if calls_nfe else 0.0,
      "gen_seconds": gen_s, "compile_seconds": warm_s,
      "generation_config": dataclasses.asdict(gcfg),
      "answers": answers, "ok": ok,
  }


def task_generation_config(args, model_path: str | None, task: str, tokenizer=None, *,
                           split: str = "test", seed: int = 0) -> GenerationConfig:
  """Dataclass < the model's generation_config.json (and its prompt rule for the task's prompts, e.g. a
  longer gen_length for sort) < flags. `tokenizer`: the model's (read from model_path when a
  natural-language task needs it and none is given)."""
  task_obj = tasks_lib.get_task(task)
  probe = next(tasks_lib.iter_problems(task_obj, split, seed))
  if tokenizer is None and task_obj.chat:
    tokenizer = api.load_tokenizer(api.resolve_path(model_path))
  return generation_config(args, model_path, prompting.prompt_text(tokenizer, task_obj, probe, model_path))


def main(args) -> int:
  """Evaluates each model on each task. With several models, every model decodes with the settings of
  the first one (its generation_config.json + flags): the comparison of base and TD at equal settings."""
  names = [m for m in args.model.split(",") if m]
  task_names = [t for t in args.task.split(",") if t]
  for t in task_names:
    tasks_lib.get_task(t)  # an unknown task fails before any model is loaded
  models = [dinfer_jax.load(m, dtype=args.dtype, quantize=getattr(args, "quantize", None)) for m in names]
  results = []
  for task in task_names:
    gcfg = task_generation_config(args, models[0].path, task, models[0].tokenizer)
    problems = tasks_lib.test_problems(task, args.n, args.seed)
    for name, model in zip(names, models):
      # The same checks as `dinfer-jax generate`: bad ids, broken weights and a canvas that cannot fit are
      # one-line errors before anything is compiled (every batch has the first one's shape).
      sources = knob_sources(args, models[0].path)
      diagnostics.check_ids(model, gcfg, sources)
      diagnostics.check_weights(model)
      first = prompting.prompt_ids(model, tasks_lib.get_task(task), problems[:args.batch])
      diagnostics.check_fits(model, first, gcfg, source=sources.get("gen_length", "gen_length"))
      res = evaluate(model, task, args.n, gcfg, seed=args.seed, batch=args.batch, problems=problems)
      for p, a, k in list(zip(problems, res["answers"], res["ok"]))[:args.show]:
        print(f"{'ok ' if k else 'BAD'} {p.prompt} -> {a!r} (ref {p.answer!r})")
      print(f"{name} {task}: accuracy {res['accuracy']:.3f} ({res['correct']}/{res['n']})  mean TPF "
            f"{res['mean_tpf']:.2f}  TPF {res['tpf']:.2f}  mean NFE {res['mean_nfe']:.2f}  TPS {res['tps']:.1f}")
      out = {k: v for k, v in res.items() if k not in ("answers", "ok")}
      out["model"] = model.path
      results.append(out)
  if len(models) > 1:
    print("| task | model | accuracy | mean TPF | mean NFE |")
    print("|---|---|---|---|---|")
    for r, name in zip(results, names * len(task_names)):
      print(f"| {r['task']} | {name} | {r['accuracy']:.3f} | {r['mean_tpf']:.2f} | {r['mean_nfe']:.2f} |")
  if args.json:
    print(json.dumps(results[0] if len(results) == 1 else results))
  return 0
