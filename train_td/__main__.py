"""python -m train_td {train,export,eval,collect,distill} ...

  train RUN_DIR [--steps N --batch-size B --lr LR --seed S ...] [--resume]
  train RUN_DIR --td DATA[,DATA] [--base default] [--mdm-weight W] [--cf-weight W] [--steps N ...]
  export RUN_DIR --out DIR [--overwrite] [--dtype float32|bfloat16]
  eval --model PATH[,PATH] --task NAME[,NAME] --n N --seed S [GenerationConfig flags] [--json]
  collect --model PATH --task NAME --n N --out DIR [--batch B] [--seed S] [GenerationConfig flags]

A task NAME is a built-in task (arithmetic, program, sort, add, split) or a FILE.jsonl of your own math or
code problems (dinfer_jax/tasks/jsonl.py); `--base` may be any model dinfer_jax loads (train_td/README.md).
  distill --base default --out dinfer_jax/assets/default-td --work DIR [--tasks ...] [--n ...] [--steps ...]

Resuming (`train RUN_DIR` again, or with --resume) takes every setting from RUN_DIR/train_config.json;
flags given must agree with it, except --steps, which extends (or shortens) the run. Bad input prints
`error: <one line>` and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Sequence

import jax

from dinfer_jax import cli_help
from dinfer_jax.cli_common import (DTYPES, QUANTIZE_CHOICES, QUANTIZE_HELP, Command, add_generation_flags,
                                   add_model_flags, help_defaults, quantize_spec, run_stoppable)
from dinfer_jax.model.params import count_params
from dinfer_jax.sharding import add_parallel_flags, setup_parallel
from dinfer_jax.tasks.sandbox import SandboxError
from train_td import collect, distill, evaluate, export, td_train, trainer
from train_td.objective import COMPUTE_DTYPES
from train_td.trainer import TrainConfig


def _positive_int(text: str) -> int:
  v = int(text)
  if v < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
  return v


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(w) for w in text.split(","))


def _parse_mix(text: str, flag: str = "--mix", example: str = "arithmetic=0.7,program=0.3",
               key=str.strip) -> tuple[tuple, ...]:
  """'arithmetic=0.7,program=0.3' -> (("arithmetic", 0.7), ("program", 0.3))."""
  out = []
  for item in text.split(","):
    name, eq, w = item.partition("=")
    try:
      out.append((key(name), float(w)))
    except ValueError:
      raise ValueError(f"{flag}: expected NAME=WEIGHT items like {example}, got {item!r}") from None
    if not eq:
      raise ValueError(f"{flag}: expected NAME=WEIGHT, got {item!r}")
  return tuple(out)


def parse_task_weights(text: str) -> tuple[tuple[str, float], ...]:
  """'split=0.4,arithmetic=0.3' -> (("split", 0.4), ("arithmetic", 0.3)); '' -> () (by trajectories)."""
  return _parse_mix(text, "--task-weights", "split=0.4,arithmetic=0.3") if text else ()


def _parse_canvases(text: str) -> tuple[tuple[int, float], ...]:
  """'8=0.5,64=0.5' -> ((8, 0.5), (64, 0.5))."""
  return _parse_mix(text, "--canvases", "8=0.4,16=0.2,32=0.2,64=0.2", key=lambda n: int(n.strip()))


def _add_train(sub):
  p = sub.add_parser("train", help="train (or resume) a run")
  p.add_argument("run_dir")
  p.add_argument("--resume", action="store_true", help="require a checkpoint to resume from "
                 "(without it a run directory that has checkpoints is resumed anyway)")
  p.add_argument("--no-progress", action="store_true")
  # Flags not given stay absent: a resumed run takes them from its train_config.json.
  for f in dataclasses.fields(TrainConfig):
    flag = "--" + f.name.replace("_", "-")
    if f.name == "mix":
      p.add_argument(flag, type=str, default=argparse.SUPPRESS,
                     help=f"task mix, e.g. arithmetic=0.7,program=0.3 (default {_mix_text(f.default)})")
    elif f.name == "canvases":
      p.add_argument(flag, type=str, default=argparse.SUPPRESS,
                     help="answer-region lengths with weights, e.g. 8=0.4,16=0.2,32=0.2,64=0.2 (default: each "
                          "task's own region)")
    elif f.name == "arithmetic_op_weights":
      p.add_argument(flag, dest=f.name, type=_floats, default=argparse.SUPPRESS,
                     help=f"training frequency of +,-,* (default {','.join(map(str, f.default))}), e.g. 1,1,2")
    elif isinstance(f.default, bool):
      p.add_argument(flag, dest=f.name, action="store_true", default=argparse.SUPPRESS,
                     help=f"default {f.default!r}")
    elif f.name == "compute_dtype":
      p.add_argument(flag, dest=f.name, choices=COMPUTE_DTYPES, default=argparse.SUPPRESS,
                     help=f"forward/backward dtype on fp32 master weights (default {f.default})")
    else:
      p.add_argument(flag, dest=f.name, type=type(f.default), default=argparse.SUPPRESS,
                     help=f"default {f.default!r}")
  td = p.add_argument_group("trajectory distillation (train_td.td_train; the architecture is the base model's)")
  td.add_argument("--td", default=None, metavar="DATA", help="collect directories (comma-separated): train the "
                  "TD variant of --base on their golden trajectories")
  td.add_argument("--base", default="default", help="model to distill (directory or 'default')")
  td.add_argument("--mdm-weight", type=float, default=0.0, help="weight of the masked-diffusion loss mixed in")
  td.add_argument("--cf-weight", type=float, default=0.0, help="weight of the certainty-forcing entropy term")
  td.add_argument("--task-weights", default="", metavar="TASK=W,...", help="how often each task's trajectories "
                  "make a batch (default: in proportion to their number)")
  td.add_argument("--allow-data-change", action="store_true",
                  help="resume a TD run on shards whose contents differ from those it began with")
  add_parallel_flags(p)
  p.set_defaults(func=cmd_train)


def _mix_text(mix) -> str:
  return ",".join(f"{n}={w}" for n, w in mix)


def train_config_fields(args) -> dict:
  """The TrainConfig fields a `train` command line gives, parsed (mix and canvases as tuples)."""
  given = {f.name: getattr(args, f.name) for f in dataclasses.fields(trainer.TrainConfig) if hasattr(args, f.name)}
  if "mix" in given:
    given["mix"] = _parse_mix(given["mix"])
  if "canvases" in given:
    given["canvases"] = _parse_canvases(given["canvases"])
  return given


def cmd_train(args) -> int:


  mesh = setup_parallel(args)  # before any JAX computation (jax.distributed.initialize requires it)
  given = train_config_fields(args)
  if args.td:
    return cmd_train_td(args, given, mesh)
  saved = pathlib.Path(args.run_dir) / trainer.TRAIN_CONFIG
  # Resuming: unset flags come from the run's own config (trainer.train checks what was given against it).
  base = trainer.load_train_config(args.run_dir) if saved.exists() else trainer.TrainConfig()
  tc = dataclasses.replace(base, **given)
  if jax.process_index() == 0:
    print(f"model: {tc.model_config()}", file=sys.stderr)
    print(f"params: {count_params(tc.model_config())}", file=sys.stderr)
  out = trainer.train(tc, args.run_dir, resume=True if args.resume else None,
                      progress=not args.no_progress and jax.process_index() == 0, mesh=mesh)
  if jax.process_index() != 0:
    return 0
  print(json.dumps({"step": out["step"], "seconds": round(out["seconds"], 1), **out["last_metrics"]}))
  return 0


def cmd_train_td(args, kw, mesh=None) -> int:

  tdc = td_train.TDConfig(data=args.td, base=args.base, mdm_weight=args.mdm_weight, cf_weight=args.cf_weight,
                          task_weights=parse_task_weights(args.task_weights))
  for f in td_train.ARCH_FIELDS:
    kw.pop(f, None)  # the base model's
  out = td_train.train(tdc, args.run_dir, resume=True if args.resume else None,
                       progress=not args.no_progress and jax.process_index() == 0, mesh=mesh,
                       allow_data_change=args.allow_data_change, **kw)
  if jax.process_index() != 0:
    return 0
  print(json.dumps({"step": out["step"], "seconds": round(out["seconds"], 1), **out["last_metrics"]}))
  return 0


def _add_collect(sub, model_defaults=None):
  p = sub.add_parser("collect", help="golden trajectories of a model on training prompts (Parquet shards)")
  add_model_flags(p)
  p.add_argument("--task", required=True)
  p.add_argument("--n", type=_positive_int, required=True, help="training prompts to run (distinct)")
  p.add_argument("--out", required=True, help="output directory (resumed if it has shards)")
  p.add_argument("--batch", type=_positive_int, default=128, help="prompts per engine call (= per shard)")
  p.add_argument("--seed", type=int, default=0, help="which training prompts")
  p.add_argument("--no-progress", action="store_true")
  add_generation_flags(p, model_defaults)  # knobs not given: the model's generation_config.json (and its task rule)
  add_parallel_flags(p)
  p.set_defaults(func=cmd_collect)


def cmd_collect(args) -> int:
  if args.mesh:
    raise ValueError("collect: --mesh is not used: each process runs its share of the batches on its own devices")
  setup_parallel(args)  # under jax.distributed each process collects its share and writes its own shards
  return collect.main(args)


RECIPE_TASK_WEIGHTS = "split=0.4,arithmetic=0.3,program=0.15,add=0.15"  # the shipped default-td's


def _add_distill(sub):
  p = sub.add_parser("distill", help="collect + train --td + export: the TD variant of a base model in one command")
  p.add_argument("--base", default="default")
  p.add_argument("--out", required=True, help="export directory (e.g. dinfer_jax/assets/default-td)")
  p.add_argument("--work", required=True, help="working directory: trajectories in WORK/data/<task>, run in WORK/run")
  # The defaults are the recipe of the shipped default-td (train_td/README.md).
  p.add_argument("--tasks", default="split,arithmetic,program,add")
  p.add_argument("--n", default="split=799,arithmetic=4000,program=800,add=2000",
                 help="training prompts per task (TASK=N,...)")
  p.add_argument("--batch", type=_positive_int, default=256, help="collect: prompts per engine call")
  p.add_argument("--steps", type=_positive_int, default=600)
  p.add_argument("--batch-size", type=_positive_int, default=64)
  p.add_argument("--lr", type=float, default=5e-4)
  p.add_argument("--warmup-steps", type=int, default=40)
  p.add_argument("--mdm-weight", type=float, default=0.5)
  p.add_argument("--cf-weight", type=float, default=0.25)
  p.add_argument("--task-weights", default=None, metavar="TASK=W,...",
                 help="how often each task makes a TD batch ('': in proportion to its trajectories; default: the "
                      f"recipe's {RECIPE_TASK_WEIGHTS} for the --tasks it names, in proportion to trajectories if "
                      "a task has no recipe weight)")
  p.add_argument("--ckpt-every", type=_positive_int, default=50,
                 help="save a checkpoint every N training steps (a rerun resumes from the last one)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--threshold", type=float, default=None,
                 help="the exported model's decoding threshold in its generation_config.json (default: the "
                 "base's; collection always decodes at the base's)")
  p.add_argument("--overwrite", action="store_true",
                 help="replace an existing model directory at --out (anything else there is refused)")
  p.add_argument("--no-progress", action="store_true")
  p.set_defaults(func=cmd_distill)


def cmd_distill(args) -> int:
  if args.task_weights is None:  # the recipe's weights, for whichever of its tasks were asked for
    recipe = dict(parse_task_weights(RECIPE_TASK_WEIGHTS))
    tasks = [t for t in args.tasks.split(",") if t]
    args.task_weights = tuple((t, recipe[t]) for t in tasks) if all(t in recipe for t in tasks) else ()
  else:
    args.task_weights = parse_task_weights(args.task_weights)
  return distill.main(args)


def _add_export(sub):
  p = sub.add_parser("export", help="export a run's latest checkpoint as an HF LLaDA-MoE directory")
  p.add_argument("run_dir")
  p.add_argument("--out", required=True,
                 help="output directory (e.g. dinfer_jax/assets/default to replace the shipped model)")
  p.add_argument("--overwrite", action="store_true",
                 help="replace --out if it already holds a model (or an earlier export)")
  p.add_argument("--step", type=int, default=None)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--generation-config", default=None,
                 help="JSON object of GenerationConfig defaults to write (default: train_td.export's)")
  p.add_argument("--allow-nonfinite", action="store_true", help="export weights holding NaN/inf (refused otherwise)")
  p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
  try:
    gen = json.loads(args.generation_config) if args.generation_config else None
  except ValueError as e:
    raise ValueError(f"--generation-config: not JSON: {e}") from None
  if gen is not None and not isinstance(gen, dict):
    raise ValueError("--generation-config: expected a JSON object")
  out = export.export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype, generation_config=gen,
                          overwrite=args.overwrite, allow_nonfinite=args.allow_nonfinite)
  print(json.dumps(out))
  return 0


def _add_eval(sub, model_defaults=None):
  p = sub.add_parser("eval", help="accuracy, TPF and NFE on held-out problems")
  p.add_argument("--model", default="default", help="model directory or name; several comma-separated are "
                 "compared with the same generation settings (the first model's generation_config.json)")
  p.add_argument("--task", required=True, help="task name, or several comma-separated")
  p.add_argument("--n", type=_positive_int, default=200)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch", type=_positive_int, default=64, help="problems per generate call")
  p.add_argument("--dtype", default="float32", choices=DTYPES)
  p.add_argument("--quantize", default=None, type=quantize_spec, metavar="|".join(QUANTIZE_CHOICES[:2]) + "|...",
                 help="quantise the weights on load (dinfer_jax.load(quantize=...); model/quant.py). " + QUANTIZE_HELP)
  p.add_argument("--json", action="store_true", help="last line: one JSON object with the results")
  p.add_argument("--show", type=int, default=0, help="print the first N problems with answers")
  add_generation_flags(p, model_defaults)  # knobs not given come from the model's generation_config.json
  p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
  return evaluate.main(args)


_GENERATING = ("eval", "collect")  # their generation flags default to the model's generation_config.json
SUBCOMMANDS = {"train": _add_train, "export": _add_export, "eval": _add_eval, "collect": _add_collect,
               "distill": _add_distill}


def build_parser(prog: str = "python -m train_td", model_defaults: dict | None = None) -> argparse.ArgumentParser:
  """model_defaults: the --model's generation_config.json knobs, shown as eval's and collect's defaults."""
  ap = argparse.ArgumentParser(prog=prog)
  sub = ap.add_subparsers(dest="command", required=True)
  for name, add in SUBCOMMANDS.items():
    add(sub, model_defaults) if name in _GENERATING else add(sub)
  return cli_help.show_defaults(ap)


def main(argv: Sequence[str] | None = None, prog: str = "python -m train_td") -> int:
  """Runs the train_td CLI on `argv` (default sys.argv[1:]); returns the exit status. `prog` names the
  command in usage and error lines (e.g. "dinfer-jax train" when another CLI delegates here)."""
  args = build_parser(prog, help_defaults(list(argv if argv is not None else sys.argv[1:]))).parse_args(argv)
  return run_stoppable(f"{prog} {args.command}", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
  try:
    return args.func(args)
  except (ValueError, OSError, SandboxError) as e:  # bad flags, paths, configs, checkpoints: no traceback
    msg = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror or e}"
    print(f"error: {msg}", file=sys.stderr)
    return 2


def delegated_main(argv: Sequence[str], prog: str) -> int:
  """`dinfer-jax train ...`: a first argument that is none of the subcommands is a run directory
  (`dinfer-jax train RUN_DIR ...` means `train RUN_DIR ...`)."""
  argv = list(argv)
  if not argv or argv[0] not in (*SUBCOMMANDS, "-h", "--help"):
    argv = ["train", *argv]
  return main(argv, prog=prog)


# The `dinfer-jax train` command (pyproject.toml registers it under the "dinfer_jax.commands" entry points).
COMMAND = Command("train_td: train RUN_DIR | export RUN_DIR | eval --task T (train_td's own CLI; "
                  "'dinfer-jax train RUN_DIR ...' means 'train RUN_DIR ...')", delegated_main, tuple(SUBCOMMANDS))


if __name__ == "__main__":
  sys.exit(main())
