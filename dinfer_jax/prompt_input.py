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


def decode_utf8(data: bytes, name: str) -> str:
  """`data` as UTF-8 text; a ValueError naming `name`, the line and the byte when it is not."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise ValueError(f"{name}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_utf8(path, what: str) -> str:
  """The text of a file; errors (missing, unreadable, not UTF-8) are one line naming `what` and the path."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise FileNotFoundError(f"{what} {path}: {e.strerror}") from None
  return decode_utf8(data, f"{what} {path}")


def _parse_jsonl(lines: list[tuple[int, str]], name: str) -> list[Prompt]:
  out = []
  for no, line in lines:
    try:
      v: Any = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{name}:{no}: not valid JSON ({e.msg})") from None
    if isinstance(v, dict) and isinstance(v.get("prompt"), str):
      v = v["prompt"]
    if isinstance(v, str):
      if not v.strip():
        raise ValueError(f"{name}:{no}: empty prompt")
      out.append(v)
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
    name = "<stdin>"
    src = stdin or sys.stdin
    # Bytes when there are any (the real stdin), so that bad UTF-8 is reported like a file's.
    text = decode_utf8(src.buffer.read(), name) if hasattr(src, "buffer") else src.read()
  else:
    name = f"prompts file {path}"
    text = read_utf8(path, "prompts file")
  lines = [(i + 1, l.rstrip("\r")) for i, l in enumerate(text.split("\n")) if l.strip()]
  if lines and all(l.lstrip()[:1] in ("{", '"') for _, l in lines):
    return _parse_jsonl(lines, name)
  return [l for _, l in lines]


def collect(positional: list[str], file: str | None, stdin: TextIO | None = None) -> list[Prompt]:
  """Command-line prompts ('-' reads stdin there), then the file's."""
  out: list[Prompt] = []
  for i, p in enumerate(positional):  # counted from 0, as every other prompt error counts them
    if not p.strip():
      raise ValueError(f"prompt {i} is empty: give the model something to answer")
    out.extend(read_file("-", stdin) if p == "-" else [p])
  if file:
    out.extend(read_file(file, stdin))
  if not out:
    raise ValueError("no prompts: give them as arguments, with --file FILE, or on stdin with '-'")
  return out
