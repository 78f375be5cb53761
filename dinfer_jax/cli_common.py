"""The command-line pieces every entry point shares: `dinfer-jax generate`, `serve`, `bench`, `lm-eval` and
train_td's `eval` / `collect` all take their model and generation flags, the model's own defaults
(generation_config.json and its prompt rules) and their prompt encoding from here, so that a knob means the
same thing everywhere. Nothing here imports an entry point (dinfer_jax.cli imports this module, never the
other way round).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

from dinfer_jax import decoders, tasks
from dinfer_jax.api import resolve_path
from dinfer_jax.checkpoint.errors import read_json_object
from dinfer_jax.engine.config import CACHES, GenerationConfig
from dinfer_jax.engine.programs import enable_disk_cache
from dinfer_jax.model import quant


@dataclasses.dataclass(frozen=True)
class Command:
  """A command `dinfer-jax` hands its whole command line to (convert, and those other packages register under
  the "dinfer_jax.commands" entry points): its help line, main(argv, prog) -> exit status, and the names of
  its own subcommands (where a --model given before the command goes: after the subcommand)."""
  help: str
  main: Callable[[Sequence[str], str], int]
  subcommands: tuple[str, ...] = ()



class Terminated(BaseException):
  """SIGTERM, raised in the main thread where Ctrl-C raises KeyboardInterrupt (not an Exception: no handler
  meant for errors swallows it)."""


def _raise_terminated(signum, frame):
  raise Terminated()


def run_stoppable(name: str, fn: Callable[[], int]) -> int:
  """Runs a command's body so that Ctrl-C and SIGTERM end it with one line and exit 130 / 143.

  The process then leaves through os._exit: JAX's and orbax's threads may be inside a compile or a write that
  the signal cut short, and a normal interpreter exit would join them (printing their tracebacks) or cancel
  them inside C++ (an abort, or a segfault). Output is flushed first; what a command writes is written
  atomically (or into a temporary it removes), so nothing half-written is left.
  """
  main_thread = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
  try:
    return fn()
  except KeyboardInterrupt:
    code, what = 130, "interrupted"
  except Terminated:
    code, what = 143, "terminated"
  finally:
    if main_thread:
      signal.signal(signal.SIGTERM, previous)
  try:
    sys.stdout.flush()
  except (OSError, ValueError):
    pass
  print(f"{name}: {what}", file=sys.stderr, flush=True)
  os._exit(code)


DTYPES = ("float32", "bfloat16")
# Weight formats a model can be quantised to on load (model/quant.py: QuantConfig.parse); the per-channel
# ones also take "+embed" (the embedding table too) and "+a8" / "+a8:N" (dynamic 8-bit activations from N
# tokens per forward), e.g. "fp8+head+embed+a8".
QUANTIZE_CHOICES = ("int8", "fp8", "int8-block", "fp8-block", "int8+head", "fp8+head")
_BASES = ("int8", "fp8", "int8-block", "fp8-block", "int8-channel", "fp8-channel")


def is_quantize_spec(s: str) -> bool:
  """Whether s is a weight format quantize_spec accepts (for comma lists such as --weights)."""
  try:
    return bool(quantize_spec(s))
  except argparse.ArgumentTypeError:
    return False


def quantize_spec(s: str) -> str:
  """argparse type of --quantize / --weights entries: a base format with model/quant.py's options."""
  try:
    ok = s.lower().split("+")[0] in _BASES and quant.QuantConfig.parse(s) is not None
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  if not ok:
    raise argparse.ArgumentTypeError(f"{s!r}: choose from {', '.join(QUANTIZE_CHOICES)} (per-channel ones with "
                                     "+head, +embed, +a8 / +a8:N or +a8g / +a8g:N)")
  return s


QUANTIZE_HELP = ("8-bit matmul weights, quantised on load (an 8-bit checkpoint loads as stored without it). "
                 "Recommended: int8 or fp8 (weight-only, per channel). +a8 (per-token activation scales), +a8g "
                 "(a scale per 1x128 group), +head and +embed are experimental: validated only on the embedded "
                 "2M-parameter model, not yet on a real 7B checkpoint (README, '8-bit weights')")


def add_model_flags(ap: argparse.ArgumentParser, *, dtype: bool = True) -> None:
  """--model (a directory, or a shipped model's name) and --dtype, the same for every command."""
  ap.add_argument("--model", default="default",
                  help="model directory (HF or converted) or a shipped model (default, default-td); "
                       "default: %(default)s")
  if dtype:
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--quantize", default=None, type=quantize_spec, metavar="|".join(QUANTIZE_CHOICES[:2]) + "|...",
                    help=QUANTIZE_HELP)


def add_compile_cache_flag(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--compile-cache", default=None, metavar="DIR|off",
                  help="JAX's persistent compilation cache: the next run loads the compiled programs instead of "
                       "compiling them (default: $XDG_CACHE_HOME/dinfer-jax/xla, else ~/.cache/dinfer-jax/xla; "
                       "off: none)")


def use_compile_cache(args: argparse.Namespace) -> pathlib.Path | None:
  """Turns on the --compile-cache (before anything compiles); a directory that cannot be made is a warning."""
  where = getattr(args, "compile_cache", None)
  path = enable_disk_cache(where)
  if path is None and where != "off":
    print(f"warning: cannot create the compilation cache directory {where or 'default'}; programs compile "
          "at every start", file=sys.stderr, flush=True)
  return path


GENERATION_DEFAULTS_FILE = "generation_config.json"


def add_generation_flags(ap: argparse.ArgumentParser, model_defaults: dict[str, Any] | None = None) -> None:
  """One flag per GenerationConfig knob (--gen-length, --block-length, ...). Unset flags stay absent from
  the namespace so that a model's own defaults (its generation_config.json) can fill them; `model_defaults`
  (that file's knobs) are shown in the help."""
  model_defaults = model_defaults or {}
  g = ap.add_argument_group("generation (GenerationConfig; defaults: the model's generation_config.json, "
                            "then the dataclass)")
  choices = {"decoder": decoders.names(), "cache": CACHES}
  named = {n: tuple(decoders.get(n).PRESETS) for n in decoders.names() if decoders.get(n).PRESETS}
  g.add_argument("--decoder-preset", default=argparse.SUPPRESS, metavar="NAME",
                 help="a decoder's named knobs, under the flags given: " +
                      "; ".join(f"{n}: {', '.join(p)}" for n, p in named.items()))
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


def preset_knobs(decoder: str, name: str) -> dict[str, Any]:
  """A decoder's named preset (decoders.Decoder.PRESETS), or a ValueError naming the ones it has."""
  presets = decoders.get(decoder).PRESETS
  if name not in presets:
    raise ValueError(f"--decoder-preset {name}: the {decoder} decoder has " + (
        f"the presets {', '.join(presets)}" if presets else "no presets"))
  return dict(presets[name])


# generation_config.json may hold per-prompt overrides: "prompt_rules": [{"prefix": TEXT, knob: value, ...}].
# The first rule whose prefix starts the prompt (as the model sees it: chat template applied, special tokens
# written out) overrides the file's defaults, e.g. a longer gen_length for a task whose answers are long, so
# that a long question is never cut off at the short default.
PROMPT_RULES = "prompt_rules"


def read_generation_file(model_path: str | None) -> dict[str, Any]:
  if not model_path:
    return {}
  f = pathlib.Path(model_path) / GENERATION_DEFAULTS_FILE
  if not f.exists():
    return {}
  return read_json_object(f, ValueError)


def _known_knobs(data: dict[str, Any]) -> dict[str, Any]:
  known = {fl.name for fl in dataclasses.fields(GenerationConfig)}
  return {k: v for k, v in data.items() if k in known}


def model_generation_defaults(model_path: str | None, prompt_text: str | None = None) -> dict[str, Any]:
  """GenerationConfig knobs a model directory recommends (generation_config.json, dinfer-jax keys only),
  with the first matching prompt rule applied when `prompt_text` is given."""
  return generation_knobs(read_generation_file(model_path), prompt_text)


def generation_knobs(data: dict[str, Any], prompt_text: str | None = None) -> dict[str, Any]:
  """model_generation_defaults for a generation_config.json already read (or about to be written)."""
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
  from_file = model_generation_defaults(model_path, prompt_text)
  flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig) if hasattr(args, f.name)}
  if getattr(args, "decoder_preset", None):  # the decoder's named knobs, under the flags given
    decoder = {**from_file, **flags}.get("decoder", GenerationConfig.decoder)
    flags = {**preset_knobs(decoder, args.decoder_preset), **flags}
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
  for rule in read_generation_file(model_path).get(PROMPT_RULES, []):
    g = generation_config(args, model_path, rule.get("prefix", ""))
    if g not in out:
      out.append(g)
  return out


def knob_sources(args: argparse.Namespace, model_path: str | None) -> dict[str, str]:
  """knob -> where its value came from, for messages."""
  out = {}
  for k in model_generation_defaults(model_path):
    out[k] = str(pathlib.Path(model_path) / GENERATION_DEFAULTS_FILE)
  for f in dataclasses.fields(GenerationConfig):
    if hasattr(args, f.name):
      out[f.name] = "--" + f.name.replace("_", "-")
  return out


def chat_text(model, messages: Sequence[dict], task_names: Sequence[str] | None, where: str = "the chat") -> str:
  """A chat's text through the model's chat template, or a ValueError saying why it would not reach the model.

  Refused: an empty message (as an empty prompt is); a system message the template leaves out (it renders the
  same without it: the embedded model's has no place for one, and its answer ignored it without a word); more
  than one turn to a model that lists the single-question tasks it was trained on (generation_config.json
  "trained_tasks": the embedded model answered a two-turn chat with ''). task_names: trained_tasks(model), read
  once by the caller (the server answers many chats; this runs per request).
  """
  tok = model.tokenizer
  for i, m in enumerate(messages):
    if not str(m.get("content", "")).strip():
      raise ValueError(f"{where}: message {i} ({m.get('role')}) is empty: give the model something to answer")
  turns = [m for m in messages if m.get("role") != "system"]
  if len(turns) > 1 and task_names is not None:
    raise ValueError(f"{where}: {len(turns)} turns, but the model at {model.path} answers single questions (its "
                     f"generation_config.json lists the tasks it was trained on: {', '.join(task_names)}); "
                     "send one user message")
  text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
  if len(turns) < len(messages) and text == tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True):
    raise ValueError(f"{where}: the model's chat template has no place for a system message (it renders the same "
                     "without it); put the instruction in the user message")
  return text


def encode_prompts(model, prompts: Sequence[Any], *, raw: bool = False, system: str | None = None,
                   warn: bool = True) -> list[list[int]]:
  """Text -> token ids, through the tokenizer's chat template when it has one. A prompt may also be a list
  of chat messages ({"role", "content"}); `system` adds a system message before a text prompt's user turn.
  Without a tokenizer the prompts must be token ids ("12,7,99" or "12 7 99")."""
  tok = model.tokenizer
  out = []
  task_names = trained_tasks(model) if tok is not None else None
  for i, p in enumerate(prompts):
    if tok is None:
      if not isinstance(p, str):
        raise ValueError(f"the model at {model.path} has no tokenizer (nor chat template); prompt {i} is a chat")
      try:
        out.append([int(t) for t in p.replace(",", " ").split()])
      except ValueError:
        raise ValueError(f"the model at {model.path} has no tokenizer; give prompts as token ids like "
                         f"'12,7,99' (got {p!r})") from None
      continue
    if isinstance(p, str) and (raw or not getattr(tok, "chat_template", None)):
      out.append(tok.encode(p, add_special_tokens=False))
    else:
      if not getattr(tok, "chat_template", None):
        raise ValueError(f"prompt {i} is a chat, but the model at {model.path} has no chat template")
      msgs = p if not isinstance(p, str) else ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": p}]
      out.append(tok.encode(chat_text(model, msgs, task_names, f"prompt {i}"), add_special_tokens=False))
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


# generation_config.json may list the tasks the model was trained on ("trained_tasks": train_td task names):
# a prompt outside all of them still gets its answer, with a warning that it is likely wrong.
TRAINED_TASKS = "trained_tasks"


def trained_tasks(model) -> list[str] | None:
  """The tasks the model lists as trained (None: it does not say, or has no tokenizer to read prompts)."""
  names = read_generation_file(model.path).get(TRAINED_TASKS) if model.path else None
  return list(names) if names and model.tokenizer is not None else None


def user_turn_markers(tokenizer) -> tuple[str, str]:
  """(the text before a user turn's content, the text after it up to the generation prompt), read off the
  model's chat template: two one-turn chats whose contents differ, rendered, share exactly those."""
  a, b = (tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
          for c in ("a", "b"))
  n = len(os.path.commonprefix([a, b]))
  m = len(os.path.commonprefix([a[::-1], b[::-1]]))
  return a[:n], a[len(a) - m:]


def user_turn(tokenizer, ids: Sequence[int]) -> str:
  """The last user turn's content as the chat template wrote it (e.g. the default model's column format:
  "<|user|> 12* 13<|assistant|>" -> " 12* 13")."""
  text = tokenizer.decode(list(ids), skip_special_tokens=False)
  before, after = user_turn_markers(tokenizer)
  return text.rsplit(before, 1)[-1].split(after, 1)[0] if before else text.split(after, 1)[0]


def prompt_tasks(model, names: Sequence[str], ids: Sequence[Sequence[int]]) -> list[str | None]:
  """Per prompt (token ids, chat template applied), the trained task (dinfer_jax.tasks) its user turn falls
  in, or None."""
  return [tasks.trained_task_of(names, user_turn(model.tokenizer, row)) for row in ids]


def warn_outside_training(index: int, names: Sequence[str]) -> None:
  print(f"warning: prompt {index} is outside what the model was trained on ({', '.join(names)}): its answer "
        "is likely wrong", file=sys.stderr)


# ------------------------------------------------------------------- showing the commit order
MASK_GLYPH = "_"


def _steps(model, canvas: Sequence[int], commit: Sequence[int], prompt_len: int,
           nfe: int) -> Iterator[tuple[int, list[str], list[int]]]:
  """Per forward k: (k, the generated region's cells: committed pieces, '' for a masked position and None
  for one never generated, the positions committed at k)."""
  piece = [_piece(model, t) for t in canvas[prompt_len:]]
  for k in range(1, nfe + 1):
    cells = [piece[j] if 0 < c <= k else (None if c == -1 else "") for j, c in enumerate(commit)]
    yield k, cells, [j for j, c in enumerate(commit) if c == k]


def render_steps(model, canvas: Sequence[int], commit: Sequence[int], prompt_len: int, nfe: int,
                 mask_glyph: str = MASK_GLYPH) -> list[str]:
  """One line per forward: the generated region with the tokens committed so far (masks as '_'),
  the newly committed ones in [brackets]."""
  lines = []
  for k, cells, new in _steps(model, canvas, commit, prompt_len, nfe):
    shown = [f"[{x}]" if j in new else (mask_glyph if x == "" else x or "") for j, x in enumerate(cells)]
    joined = "".join(shown) if model.tokenizer else " ".join(x for x in shown if x)
    lines.append(f"{k:4d} +{len(new):<3d} " + joined)
  return lines


def step_records(model, canvas: Sequence[int], commit: Sequence[int], prompt_len: int, nfe: int) -> list[dict]:
  """--json --show-steps: per forward, the positions (in the answer) it committed, their tokens and text."""
  gen = list(canvas[prompt_len:])
  return [{"step": k, "positions": new, "tokens": [int(gen[j]) for j in new], "text": [cells[j] for j in new]}
          for k, cells, new in _steps(model, canvas, commit, prompt_len, nfe)]


def _piece(model, t: int) -> str:
  if model.tokenizer is None:
    return str(t)
  return model.tokenizer.decode([t], skip_special_tokens=False)


def model_arg(argv: Sequence[str]) -> str:
  """The --model value of a generate/serve/bench command line, read before parsing (for the help)."""
  for i, a in enumerate(argv):
    if a == "--model" and i + 1 < len(argv):
      return argv[i + 1]
    if a.startswith("--model="):
      return a.split("=", 1)[1]
  return "default"


def help_defaults(argv: Sequence[str]) -> dict[str, Any]:
  """The model's generation_config.json knobs, for the help text ({} if the model cannot be found)."""
  if not any(a in ("-h", "--help") for a in argv):
    return {}
  try:
    return model_generation_defaults(str(resolve_path(model_arg(argv))))
  except (OSError, ValueError):
    return {}
