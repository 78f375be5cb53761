"""Checkpoint conversion CLI (the logic lives in dinfer_jax.checkpoint; `python -m convert` runs this).

  python -m convert hf2jax SRC DST [--dtype bfloat16|float32] [--overwrite [--overwrite-unmarked DST]]
  python -m convert jax2hf SRC DST [--dtype ...] [--layout per_expert|fused] [--overwrite] [--max-shard-gb N]
  python -m convert inspect PATH [--limit N]

Bad inputs print `error: <one line>` to stderr and exit with status 2; nothing is left at DST. DST is never
SRC, a directory containing SRC or one inside it; --overwrite replaces only a directory this tool wrote,
anything else must be named a second time with --overwrite-unmarked. Ctrl-C or SIGTERM removes the partial
output, prints one line and exits with 128 + the signal number.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from absl import logging as absl_logging

from dinfer_jax import cli_help
from dinfer_jax.checkpoint import CheckpointError, describe, hf2jax, inspect, jax2hf
from dinfer_jax.checkpoint.outdir import Interrupted, remove_when_quiet
from dinfer_jax.config import ConfigError


def _gb(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _add_overwrite_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--overwrite", action="store_true",
                 help="replace DST if it is an earlier output of this tool")
  p.add_argument("--overwrite-unmarked", metavar="DST", default=None,
                 help="also replace DST when this tool did not write it (give the same path as DST)")


def _replace_unmarked(args) -> bool:
  if args.overwrite_unmarked is None:
    return False
  if os.path.realpath(args.overwrite_unmarked) != os.path.realpath(args.dst):
    raise CheckpointError(f"--overwrite-unmarked {args.overwrite_unmarked} is not DST ({args.dst}); "
                          "it must name the directory to replace")
  if not args.overwrite:
    raise CheckpointError("--overwrite-unmarked needs --overwrite as well")
  return True


def build_parser(prog: str = "python -m convert") -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  h = sub.add_parser("hf2jax", help="HF safetensors dir -> converted (orbax) dir")
  h.add_argument("src")
  h.add_argument("dst")
  h.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                 help="dtype of the stored weights, whatever the source's (default %(default)s, the serving dtype; "
                      "float32 keeps a float32 checkpoint exact)")
  h.add_argument("--quantize", default=None, choices=("int8", "fp8"),
                 help="store the attention/FFN/expert weights in 8 bits with their scales (model/quant.py)")
  h.add_argument("--scales", default="channel", choices=("channel", "block"),
                 help="with --quantize: one scale per output channel, or per 128x128 block of [out, in]")
  h.add_argument("--allow-nonfinite", action="store_true",
                 help="convert weights holding NaN/Inf values (with a warning) instead of refusing them")
  _add_overwrite_flags(h)
  j = sub.add_parser("jax2hf", help="converted dir -> HF safetensors dir")
  j.add_argument("src")
  j.add_argument("dst")
  j.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                 help="default: the dtype of the HF checkpoint it was converted from")
  j.add_argument("--layout", default=None, choices=("per_expert", "fused"),
                 help="expert tensor layout; default: the layout it was converted from")
  _add_overwrite_flags(j)
  j.add_argument("--max-shard-gb", type=float, default=5.0)
  i = sub.add_parser("inspect", help="list the tensors of either format")
  i.add_argument("path")
  i.add_argument("--limit", type=int, default=0, help="print at most this many tensors (0: all)")
  return cli_help.show_defaults(ap)


def main(argv=None, prog: str = "python -m convert") -> int:
  """Runs the converter CLI on `argv` (default sys.argv[1:]); returns the exit status."""
  ap = build_parser(prog)
  args = ap.parse_args(argv)

  # Imports after argument parsing so `--help` is instant; absl logging quieted because orbax warns
  # about things that do not concern a one-shot conversion.
  # FATAL, not ERROR: a failed write (disk full) is logged by orbax's writer thread with its whole
  # traceback before the error reaches us; we report it once, in one line.
  absl_logging.set_verbosity(absl_logging.FATAL)

  try:
    if args.cmd == "hf2jax":
      if args.quantize is None and args.scales != "channel":
        raise CheckpointError("--scales needs --quantize int8|fp8")
      quantize = None if args.quantize is None else f"{args.quantize}-{args.scales}"
      s = hf2jax(args.src, args.dst, args.dtype, overwrite=args.overwrite, replace_unmarked=_replace_unmarked(args),
                 allow_nonfinite=args.allow_nonfinite, quantize=quantize)
      q = f", {s['quantization']}" if s["quantization"] else ""
      print(f"hf2jax: {s['family']} ({s['layout']}, {s['source_dtype']}) -> {args.dst} ({s['dtype']}{q}): "
            f"{s['tensors']} tensors, {s['n_params']:,} params, {_gb(s['bytes'])} "
            f"({_gb(s['disk_bytes'])} on disk), {s['seconds']:.1f} s")
    elif args.cmd == "jax2hf":
      s = jax2hf(args.src, args.dst, dtype=args.dtype, layout=args.layout, overwrite=args.overwrite,
                 max_shard_bytes=int(args.max_shard_gb * 2**30), replace_unmarked=_replace_unmarked(args))
      print(f"jax2hf: {s['family']} -> {args.dst} ({s['layout']}, {s['dtype']}): {s['tensors']} tensors in "
            f"{s['files']} file(s), {s['n_params']:,} params, {_gb(s['bytes'])}, {s['seconds']:.1f} s")
    else:
      rows = inspect(args.path)
      fmt = describe(args.path)
      if fmt:
        print(fmt)
      shown = rows[:args.limit] if args.limit else rows
      w = max((len(n) for n, _, _ in shown), default=0)
      for name, shape, dt in shown:
        print(f"{name:<{w}}  {dt:<9} {list(shape)}")
      if len(shown) < len(rows):
        print(f"... {len(rows) - len(shown)} more")
      n = sum(_prod(s) for _, s, _ in rows)
      b = sum(_prod(s) * _itemsize(d) for _, s, d in rows)
      print(f"{len(rows)} tensors, {n:,} params, {_gb(b)}")
  except (CheckpointError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except (Interrupted, KeyboardInterrupt) as e:
    # KeyboardInterrupt: Ctrl-C before or after the output was being written (nothing to clean up).
    if isinstance(e, Interrupted) and e.staging is not None:
      remove_when_quiet(e.staging)  # orbax's writer threads may still be finishing a write into it
    print(f"{args.cmd}: {e}" if isinstance(e, Interrupted) else f"{args.cmd}: interrupted", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    # orbax's writer threads may still be blocked in the write that was cut short; exiting through the
    # interpreter would join them and print their tracebacks. The staging directory is already gone.
    os._exit(128 + (e.signum if isinstance(e, Interrupted) else 2))
  return 0


def _prod(shape) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n


def _itemsize(name: str) -> int:
  return np.dtype(name).itemsize


if __name__ == "__main__":
  sys.exit(main())
