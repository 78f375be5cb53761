"""Held-out evaluation: batched generation through dinfer_jax.generate, answers verified by the task.

  python -m train_td eval --model PATH --task arithmetic|program --n N --seed S [GenerationConfig flags] [--json]

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

from dinfer_jax.engine.config import GenerationConfig
from train_td import data as data_lib
from train_td import tasks as tasks_lib
from train_td import tokenizer as tok_lib

def decode(ids: Sequence[int], tokenizer=None) -> str:
  if tokenizer is not None:
    return tokenizer.decode(list(ids), skip_special_tokens=True)
  inv = {v: k for k, v in data_lib._vocab().items()}
  return "".join(inv[i] for i in ids if i >= len(tok_lib.SPECIAL_TOKENS) and i in inv
                 and not inv[i].startswith("<|"))


def evaluate(model, task: str, n: int, gcfg: GenerationConfig, *, seed: int = 0, batch: int = 64,
             tokenizer=None, problems=None, warmup: bool = True) -> dict[str, Any]:
  """Accuracy and decoding statistics of `model` ((params, cfg) or a dinfer_jax Model) on held-out problems."""
  import dinfer_jax
  task_obj = tasks_lib.get_task(task)
  problems = list(problems) if problems is not None else tasks_lib.test_problems(task, n, seed)
  if tokenizer is None:
    tokenizer = getattr(model, "tokenizer", None)
  prompts = [data_lib.encode_prompt(p.prompt) for p in problems]
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


def main(args) -> int:
  import dinfer_jax
  model = dinfer_jax.load(args.model if args.model != "default" else None, dtype=args.dtype)
  from dinfer_jax import diagnostics
  from dinfer_jax.cli import knob_sources, generation_config
  gcfg = generation_config(args, model.path)  # dataclass < model's generation_config.json < flags
  problems = tasks_lib.test_problems(args.task, args.n, args.seed)
  # The same checks as `dinfer-jax generate`: bad ids, broken weights and a canvas that cannot fit are
  # one-line errors before anything is compiled (every batch has the first one's shape).
  sources = knob_sources(args, model.path)
  diagnostics.check_ids(model, gcfg, sources)
  diagnostics.check_weights(model)
  first = [data_lib.encode_prompt(p.prompt) for p in problems[:args.batch]]
  diagnostics.check_fits(model, first, gcfg, source=sources.get("gen_length", "gen_length"))
  res = evaluate(model, args.task, args.n, gcfg, seed=args.seed, batch=args.batch, problems=problems)
  for p, a, k in list(zip(problems, res["answers"], res["ok"]))[:args.show]:
    print(f"{'ok ' if k else 'BAD'} {p.prompt} -> {a!r} (ref {p.answer!r})")
  print(f"{args.task}: accuracy {res['accuracy']:.3f} ({res['correct']}/{res['n']})  mean TPF {res['mean_tpf']:.2f}  "
        f"TPF {res['tpf']:.2f}  mean NFE {res['mean_nfe']:.2f}  TPS {res['tps']:.1f}")
  if args.json:
    out = {k: v for k, v in res.items() if k not in ("answers", "ok")}
    out["model"] = model.path
    print(json.dumps(out))
  return 0
