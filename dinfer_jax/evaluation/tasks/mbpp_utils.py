"""MBPP pass@1: the first ```python``` block of the answer (or the whole answer when there is none) run
with the problem's imports and asserts in a fresh interpreter, 10 s limit."""
from __future__ import annotations

import re
import subprocess
import sys

_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(answer: str) -> str:
  m = _BLOCK.search(answer)
  return m.group(1) if m else answer


def passes(code: str, setup: str, tests: list[str], timeout: float = 10.0) -> bool:
  program = "\n".join([setup or "", code, *tests])
  try:
    r = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return False
  return r.returncode == 0


def process_results(doc, results):
  setup = doc.get("test_imports") or []
  setup = "\n".join(setup) if isinstance(setup, list) else str(setup)
  return {"pass_at_1": float(passes(extract_code(results[0]), setup, list(doc["test_list"])))}
