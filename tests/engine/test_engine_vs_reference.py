"""The engine against the plain reference loop (tests/engine/reference.py), token for token.

For every decoder x cache mode x iteration smoothing on the tiny LLaDA-MoE model (golden set A), at batch 1
and at batch 3 with different prompt lengths: each row of the engine's output equals the reference run of
that row alone (canvas, commit steps, the row's NFE). Also dense LLaDA, and LLaDA2 block diffusion (with its
cache, and without a cache under the block-causal mask).

Every engine configuration compiles its own program, so the default run takes a subset that still has every
decoder, every cache mode and smoothing on and off at batch 3; `-m slow` runs the whole cross product.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import generate
from tests.engine.golden import load_model, load_traces
from tests.engine.reference import reference_generate

DECODERS = {
    "threshold": dict(decoder="threshold", threshold=0.9),
    "hierarchy": dict(decoder="hierarchy", threshold=0.9, low_threshold=0.5),
    "credit": dict(decoder="credit", threshold=0.9),
    # 3 steps for blocks of 8 masks: LLaDA's schedule 3, 3, 2 (the remainder goes to the earliest steps).
    "fixed_steps": dict(decoder="fixed_steps", steps_per_block=3),
    "fastdllm": dict(decoder="fastdllm", threshold=0.8),
}
CACHES = {
    "none": dict(cache="none"),
    "prefix": dict(cache="prefix"),
    "dual": dict(cache="dual"),
    "vicinity": dict(cache="dual", prefix_look=4, after_look=4, warmup_steps=2),
}
G, B = 24, 8


def _rows():
  """Three prompts of lengths 5, 11, 16 for the vocab-512 golden models: a random one (which stops early
  on an EOS in its first block under the threshold decoder) and the golden prompts p1 and p2."""
  golden = [p["prompt"] for p in load_traces("A")["prompts"]]
  rng = np.random.default_rng(0)
  return [rng.integers(0, 496, size=5).tolist(), golden[1], golden[2]]


ROWS = _rows()


def make_config(decoder: str, cache: str, smoothing: bool, **kw) -> GenerationConfig:
  return GenerationConfig(gen_length=G, block_length=B, **DECODERS[decoder], **CACHES[cache],
                          cont_weight=0.3 if smoothing else 0.0, **kw)


@functools.cache
def _reference(model: str, prompt: tuple[int, ...], gcfg: GenerationConfig):
  params, cfg = load_model(model)
  return reference_generate(params, cfg, list(prompt), gcfg)


def check_against_reference(model: str, prompts: list[list[int]], gcfg: GenerationConfig):
  res = generate(load_model(model), prompts, gcfg, seed=0)
  eos = load_model(model)[1].eos_token_id
  refs = [_reference(model, tuple(p), gcfg) for p in prompts]
  for r, (p, ref) in enumerate(zip(prompts, refs)):
    ctx = f"row {r} (P={len(p)})"
    assert res.prompt_lengths[r] == len(p)
    assert res.canvas[r] == ref.canvas, ctx
    assert res.commit_step[r] == ref.commit_step, ctx
    assert res.row_nfe[r] == ref.nfe, ctx
    gen = ref.canvas[len(p):]
    k = gen.index(eos) if eos in gen else len(gen)
    assert res.tokens[r] == gen[:k] and res.num_tokens[r] == k, ctx
  row_nfe = [ref.nfe for ref in refs]
  if len(prompts) == 1:
    assert res.nfe == row_nfe[0]
  else:
    # A batched forward counts once: at least the longest row's forwards, at most all of them.
    assert max(row_nfe) <= res.nfe <= sum(row_nfe)
  return res, refs


# ----------------------------------------------------------------------------- LLaDA-MoE (golden set A)

ALL = list(itertools.product(DECODERS, CACHES, (False, True)))
DEFAULT_BATCH3 = (
    {(d, "dual", True) for d in DECODERS}  # every decoder, with a cache and smoothing
    | {("threshold", c, False) for c in ("none", "prefix", "vicinity")}  # the other cache modes, plain
)
DEFAULT_BATCH1 = {("threshold", "prefix", True), ("hierarchy", "vicinity", False)}


def _grid(default):
  return [pytest.param(*combo, id="-".join([combo[0], combo[1], "smooth" if combo[2] else "plain"]),
                       marks=() if combo in default else pytest.mark.slow) for combo in ALL]


def test_default_subset_covers_the_grid():
  combos = DEFAULT_BATCH3
  assert {d for d, _, _ in combos} == set(DECODERS)
  assert {c for _, c, _ in combos} == set(CACHES)
  assert {s for _, _, s in combos} == {False, True}
  assert {len(p) for p in ROWS} == {5, 11, 16}


@pytest.mark.parametrize("decoder,cache,smoothing", _grid(DEFAULT_BATCH3))
def test_batch3_rows_equal_reference(decoder, cache, smoothing):
  check_against_reference("A", ROWS, make_config(decoder, cache, smoothing))


@pytest.mark.parametrize("decoder,cache,smoothing", _grid(DEFAULT_BATCH1))
def test_batch1_equals_reference(decoder, cache, smoothing):
  check_against_reference("A", [ROWS[1]], make_config(decoder, cache, smoothing))


def test_aligned_first_block_batch3():
  """start_block_align: each row's first block starts at floor(P / B) * B (P = 5 -> 0, 11 -> 8, 16 -> 16),
  so the rows' blocks and vicinity windows sit at different offsets from their prompts."""
  check_against_reference("A", ROWS, make_config("threshold", "vicinity", True, start_block_align=True))


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_aligned_first_block_batch3_plain(cache):
  check_against_reference("A", ROWS, make_config("hierarchy", cache, False, start_block_align=True))


# ----------------------------------------------------------------------------- dense LLaDA

DENSE_ALL = [("threshold", "dual", False), ("hierarchy", "prefix", False), ("threshold", "none", True),
             ("hierarchy", "dual", False),
             ("credit", "vicinity", False), ("fastdllm", "none", False), ("fixed_steps", "dual", False),
             ("threshold", "vicinity", True)]
DENSE_DEFAULT = {("hierarchy", "dual", False), ("threshold", "none", True)}


@pytest.mark.parametrize("decoder,cache,smoothing", [
    pytest.param(*c, id="-".join([c[0], c[1], "smooth" if c[2] else "plain"]),
                 marks=() if c in DENSE_DEFAULT else pytest.mark.slow) for c in DENSE_ALL])
def test_dense_batch3_rows_equal_reference(decoder, cache, smoothing):
  """Dense LLaDA, smoothing included (dInfer cannot smooth dense models; we do, Decisions §5)."""
  check_against_reference("dense", ROWS, make_config(decoder, cache, smoothing))


# ----------------------------------------------------------------------------- LLaDA2 block diffusion

def _llada2_rows():
  rng = np.random.default_rng(7)
  return [rng.integers(0, 496, size=n).tolist() for n in (5, 11, 16)]


LLADA2_ROWS = _llada2_rows()
LLADA2_DEFAULT = {("threshold", "prefix"), ("threshold", "none")}


@pytest.mark.parametrize("decoder,cache", [
    pytest.param(d, c, id=f"{d}-{c}", marks=() if (d, c) in LLADA2_DEFAULT else pytest.mark.slow)
    for d in DECODERS for c in ("prefix", "none")])
def test_llada2_block_diffusion_rows_equal_reference(decoder, cache):
  """cache 'prefix': block diffusion with its persisted cache (prefill + clean-K/V forward per block);
  cache 'none': a full forward under the block-causal mask every step. T is padded to a multiple of B."""
  gcfg = make_config(decoder, cache, False)
  res, refs = check_against_reference("llada2", LLADA2_ROWS, gcfg)
  for p, row in zip(LLADA2_ROWS, res.canvas):
    assert len(row) == -(-(len(p) + G) // B) * B
  if cache == "prefix":
    assert all(r.forwards[0][0] == "prefill" for r in refs)


@pytest.mark.slow
def test_llada2_block_diffusion_batch1():
  check_against_reference("llada2", [LLADA2_ROWS[1]], make_config("threshold", "prefix", False))
