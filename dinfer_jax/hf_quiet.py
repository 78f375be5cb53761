"""transformers without the warnings that do not concern dinfer-jax (it uses transformers for tokenizers only)."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Iterator

_ADVISORY = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def import_transformers():
  """Imports transformers without its import-time advice that PyTorch is missing (we never need torch)
  and without tqdm's notebook-widget warning.

  The environment variable that silences it is set only for the import, and only if the user had not set it.
  """
  if "transformers" not in sys.modules:
    ours = _ADVISORY not in os.environ
    if ours:
      os.environ[_ADVISORY] = "1"
    try:
      with warnings.catch_warnings():
        # huggingface_hub imports tqdm.auto, which in a notebook without ipywidgets warns that its
        # widget bar is unavailable: dinfer-jax shows no download bars at all.
        warnings.filterwarnings("ignore", message="IProgress not found")
        import transformers  # noqa: F401
    finally:
      if ours:
        os.environ.pop(_ADVISORY, None)
  return sys.modules["transformers"]


@contextlib.contextmanager
def errors_only() -> Iterator[None]:
  """transformers logs only errors inside the block: loading a tokenizer from a model directory reads its
  config.json and warns that model_type "llada" is not one transformers knows, which is expected here."""
  hf_logging = import_transformers().utils.logging
  old = hf_logging.get_verbosity()
  hf_logging.set_verbosity_error()
  try:
    yield
  finally:
    hf_logging.set_verbosity(old)
