"""Help that tells the truth: every flag of every command shows the default the parser really uses, and the
generation flags of the commands that decode show the model's generation_config.json values."""
import argparse

import pytest

from dinfer_jax import cli, cli_common, cli_help
from dinfer_jax.checkpoint import cli as convert_cli
from train_td import __main__ as td_main


def _all_parsers():
  yield from cli_help.parsers(cli.build_parser(cli_common.help_defaults([])))
  yield from cli_help.parsers(td_main.build_parser())
  yield from cli_help.parsers(convert_cli.build_parser())


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
  return parser._get_formatter()._expand_help(action) if action.help else ""


def test_every_flag_shows_the_default_the_parser_uses():
  missing = []
  n = 0
  for prog, parser in _all_parsers():
    assert parser.formatter_class is not argparse.HelpFormatter or parser.add_help is False, prog
    for action in parser._actions:
      if not cli_help.shows_default(action):
        continue
      n += 1
      d = action.default
      shown = ",".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
      if shown not in _help(parser, action):
        missing.append(f"{prog} {action.option_strings[0]}: default {d!r}, help {_help(parser, action)!r}")
  assert n > 60 and not missing, "\n".join(missing)


@pytest.mark.parametrize("argv", [["train", "eval", "--help"], ["train", "collect", "--help"],
                                  ["generate", "--help"], ["serve", "--help"]])
def test_generation_defaults_shown_are_the_models(argv, capsys):
  """The embedded model decodes gen_length 8 / block 8 / dual cache / prompt bucket 16 (its
  generation_config.json); `train eval --help` and `collect --help` showed the dataclass's 128 / 32 / none / 32."""
  model = cli_common.model_generation_defaults(str(cli_common.resolve_path(None)))
  assert {"gen_length", "block_length", "cache", "prompt_bucket"} <= set(model)
  with pytest.raises(SystemExit):
    cli.main(argv)
  text = " ".join(capsys.readouterr().out.split())
  for knob in ("gen_length", "block_length", "cache", "prompt_bucket"):
    flag = "--" + knob.replace("_", "-")
    assert f"{flag} " in text and f"default {model[knob]!r} (the model's generation_config.json" in text, knob
