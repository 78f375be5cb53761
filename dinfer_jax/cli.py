"""`dinfer-jax` command line: generate (and the subcommands other modules register)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, Sequence

from dinfer_jax.engine.config import GenerationConfig

MASK_GLYPH = "_"


GENERATION_DEFAULTS_FILE = "generation_config.json"


def add_generation_flags(ap: argparse.ArgumentParser) -> None:
  """One flag per GenerationConfig knob (--gen-length, --block-length, ...). Unset flags stay absent from
  the namespace so that a model's own defaults (its generation_config.json) can fill them."""
  g = ap.add_argument_group("generation (GenerationConfig; defaults: the model's generation_config.json, "
                            "then the dataclass)")
  for f in dataclasses.fields(GenerationConfig):
    flag = "--" + f.name.replace("_", "-")
    if f.type in ("bool", bool):
      g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
    else:
      typ = int if f.name in ("mask_id", "eos_id") else {"int": int, "float": float, "str": str}.get(
          str(f.type), type(f.default))
      g.add_argument(flag, dest=f.name, type=typ, default=argparse.SUPPRESS,
                     help=f"default {f.default!r}")


def model_generation_defaults(model_path: str | None) -> dict[str, Any]:
  """GenerationConfig knobs a model directory recommends (generation_config.json, dinfer-jax keys only)."""
  import json
  import pathlib
  if not model_path:
    return {}
  f = pathlib.Path(model_path) / GENERATION_DEFAULTS_FILE
  if not f.exists():
    return {}
  data = json.loads(f.read_text())
  known = {fl.name for fl in dataclasses.fields(GenerationConfig)}
  return {k: v for k, v in data.items() if k in known}


def generation_config(args: argparse.Namespace, model_path: str | None = None) -> GenerationConfig:
  """Dataclass defaults < the model's generation_config.json < flags given on the command line."""
  knobs = model_generation_defaults(model_path)
  knobs.update({f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig) if hasattr(args, f.name)})
  return GenerationConfig(**knobs)


def encode_prompts(model, prompts: Sequence[str], *, raw: bool = False) -> list[list[int]]:
  """Text -> token ids, through the tokenizer's chat template when it has one. Without a tokenizer the
  prompts must be token ids ("12,7,99" or "12 7 99")."""
  tok = model.tokenizer
  out = []
  for p in prompts:
    if tok is None:
      try:
        out.append([int(t) for t in p.replace(",", " ").split()])
      except ValueError:
        raise SystemExit(f"error: the model at {model.path} has no tokenizer; give prompts as token ids "
                         f"like '12,7,99' (got {p!r})") from None
      continue
    if not raw and getattr(tok, "chat_template", None):
      text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
      out.append(tok.encode(text, add_special_tokens=False))
    else:
      out.append(tok.encode(p, add_special_tokens=False))
  return out


def decode_tokens(model, ids: Sequence[int]) -> str:
  tok = model.tokenizer
  if tok is None:
    return " ".join(str(i) for i in ids)
  return tok.decode(list(ids), skip_special_tokens=True)


def render_steps(model, canvas: Sequence[int], commit: Sequence[int], prompt_len: int, nfe: int,
                 mask_glyph: str = MASK_GLYPH) -> list[str]:
  """One line per forward: the generated region with the tokens committed so far (masks as '_'),
  the newly committed ones in [brackets]."""
  gen = list(canvas[prompt_len:])
  piece = [_piece(model, t) for t in gen]
  lines = []
  for k in range(1, nfe + 1):
    cells, new = [], 0
    for j, c in enumerate(commit):
      if c == k:
        cells.append(f"[{piece[j]}]")
        new += 1
      elif 0 < c < k:
        cells.append(piece[j])
      else:
        cells.append(mask_glyph if c != -1 else "")
    lines.append(f"{k:4d} +{new:<3d} " + "".join(cells) if model.tokenizer else f"{k:4d} +{new:<3d} " + " ".join(
        x for x in cells if x))
  return lines


def _piece(model, t: int) -> str:
  if model.tokenizer is None:
    return str(t)
  return model.tokenizer.decode([t], skip_special_tokens=False)


def cmd_generate(args: argparse.Namespace) -> int:
  import jax

  import dinfer_jax
  from dinfer_jax.sharding import setup_parallel
  mesh = setup_parallel(args)
  model = dinfer_jax.load(args.model, dtype=args.dtype, mesh=mesh)
  gcfg = generation_config(args, model.path)
  ids = encode_prompts(model, args.prompts, raw=args.raw)
  t = time.perf_counter()
  res = dinfer_jax.generate(model, ids, gcfg, seed=args.seed)
  dt = time.perf_counter() - t
  if jax.process_index() != 0:  # every process holds the gathered result; one prints it
    return 0
  for r, prompt in enumerate(args.prompts):
    if len(args.prompts) > 1:
      print(f"### {prompt}")
    if args.show_steps:
      for line in render_steps(model, res.canvas[r], res.commit_step[r], res.prompt_lengths[r], res.row_nfe[r]):
        print(line)
    # One answer per line: surrounding whitespace (e.g. the default model's column padding, " 627") would
    # only blur where an answer starts; --show-steps prints the raw canvas.
    print(decode_tokens(model, res.tokens[r]).strip())
  if args.verbose:
    print(f"[{sum(res.num_tokens)} tokens, nfe {res.nfe}, {dt:.2f}s incl. compile]", file=sys.stderr)
  return 0


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="dinfer-jax", description="Diffusion-LLM inference in JAX")
  sub = ap.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate answers for prompts")
  g.add_argument("prompts", nargs="+", help="prompt texts (token ids like '1,2,3' for models without a tokenizer)")
  g.add_argument("--model", default="default", help="model directory (HF or converted); default: the embedded model")
  g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
  g.add_argument("--show-steps", action="store_true", help="print the canvas after every forward")
  g.add_argument("-v", "--verbose", action="store_true")
  add_generation_flags(g)
  from dinfer_jax.sharding import add_parallel_flags
  add_parallel_flags(g)
  g.set_defaults(func=cmd_generate)
  try:
    from dinfer_jax.bench import cli as bench_cli  # registered when the benchmark module is present
    bench_cli.register(sub)
  except ImportError:
    pass
  return ap


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except (ValueError, FileNotFoundError) as e:  # bad knobs, prompts or paths: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
