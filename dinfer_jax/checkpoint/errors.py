"""The one exception type the checkpoint code raises for bad inputs."""
from __future__ import annotations


class CheckpointError(ValueError):
  """A checkpoint that is missing, corrupt, or does not match the config.

  The message is one line and names the file and/or tensor key, and for shape problems both the expected
  and the found shape. Callers (the CLI) print it as is, so it must make sense without a traceback.
  """
