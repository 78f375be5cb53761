"""`dinfer-jax` command line: generate (and the subcommands other modules register). The pieces the
commands share (model and generation flags, the model's defaults, prompt encoding) are in cli_common."""
from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import sys
import time
from typing import Any, Sequence

import jax
from tqdm import tqdm

import dinfer_jax
from dinfer_jax import cli_common, cli_help, diagnostics, prompt_input
from dinfer_jax.answer import cut_at_stop, shown_answer, with_token_cap
from dinfer_jax.bench import cli as bench_cli
from dinfer_jax.checkpoint import cli as checkpoint_cli
from dinfer_jax.cli_common import (Command, decode_tokens, encode_prompts, generation_config, knob_sources,
                                   render_steps, step_records)
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.evaluation import cli as eval_cli
from dinfer_jax.serve import cli as serve_cli
from dinfer_jax.sharding import add_parallel_flags, setup_parallel


def _print_answer(args: argparse.Namespace, model, prompts: Sequence[Any], r: int, res, i: int) -> int:
  """Prints prompt r's answer (row i of `res`) as --json/--show-steps ask; returns its token count."""

  toks = res.tokens[i][:args.max_new_tokens] if args.max_new_tokens else res.tokens[i]
  # The same shown answer in plain and JSON output; --show-steps shows the raw canvas.
  text, stopped = cut_at_stop(decode_tokens(model, toks), args.stop)
  text = shown_answer(text)
  steps = (res.canvas[i], res.commit_step[i], res.prompt_lengths[i], res.row_nfe[i])
  if args.json:
    out = {"prompt": prompts[r], "answer": text, "tokens": len(toks), "nfe": res.row_nfe[i],
           "tpf": len(toks) / res.row_nfe[i] if res.row_nfe[i] else 0.0, "stopped": stopped}
    if args.trained_task is not None:  # the model lists its trained tasks: which one (null: none)
      out["trained_task"] = args.trained_task[r]
    if args.show_steps:
      out["steps"] = step_records(model, *steps)
    print(json.dumps(out), flush=True)
    return len(toks)
  if len(prompts) > 1:
    print(f"### {prompts[r] if isinstance(prompts[r], str) else prompts[r][-1]['content']}")
  if args.show_steps:
    for line in render_steps(model, *steps):
      print(line)
  print(text)
  return len(toks)


def cmd_generate(args: argparse.Namespace) -> int:

  if args.batch_size <= 0:
    raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
  prompts = prompt_input.collect(args.prompts, args.file)
  mesh = setup_parallel(args)  # before any JAX computation (jax.distributed.initialize requires it)
  cli_common.use_compile_cache(args)
  model = dinfer_jax.load(args.model, dtype=args.dtype, mesh=mesh, quantize=args.quantize)
  ids = encode_prompts(model, prompts, raw=args.raw, system=args.system)
  names = cli_common.trained_tasks(model)
  args.trained_task = None if names is None else cli_common.prompt_tasks(model, names, ids)
  for r, task in enumerate(args.trained_task or []):
    if task is None:
      cli_common.warn_outside_training(r, names)
  # Prompts whose generation settings differ (a prompt rule of the model) run as separate batches.
  groups: dict[GenerationConfig, list[int]] = {}
  for r, row in enumerate(ids):
    text = model.tokenizer.decode(row) if model.tokenizer is not None else None
    gcfg = with_token_cap(generation_config(args, model.path, text), args.max_new_tokens)
    groups.setdefault(gcfg, []).append(r)
  sources = knob_sources(args, model.path)
  # NaN/inf weights: load refused them already.
  for gcfg, rows in groups.items():  # before compiling anything
    diagnostics.check_ids(model, gcfg, sources)
    diagnostics.check_fits(model, [ids[r] for r in rows], gcfg, source=sources.get("gen_length", "gen_length"))
  chunks = [(gcfg, rows[i:i + args.batch_size]) for gcfg, rows in groups.items()
            for i in range(0, len(rows), args.batch_size)]
  # Every process holds the gathered result; one prints it.
  printer = jax.process_index() == 0
  progress = None
  if len(chunks) > 1 and not args.no_progress and printer:
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


def build_parser(model_defaults: dict[str, Any] | None = None, *, plugin_help: bool = False) -> argparse.ArgumentParser:
  """The parser; plugin_help loads the plugin commands to show their own help lines (for --help only)."""
  ap = argparse.ArgumentParser(prog="dinfer-jax", description="Diffusion-LLM inference in JAX")
  ap.add_argument("--version", action="version", version=f"dinfer-jax {dinfer_jax.__version__}")
  # Read before parsing and handed to the subcommand (_hoist_model): `dinfer-jax --model default-td generate`.
  ap.add_argument("--model", metavar="MODEL", help="the model of the command that follows (the same as its own "
                  "--model)")
  sub = ap.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate answers for prompts")
  g.add_argument("prompts", nargs="*", help="prompt texts ('-' reads prompts from stdin; token ids like '1,2,3' "
                 "for models without a tokenizer)")
  g.add_argument("--file", "-f", default=None, help="more prompts: one per line, or JSONL ({\"prompt\": ...} or "
                 "{\"messages\": [...]}); '-' is stdin")
  cli_common.add_model_flags(g)
  cli_common.add_compile_cache_flag(g)
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
                 help="one JSON object per prompt: prompt, answer, tokens, nfe, tpf, stopped (and steps, with "
                      "--show-steps)")
  g.add_argument("--no-progress", action="store_true", help="no progress bar (shown for more than one batch)")
  g.add_argument("--show-steps", action="store_true", help="print the canvas after every forward")
  g.add_argument("-v", "--verbose", action="store_true")
  cli_common.add_generation_flags(g, model_defaults)
  add_parallel_flags(g)
  g.set_defaults(func=cmd_generate)
  try:
    bench_cli.register(sub, model_defaults)
  except ImportError:
    pass
  serve_cli.register(sub, model_defaults)
  eval_cli.register(sub)
  for name in delegated_names():  # listed in the help; main() hands their arguments over unparsed
    text = delegated(name).help if plugin_help or name == "convert" else f"{_plugins()[name].module}'s command"
    sub.add_parser(name, help=text, add_help=False)
  return cli_help.show_defaults(ap)


# ----------------------------------------------------------------------------- delegated subcommands
# `dinfer-jax convert ...` hands its whole command line to the converter's own CLI, and every command a
# package registers under the "dinfer_jax.commands" entry point group (train_td's `train`, see pyproject.toml)
# hands it to that package's CLI: the library never imports its plugins by name, yet an installed
# (non-editable) dinfer-jax can convert and train.


def convert_main(argv: Sequence[str], prog: str = "dinfer-jax convert") -> int:
  """The converter's CLI (the same as `python -m convert` in a checkout)."""
  return checkpoint_cli.main(list(argv), prog=prog)


CONVERT = Command("convert checkpoints: hf2jax | jax2hf | inspect (the converter's own CLI)", convert_main)
COMMAND_GROUP = "dinfer_jax.commands"


@functools.cache
def _plugins() -> dict[str, importlib.metadata.EntryPoint]:
  return {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMAND_GROUP) if ep.name != "convert"}


def delegated_names() -> tuple[str, ...]:
  """convert and the commands installed packages register (entry point group COMMAND_GROUP), without
  loading them (a plugin is imported only when its command runs, or for --help)."""
  return ("convert", *_plugins())


@functools.cache
def delegated(name: str) -> Command:
  """The delegated command `name`, its plugin loaded. A plugin that cannot be loaded is a one-line error."""
  if name == "convert":
    return CONVERT
  ep = _plugins()[name]
  try:
    return ep.load()
  except Exception as e:  # noqa: BLE001 - a broken plugin must not take the other commands down
    raise SystemExit(f"error: the {name!r} command ({ep.value}) cannot be loaded: {type(e).__name__}: {e}") from None


def _hoist_model(argv: list[str]) -> list[str]:
  """A --model given before the command (`dinfer-jax --model M generate ...`) goes to the command; for a
  delegated one with subcommands (`train`), to its subcommand (eval, collect), which is where it takes --model."""
  lead = []
  while argv and (argv[0].startswith("--model=") or (argv[0] == "--model" and len(argv) > 1)):
    n = 1 if argv[0].startswith("--model=") else 2
    lead, argv = lead + argv[:n], argv[n:]
  if not lead or not argv or argv[0].startswith("-"):
    return lead + argv
  at = 1
  if argv[0] in delegated_names() and len(argv) > 1:
    at = 2 if argv[1] in delegated(argv[0]).subcommands else 1
  return argv[:at] + lead + argv[at:]


def main(argv: Sequence[str] | None = None) -> int:
  argv = _hoist_model(list(sys.argv[1:] if argv is None else argv))
  name = f"dinfer-jax {argv[0]}" if argv and not argv[0].startswith("-") else "dinfer-jax"
  return cli_common.run_stoppable(name, lambda: _main(argv))


def _main(argv: list[str]) -> int:
  if argv and argv[0] in delegated_names():
    return delegated(argv[0]).main(argv[1:], f"dinfer-jax {argv[0]}")
  args = build_parser(cli_common.help_defaults(argv), plugin_help=argv[:1] in (["-h"], ["--help"])).parse_args(argv)
  try:
    return args.func(args)
  except (ValueError, FileNotFoundError) as e:  # bad knobs, prompts or paths: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
