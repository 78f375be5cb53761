"""MBPP pass@1: the first ```python``` block of the answer (or the whole answer when there is none) checked
against the problem's asserts by train_td's harness, in its sandbox (model-written code never runs in a
plain subprocess: it could read the caller's environment and files, or exit 0 before its asserts)."""
from __future__ import annotations

import re
import warnings

from dinfer_jax.tasks import harness, sandbox

_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(answer: str) -> str:
  m = _BLOCK.search(answer)
  return m.group(1) if m else answer


def passes(code: str, setup: str, tests: list[str], timeout: float = 10.0) -> bool:
  limits = sandbox.Limits(cpu_seconds=max(1, int(timeout)), wall_seconds=timeout, memory_bytes=512 * 2**20,
                          max_output_bytes=1 << 20)
  try:
    return harness.check_tests(code, tests, setup or "", limits=limits).passed
  except harness.UnverifiableTest as e:
    warnings.warn(f"MBPP: scored as a failure, the harness cannot verify its tests: {e}")
    return False  # never as a pass


def process_results(doc, results):
  setup = doc.get("test_imports") or []
  setup = "\n".join(setup) if isinstance(setup, list) else str(setup)
  return {"pass_at_1": float(passes(extract_code(results[0]), setup, list(doc["test_list"])))}
