"""Help that shows every flag's real default. Stdlib only: the converter's CLI uses it before jax is imported."""
from __future__ import annotations

import argparse

_NO_VALUE = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
             argparse._CountAction, argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def shows_default(action: argparse.Action) -> bool:
  """Whether a flag has a default value its help must show (not a switch, not required, not unset)."""
  return (bool(action.option_strings) and not isinstance(action, _NO_VALUE) and not action.required
          and action.help != argparse.SUPPRESS and action.default is not None
          and action.default is not argparse.SUPPRESS)


class DefaultsFormatter(argparse.HelpFormatter):
  """Appends "(default: X)" to a flag's help unless the help already says its default."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    if shows_default(action) and "%(default)" not in text and "default" not in text.lower():
      text += (" " if text else "") + "(default: %(default)s)"
    return text


def parsers(ap: argparse.ArgumentParser):
  """The parser and all its subcommands' parsers, depth first, as (prog, parser)."""
  yield ap.prog, ap
  for action in ap._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
        yield from parsers(sub)


def show_defaults(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Sets DefaultsFormatter on `ap` and every subcommand under it; returns `ap`."""
  for _, p in parsers(ap):
    if p.formatter_class is argparse.HelpFormatter:
      p.formatter_class = DefaultsFormatter
    for action in p._actions:
      if shows_default(action) and not action.help:  # argparse prints no help line, so no default, without one
        action.help = "default: %(default)s"
  return ap


def first_paragraph(doc: str) -> str:
  """A module docstring's first paragraph on one line: a parser's description, never cut mid-sentence."""
  return " ".join(doc.strip().split("\n\n")[0].split())
