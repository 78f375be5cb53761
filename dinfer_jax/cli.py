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


# generation_config.json may hold per-prompt overrides: "prompt_rules": [{"prefix": TEXT, knob: value, ...}].
# The first rule whose prefix starts the prompt (as the model sees it: chat template applied, special tokens
# written out) overrides the file's defaults, e.g. a longer gen_length for a task whose answers are long, so
# that a long question is never cut off at the short default.
PROMPT_RULES = "prompt_rules"


def _read_generation_file(model_path: str | None) -> dict[str, Any]:
  import json
  import pathlib
  if not model_path:
    return {}
  f = pathlib.Path(model_path) / GENERATION_DEFAULTS_FILE
  return json.loads(f.read_text()) if f.exists() else {}


def _known_knobs(data: dict[str, Any]) -> dict[str, Any]:
  known = {fl.name for fl in dataclasses.fields(GenerationConfig)}
  return {k: v for k, v in data.items() if k in known}


def model_generation_defaults(model_path: str | None, prompt_text: str | None = None) -> dict[str, Any]:
  """GenerationConfig knobs a model directory recommends (generation_config.json, dinfer-jax keys only),
  with the first matching prompt rule applied when `prompt_text` is given."""
  data = _read_generation_file(model_path)
  knobs = _known_knobs(data)
  if prompt_text is not None:
    for rule in data.get(PROMPT_RULES, []):
      if prompt_text.startswith(rule.get("prefix", "")):
        knobs.update(_known_knobs(rule))
        break
  return knobs


def generation_config(args: argparse.Namespace, model_path: str | None = None,
                      prompt_text: str | None = None) -> GenerationConfig:
  """Dataclass defaults < the model's generation_config.json (< its rule for `prompt_text`) < flags given
  on the command line."""
  knobs = model_generation_defaults(model_path, prompt_text)
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
  import dinfer_jax
  model = dinfer_jax.load(args.model, dtype=args.dtype)
  ids = encode_prompts(model, args.prompts, raw=args.raw)
  # Prompts whose generation settings differ (a prompt rule of the model) run as separate batches.
  groups: dict[GenerationConfig, list[int]] = {}
  for r, row in enumerate(ids):
    text = model.tokenizer.decode(row) if model.tokenizer is not None else None
    groups.setdefault(generation_config(args, model.path, text), []).append(r)
  t = time.perf_counter()
  results, nfe, n_tok = {}, 0, 0
  for gcfg, rows in groups.items():
    res = dinfer_jax.generate(model, [ids[r] for r in rows], gcfg, seed=args.seed)
    nfe, n_tok = nfe + res.nfe, n_tok + sum(res.num_tokens)
    results.update({r: (res, i) for i, r in enumerate(rows)})
  dt = time.perf_counter() - t
  for r, prompt in enumerate(args.prompts):
    res, i = results[r]
    if len(args.prompts) > 1:
      print(f"### {prompt}")
    if args.show_steps:
      for line in render_steps(model, res.canvas[i], res.commit_step[i], res.prompt_lengths[i], res.row_nfe[i]):
        print(line)
    # One answer per line: surrounding whitespace (e.g. the default model's column padding, " 627") would
    # only blur where an answer starts; --show-steps prints the raw canvas.
    print(decode_tokens(model, res.tokens[i]).strip())
  if args.verbose:
    print(f"[{n_tok} tokens, nfe {nfe}, {dt:.2f}s incl. compile]", file=sys.stderr)
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
