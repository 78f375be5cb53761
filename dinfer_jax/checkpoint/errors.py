"""The one exception type the checkpoint code raises for bad inputs, and the JSON-file reader that raises it."""
from __future__ import annotations

import json
import os


class CheckpointError(ValueError):
  """A checkpoint that is missing, corrupt, or does not match the config.

  The message is one line and names the file and/or tensor key, and for shape problems both the expected
  and the found shape. Callers (the CLI) print it as is, so it must make sense without a traceback.
  """


def read_json_object(path: os.PathLike, error: type[ValueError] | None = None) -> dict:
  """A JSON file that must hold an object (config.json, generation_config.json, ...); an unreadable or
  unparsable file, or another JSON value, is `error` (default CheckpointError) naming the file."""
  error = error or CheckpointError
  try:
    with open(path, "rb") as fh:
      data = json.loads(fh.read().decode("utf-8"))
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise error(f"{path}: cannot parse: {e}") from None
  if not isinstance(data, dict):
    raise error(f"{path}: expected a JSON object")
  return data
