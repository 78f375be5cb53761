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


def add_generation_flags(ap: argparse.ArgumentParser, model_defaults: dict[str, Any] | None = None) -> None:
  """One flag per GenerationConfig knob (--gen-length, --block-length, ...). Unset flags stay absent from
  the namespace so that a model's own defaults (its generation_config.json) can fill them; `model_defaults`
  (that file's knobs) are shown in the help."""
  from dinfer_jax.engine.config import CACHES, DECODERS
  model_defaults = model_defaults or {}
  g = ap.add_argument_group("generation (GenerationConfig; defaults: the model's generation_config.json, "
                            "then the dataclass)")
  choices = {"decoder": DECODERS, "cache": CACHES}
  for f in dataclasses.fields(GenerationConfig):
    flag = "--" + f.name.replace("_", "-")
    shown = (f"default {model_defaults[f.name]!r} (the model's generation_config.json; dataclass "
             f"{f.default!r})" if f.name in model_defaults else f"default {f.default!r}")
    if f.type in ("bool", bool):
      g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                     help=shown)
    else:
      typ = int if f.name in ("mask_id", "eos_id") else {"int": int, "float": float, "str": str}.get(
          str(f.type), type(f.default))
      # Choices are listed, not enforced by argparse: GenerationConfig's one-line error names a bad value.
      listed = choices.get(f.name)
      g.add_argument(flag, dest=f.name, type=typ, default=argparse.SUPPRESS,
                     metavar="{" + ",".join(listed) + "}" if listed else None,
                     help=(f"one of {', '.join(listed)}; " if listed else "") + shown)


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
  if not f.exists():
    return {}
  try:
    data = json.loads(f.read_text())
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise ValueError(f"{f}: cannot parse: {e}") from None
  if not isinstance(data, dict):
    raise ValueError(f"{f}: expected a JSON object")
  return data


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
  on the command line.

  A value from generation_config.json that is invalid (and not overridden by a flag) is reported as
  coming from that file.
  """
  import pathlib
  from_file = model_generation_defaults(model_path, prompt_text)
  flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig) if hasattr(args, f.name)}
  try:
    return GenerationConfig(**{**from_file, **flags})
  except (TypeError, ValueError) as e:
    kept = {k: v for k, v in from_file.items() if k not in flags}
    try:
      GenerationConfig(**kept)
    except (TypeError, ValueError) as file_error:
      f = pathlib.Path(model_path) / GENERATION_DEFAULTS_FILE
      raise ValueError(f"{f}: {file_error} (a default from the model's {GENERATION_DEFAULTS_FILE}; "
                       "fix the file or override it with the matching flag)") from None
    raise ValueError(str(e)) from None


def rule_generation_configs(args: argparse.Namespace, model_path: str | None) -> list[GenerationConfig]:
  """The distinct GenerationConfigs the model's prompt rules give (flags still win), in rule order: what
  a server must compile besides its default config so the first long question does not wait for it."""
  out: list[GenerationConfig] = []
  for rule in _read_generation_file(model_path).get(PROMPT_RULES, []):
    g = generation_config(args, model_path, rule.get("prefix", ""))
    if g not in out:
      out.append(g)
  return out


def knob_sources(args: argparse.Namespace, model_path: str | None) -> dict[str, str]:
  """knob -> where its value came from, for messages."""
  import pathlib
  out = {}
  for k in model_generation_defaults(model_path):
    out[k] = str(pathlib.Path(model_path) / GENERATION_DEFAULTS_FILE)
  for f in dataclasses.fields(GenerationConfig):
    if hasattr(args, f.name):
      out[f.name] = "--" + f.name.replace("_", "-")
  return out


def encode_prompts(model, prompts: Sequence[Any], *, raw: bool = False, system: str | None = None,
                   warn: bool = True) -> list[list[int]]:
  """Text -> token ids, through the tokenizer's chat template when it has one. A prompt may also be a list
  of chat messages ({"role", "content"}); `system` adds a system message before a text prompt's user turn.
  Without a tokenizer the prompts must be token ids ("12,7,99" or "12 7 99")."""
  tok = model.tokenizer
  out = []
  for i, p in enumerate(prompts):
    if tok is None:
      if not isinstance(p, str):
        raise SystemExit(f"error: the model at {model.path} has no tokenizer (nor chat template); prompt {i} "
                         "is a chat")
      try:
        out.append([int(t) for t in p.replace(",", " ").split()])
      except ValueError:
        raise SystemExit(f"error: the model at {model.path} has no tokenizer; give prompts as token ids "
                         f"like '12,7,99' (got {p!r})") from None
      continue
    if isinstance(p, str) and (raw or not getattr(tok, "chat_template", None)):
      out.append(tok.encode(p, add_special_tokens=False))
    else:
      if not getattr(tok, "chat_template", None):
        raise ValueError(f"prompt {i} is a chat, but the model at {model.path} has no chat template")
      msgs = p if not isinstance(p, str) else ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": p}]
      text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
      out.append(tok.encode(text, add_special_tokens=False))
    if warn:
      warn_unknown_characters(model, i, p, out[-1])
  return out


def warn_unknown_characters(model, index: int, prompt, ids: Sequence[int]) -> list[str]:
  """Warns (stderr) about the characters of a prompt that the tokenizer maps to its unknown token: the
  model never sees them. Returns them."""
  tok = model.tokenizer
  unk = getattr(tok, "unk_token_id", None)
  if unk is None or unk not in ids:
    return []
  text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
  bad = sorted({c for c in text if not c.isspace() and tok.encode(c, add_special_tokens=False) == [unk]})
  shown = ", ".join(repr(c) for c in bad) if bad else "some characters"
  print(f"warning: prompt {index}: {shown} not in the tokenizer's vocabulary (the model sees "
        f"{tok.unk_token!r} instead)", file=sys.stderr)
  return bad


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


def _print_answer(args: argparse.Namespace, model, prompts: Sequence[Any], r: int, res, i: int) -> int:
  """Prints prompt r's answer (row i of `res`) as --json/--show-steps ask; returns its token count."""
  import json

  from dinfer_jax.answer import cut_at_stop
  toks = res.tokens[i][:args.max_new_tokens] if args.max_new_tokens else res.tokens[i]
  # Surrounding whitespace (e.g. the default model's column padding, " 627") would only blur where an
  # answer starts; --show-steps and --json keep the raw text.
  text, stopped = cut_at_stop(decode_tokens(model, toks), args.stop)
  if args.json:
    print(json.dumps({"prompt": prompts[r], "answer": text, "tokens": len(toks), "nfe": res.row_nfe[i],
                      "tpf": len(toks) / res.row_nfe[i] if res.row_nfe[i] else 0.0, "stopped": stopped}),
          flush=True)
    return len(toks)
  if len(prompts) > 1:
    print(f"### {prompts[r] if isinstance(prompts[r], str) else prompts[r][-1]['content']}")
  if args.show_steps:
    for line in render_steps(model, res.canvas[i], res.commit_step[i], res.prompt_lengths[i], res.row_nfe[i]):
      print(line)
  print(text.strip())
  return len(toks)


def cmd_generate(args: argparse.Namespace) -> int:
  import jax

  import dinfer_jax
  from dinfer_jax import prompt_input
  from dinfer_jax.answer import with_token_cap
  from dinfer_jax.sharding import setup_parallel
  if args.batch_size <= 0:
    raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
  prompts = prompt_input.collect(args.prompts, args.file)
  mesh = setup_parallel(args)  # before any JAX computation (jax.distributed.initialize requires it)
  model = dinfer_jax.load(args.model, dtype=args.dtype, mesh=mesh)
  from dinfer_jax import diagnostics
  ids = encode_prompts(model, prompts, raw=args.raw, system=args.system)
  # Prompts whose generation settings differ (a prompt rule of the model) run as separate batches.
  groups: dict[GenerationConfig, list[int]] = {}
  for r, row in enumerate(ids):
    text = model.tokenizer.decode(row) if model.tokenizer is not None else None
    gcfg = with_token_cap(generation_config(args, model.path, text), args.max_new_tokens)
    groups.setdefault(gcfg, []).append(r)
  sources = knob_sources(args, model.path)
  diagnostics.check_weights(model)
  for gcfg, rows in groups.items():  # before compiling anything
    diagnostics.check_ids(model, gcfg, sources)
    diagnostics.check_fits(model, [ids[r] for r in rows], gcfg, source=sources.get("gen_length", "gen_length"))
  chunks = [(gcfg, rows[i:i + args.batch_size]) for gcfg, rows in groups.items()
            for i in range(0, len(rows), args.batch_size)]
  # Every process holds the gathered result; one prints it.
  printer = jax.process_index() == 0
  progress = None
  if len(chunks) > 1 and not args.no_progress and printer:
    from tqdm import tqdm
    progress = tqdm(total=len(ids), unit="prompt", file=sys.stderr, desc="generate")
  t = time.perf_counter()
  tokens_total, nfe_total = 0, 0
  done: dict[int, tuple] = {}
  next_row = 0
  for gcfg, chunk in chunks:
    res = dinfer_jax.generate(model, [ids[r] for r in chunk], gcfg, seed=args.seed,
                              batch_bucket=args.batch_size if len(ids) > args.batch_size else None)
    diagnostics.check_finite(model, [ids[r] for r in chunk], gcfg, res)
    nfe_total += res.nfe
    for i, r in enumerate(chunk):
      done[r] = (res, i)
    # Answers come out in the prompts' order, each as soon as every earlier prompt's is there.
    while next_row in done:
      res_r, i = done.pop(next_row)
      if printer:
        tokens_total += _print_answer(args, model, prompts, next_row, res_r, i)
      next_row += 1
    if progress:
      progress.update(len(chunk))
  if progress:
    progress.close()
  dt = time.perf_counter() - t
  if args.verbose:
    print(f"[{tokens_total} tokens, nfe {nfe_total}, {dt:.2f}s incl. compile]", file=sys.stderr)
  return 0


def _model_arg(argv: Sequence[str]) -> str:
  """The --model value of a generate/serve/bench command line, read before parsing (for the help)."""
  for i, a in enumerate(argv):
    if a == "--model" and i + 1 < len(argv):
      return argv[i + 1]
    if a.startswith("--model="):
      return a.split("=", 1)[1]
  return "default"


def _help_defaults(argv: Sequence[str]) -> dict[str, Any]:
  """The model's generation_config.json knobs, for the help text ({} if the model cannot be found)."""
  if not any(a in ("-h", "--help") for a in argv):
    return {}
  try:
    from dinfer_jax.api import resolve_path
    return model_generation_defaults(str(resolve_path(_model_arg(argv))))
  except (OSError, ValueError):
    return {}


def build_parser(model_defaults: dict[str, Any] | None = None) -> argparse.ArgumentParser:
  import dinfer_jax
  ap = argparse.ArgumentParser(prog="dinfer-jax", description="Diffusion-LLM inference in JAX")
  ap.add_argument("--version", action="version", version=f"dinfer-jax {dinfer_jax.__version__}")
  sub = ap.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate answers for prompts")
  g.add_argument("prompts", nargs="*", help="prompt texts ('-' reads prompts from stdin; token ids like '1,2,3' "
                 "for models without a tokenizer)")
  g.add_argument("--file", "-f", default=None, help="more prompts: one per line, or JSONL ({\"prompt\": ...} or "
                 "{\"messages\": [...]}); '-' is stdin")
  g.add_argument("--model", default="default", help="model directory (HF or converted); default: the embedded model")
  g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
  g.add_argument("--system", default=None, help="a system prompt before each text prompt (chat template)")
  g.add_argument("--max-new-tokens", type=int, default=None,
                 help="cut each answer to this many tokens (the canvas grows to whole blocks if it is longer "
                      "than gen_length)")
  g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                 help="cut the answer before this text (repeatable)")
  g.add_argument("--batch-size", type=int, default=16, help="prompts per engine call (default %(default)s)")
  g.add_argument("--json", action="store_true",
                 help="one JSON object per prompt: prompt, answer, tokens, nfe, tpf, stopped")
  g.add_argument("--no-progress", action="store_true", help="no progress bar (shown for more than one batch)")
  g.add_argument("--show-steps", action="store_true", help="print the canvas after every forward")
  g.add_argument("-v", "--verbose", action="store_true")
  add_generation_flags(g, model_defaults)
  from dinfer_jax.sharding import add_parallel_flags
  add_parallel_flags(g)
  g.set_defaults(func=cmd_generate)
  try:
    from dinfer_jax.bench import cli as bench_cli  # registered when the benchmark module is present
    bench_cli.register(sub)
  except ImportError:
    pass
  from dinfer_jax.serve import cli as serve_cli  # imports FastAPI only when `serve` runs
  serve_cli.register(sub)
  from dinfer_jax.evaluation import cli as eval_cli  # imports lm-eval only when `lm-eval` runs
  eval_cli.register(sub)
  for name, text in DELEGATED.items():  # listed in the help; main() hands their arguments over unparsed
    sub.add_parser(name, help=text, add_help=False)
  return ap


# ----------------------------------------------------------------------------- delegated subcommands
# `dinfer-jax convert ...` and `dinfer-jax train ...` hand their whole command line to the converter's and
# train_td's own CLIs, so that an installed (non-editable) dinfer-jax can convert and train.

DELEGATED = {"convert": "convert checkpoints: hf2jax | jax2hf | inspect (the converter's own CLI)",
             "train": "train_td: train RUN_DIR | export RUN_DIR | eval --task T (train_td's own CLI; "
                      "'dinfer-jax train RUN_DIR ...' means 'train RUN_DIR ...')"}


def convert_main(argv: Sequence[str]) -> int:
  """The converter's CLI (the same as `python -m convert` in a checkout)."""
  from dinfer_jax.checkpoint.cli import main as convert_cli
  return convert_cli(list(argv), prog="dinfer-jax convert")


def train_main(argv: Sequence[str]) -> int:
  """train_td's CLI (train / export / eval / collect / distill); a first argument that is none of those is a
  run directory."""
  from train_td.__main__ import SUBCOMMANDS, main as train_cli
  argv = list(argv)
  if not argv or argv[0] not in (*SUBCOMMANDS, "-h", "--help"):
    argv = ["train", *argv]
  return train_cli(argv, prog="dinfer-jax train")


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in DELEGATED:
    return (convert_main if argv[0] == "convert" else train_main)(argv[1:])
  args = build_parser(_help_defaults(argv)).parse_args(argv)
  try:
    return args.func(args)
  except (ValueError, FileNotFoundError) as e:  # bad knobs, prompts or paths: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
