"""Prompts for `dinfer-jax generate`: from the command line, a file or stdin ('-'), one per line or JSONL.

JSONL lines may be {"prompt": "..."} (a user turn), {"messages": [{"role": ..., "content": ...}, ...]} (a
whole chat, system prompt included) or a JSON string. A file is read as JSONL when every non-empty line
is a JSON object or string; otherwise every non-empty line is one prompt.
"""
from __future__ import annotations

import json
import sys
from typing import Any, TextIO, Union

Prompt = Union[str, list]  # text, or a list of chat messages


def _parse_jsonl(lines: list[tuple[int, str]], name: str) -> list[Prompt]:
  out = []
  for no, line in lines:
    try:
      v: Any = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{name}:{no}: not valid JSON ({e.msg})") from None
    if isinstance(v, str):
      out.append(v)
    elif isinstance(v, dict) and isinstance(v.get("prompt"), str):
      out.append(v["prompt"])
    elif isinstance(v, dict) and isinstance(v.get("messages"), list) and v["messages"] and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in v["messages"]):
      out.append([{"role": m["role"], "content": m["content"]} for m in v["messages"]])
    else:
      raise ValueError(f"{name}:{no}: expected {{\"prompt\": text}}, {{\"messages\": [{{\"role\", \"content\"}}, "
                       f"...]}} or a JSON string")
  return out


def read_file(path: str, stdin: TextIO | None = None) -> list[Prompt]:
  """The prompts of a file ('-' = stdin)."""
  if path == "-":
    name, text = "<stdin>", (stdin or sys.stdin).read()
  else:
    name = path
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except OSError as e:
      raise FileNotFoundError(f"prompts file {path}: {e.strerror}") from None
  lines = [(i + 1, l.rstrip("\r")) for i, l in enumerate(text.split("\n")) if l.strip()]
  if lines and all(l.lstrip()[:1] in ("{", '"') for _, l in lines):
    return _parse_jsonl(lines, name)
  return [l for _, l in lines]


def collect(positional: list[str], file: str | None, stdin: TextIO | None = None) -> list[Prompt]:
  """Command-line prompts ('-' reads stdin there), then the file's."""
  out: list[Prompt] = []
  for p in positional:
    out.extend(read_file("-", stdin) if p == "-" else [p])
  if file:
    out.extend(read_file(file, stdin))
  if not out:
    raise ValueError("no prompts: give them as arguments, with --file FILE, or on stdin with '-'")
  return out
