"""The benchmark's Python-stepped driver (engine.stepped with a JitRunner) equals the engine token for token,
in commit steps and in NFE, like the tests' reference runner does (tests/engine)."""
from __future__ import annotations

import pytest

from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import generate
from dinfer_jax.engine.stepped import JitRunner, stepped_generate
from tests.engine.golden import load_model

PROMPT = [3, 17, 42, 99, 7, 12, 200, 311, 45, 6, 8]
CASES = {
    "threshold-dual-smooth": ("A", dict(decoder="threshold", cache="dual", cont_weight=0.3)),
    "hierarchy-vicinity": ("A", dict(decoder="hierarchy", low_threshold=0.5, cache="dual", prefix_look=4,
                                     after_look=4, warmup_steps=2)),
    "credit-prefix": ("A", dict(decoder="credit", cache="prefix")),
    "fixed_steps-none": ("A", dict(decoder="fixed_steps", steps_per_block=3, cache="none")),
    "llada2-block-diffusion": ("llada2", dict(decoder="threshold", cache="prefix")),
}


FAST = ("threshold-dual-smooth", "fixed_steps-none")  # the rest compile more programs: -m slow


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_jit_runner_equals_engine(case):
  model, kw = CASES[case]
  params, cfg = load_model(model)
  gcfg = GenerationConfig(gen_length=24, block_length=8, threshold=0.9, **kw)
  got = stepped_generate(params, cfg, PROMPT, gcfg, runner=JitRunner())
  res = generate((params, cfg), [PROMPT], gcfg)
  assert got.canvas == res.canvas[0]
  assert got.commit_step == res.commit_step[0]
  assert got.nfe == res.nfe == res.row_nfe[0]
