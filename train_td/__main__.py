"""python -m train_td {train,export,eval} ...

  train RUN_DIR [--steps N --batch-size B --lr LR --seed S ...] [--resume]
  export RUN_DIR [--out dinfer_jax/assets/default] [--dtype float32|bfloat16]
  eval --model PATH --task arithmetic|program --n N --seed S [GenerationConfig flags] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence


def _add_train(sub):
  from train_td.trainer import TrainConfig
  p = sub.add_parser("train", help="train (or resume) a run")
  p.add_argument("run_dir")
  p.add_argument("--resume", action="store_true", help="require a checkpoint to resume from "
                 "(without it a run directory that has checkpoints is resumed anyway)")
  p.add_argument("--no-progress", action="store_true")
  for f in dataclasses.fields(TrainConfig):
    if f.name == "mix":
      p.add_argument("--mix", default=None, help="e.g. arithmetic=0.7,program=0.3")
      continue
    if f.name == "arithmetic_op_weights":
      p.add_argument("--arithmetic-op-weights", dest=f.name, default=f.default,
                     type=lambda s: tuple(float(w) for w in s.split(",")),
                     help="training frequency of +,-,* (default %(default)s), e.g. 1,1,2")
      continue
    p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=f.default)
  from dinfer_jax.sharding import add_parallel_flags
  add_parallel_flags(p)
  p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
  import jax

  from dinfer_jax.sharding import setup_parallel
  mesh = setup_parallel(args)  # before any JAX computation (jax.distributed.initialize requires it)
  from train_td import trainer
  kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(trainer.TrainConfig) if f.name != "mix"}
  if args.mix:
    kw["mix"] = tuple((n, float(w)) for n, w in (item.split("=") for item in args.mix.split(",")))
  tc = trainer.TrainConfig(**kw)
  from dinfer_jax.model.params import count_params
  if jax.process_index() == 0:
    print(f"model: {tc.model_config()}", file=sys.stderr)
    print(f"params: {count_params(tc.model_config())}", file=sys.stderr)
  out = trainer.train(tc, args.run_dir, resume=True if args.resume else None,
                      progress=not args.no_progress and jax.process_index() == 0, mesh=mesh)
  if jax.process_index() != 0:
    return 0
  print(json.dumps({"step": out["step"], "seconds": round(out["seconds"], 1), **out["last_metrics"]}))
  return 0


def _add_export(sub):
  p = sub.add_parser("export", help="export a run's latest checkpoint as an HF LLaDA-MoE directory")
  p.add_argument("run_dir")
  p.add_argument("--out", default=None, help="output directory (default: dinfer_jax/assets/default)")
  p.add_argument("--step", type=int, default=None)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--generation-config", default=None,
                 help="JSON object of GenerationConfig defaults to write (default: train_td.export's)")
  p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
  from train_td import export
  gen = json.loads(args.generation_config) if args.generation_config else None
  out = export.export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype, generation_config=gen)
  print(json.dumps(out))
  return 0


def _add_eval(sub):
  from dinfer_jax.cli import add_generation_flags
  p = sub.add_parser("eval", help="accuracy, TPF and NFE on held-out problems")
  p.add_argument("--model", default="default")
  p.add_argument("--task", required=True, choices=["arithmetic", "program"])
  p.add_argument("--n", type=int, default=200)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch", type=int, default=64, help="problems per generate call")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--json", action="store_true", help="last line: one JSON object with the results")
  p.add_argument("--show", type=int, default=0, help="print the first N problems with answers")
  add_generation_flags(p)  # knobs not given come from the model's generation_config.json
  p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
  from train_td import evaluate
  return evaluate.main(args)


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m train_td")
  sub = ap.add_subparsers(dest="command", required=True)
  _add_train(sub)
  _add_export(sub)
  _add_eval(sub)
  return ap


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
