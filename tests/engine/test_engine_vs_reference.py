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

import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.cache import KVCache
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import generate
from tests.engine import reference as ref_lib
from tests.engine.golden import MODEL_DIRS, load_model, load_traces
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
  kw.setdefault("gen_length", G)
  return GenerationConfig(block_length=B, **DECODERS[decoder], **CACHES[cache],
                          cont_weight=0.3 if smoothing else 0.0, **kw)


@functools.cache
def _model(name: str):
  """A golden model; "llada2_eos" is tiny LLaDA2 with the LM-head columns of EOS (506) and token 508 swapped,
  so that it predicts EOS where the original predicts 508 (rows 0 and 1 of LLADA2_ROWS, in block [8, 16))."""
  if name != "llada2_eos":
    return load_model(name)
  params, cfg = load_model("llada2")
  head = params["lm_head"]
  assert cfg.eos_token_id == 506
  head = head.at[:, [506, 508]].set(head[:, [508, 506]])
  return {**params, "lm_head": head}, cfg


@functools.cache
def _reference(model: str, prompt: tuple[int, ...], gcfg: GenerationConfig):
  params, cfg = _model(model)
  return reference_generate(params, cfg, list(prompt), gcfg)


def check_against_reference(model: str, prompts: list[list[int]], gcfg: GenerationConfig):
  res = generate(_model(model), prompts, gcfg, seed=0)
  eos = _model(model)[1].eos_token_id
  refs = [_reference(model, tuple(p), gcfg) for p in prompts]
  for r, (p, ref) in enumerate(zip(prompts, refs)):
    ctx = f"row {r} (P={len(p)})"
    assert res.prompt_lengths[r] == len(p)
    assert res.canvas[r] == ref.canvas, ctx
    assert res.commit_step[r] == ref.commit_step, ctx
    assert res.row_nfe[r] == ref.nfe, ctx
    gen = ref.canvas[len(p):len(p) + gcfg.gen_length]  # block diffusion decodes past it to its block's end
    k = gen.index(eos) if eos in gen else len(gen)
    assert res.tokens[r] == gen[:k] and res.num_tokens[r] == k, ctx
  full, cached, prefill = batched_forwards(refs)
  assert res.nfe == full + cached + prefill
  assert res.forward_counts == {"full": full, "cached": cached}
  return res, refs


def batched_forwards(refs) -> tuple[int, int, int]:
  """The forwards a batched run executes, predicted from the rows' reference runs: rows step through a
  block in lockstep (the i-th iteration of block k is every row's i-th forward in its k-th block), and each
  iteration runs the full-canvas kind and the cached kind at most once, batched over the rows needing it.
  Returns (full, cached, prefill)."""
  per_iter: dict[tuple[int, int], set[str]] = {}
  prefill = 0
  for ref in refs:
    seen: dict[int, int] = {}
    for (kind, _, _), blk in zip(ref.forwards, ref.forward_block):
      if kind == "prefill":
        prefill = 1
        continue
      i = seen.get(blk, 0)
      seen[blk] = i + 1
      per_iter.setdefault((blk, i), set()).add("full" if kind in ("full", "refresh") else "cached")
  full = sum("full" in k for k in per_iter.values())
  cached = sum("cached" in k for k in per_iter.values())
  return full, cached, prefill


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


def test_reference_is_independent_of_the_engine():
  """The reference (now dinfer_jax.engine.stepped, re-exported by tests/engine/reference.py) must not use the
  engine's loop, layout, iteration manager or cache manager, or it would check the engine against itself."""
  import ast
  import inspect

  from dinfer_jax.engine import stepped
  imported = set()
  for node in ast.walk(ast.parse(inspect.getsource(stepped))):
    if isinstance(node, ast.ImportFrom):
      imported |= {f"{node.module}.{a.name}" for a in node.names}
    elif isinstance(node, ast.Import):
      imported |= {a.name for a in node.names}
  ours = {m for m in imported if m.startswith("dinfer_jax")}
  # model.quant: the weight format (an 8-bit embedding table's rows), part of the model like the forward.
  assert ours <= {"dinfer_jax.decoders", "dinfer_jax.cache.KVCache", "dinfer_jax.model.transformer.forward",
                  "dinfer_jax.model.quant"}, ours
  assert ref_lib.reference_generate is stepped.reference_generate


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
  """start_block_align: each row's first block starts at floor(P / B) * B (P = 5 -> 0, 11 -> 8, 16 -> 16), so
  the first blocks hold prompt tokens (which split the hierarchy decoder's runs)."""
  check_against_reference("A", ROWS, make_config("hierarchy", "none", False, start_block_align=True))


@pytest.mark.slow
@pytest.mark.parametrize("decoder,cache,smoothing", [("threshold", "vicinity", True), ("hierarchy", "prefix", False),
                                                     ("credit", "dual", False), ("threshold", "none", True)])
def test_aligned_first_block_batch3_more(decoder, cache, smoothing):
  """Aligned blocks shift the vicinity windows and the prefix inputs of each row differently."""
  check_against_reference("A", ROWS, make_config(decoder, cache, smoothing, start_block_align=True))


# With smoothing this case used to fail (the 16-token prompt's row left the reference in its fourth block, canvas
# position 40) and was a strict xfail. A -m slow run on 2026-12-03 found it passing, and it already passed
# before that day's loop changes (checked at f665786, whose engine is b1167e2's): an earlier change made it
# agree; which one was not bisected. It stays under -m slow. On 2026-12-06 it failed again (row 2, index 41: 481
# vs 288) at every commit back to the one that recorded it passing, a README-only commit included: the outcome
# depends on the environment (a near-tie in that row's fourth block), not on the engine's code.
@pytest.mark.parametrize("smoothing", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_prefix_windows_shrink_batch3(smoothing):
  """Five blocks: the prefix cache's cached forward runs windows of 5, 3, 2 and 1 blocks (iteration.
  prefix_windows), the narrowest holding the block and everything after it; block 1's 4 blocks take the
  5-block window moved left onto the canvas. Every row still equals the reference's exact [s, end) window."""
  from dinfer_jax.engine import iteration
  gcfg = make_config("threshold", "prefix", smoothing, gen_length=5 * B)
  assert iteration.prefix_windows(5, B) == (40, 24, 16, 8)
  widths = [iteration.prefix_windows(5, B)[int(iteration.prefix_window_index(C + k * B, widths=(40, 24, 16, 8),
                                                                            gen_end=C + 5 * B))]
            for C in (16,) for k in range(5)]
  assert widths == [40, 40, 24, 16, 8]
  res, refs = check_against_reference("A", ROWS, gcfg)
  assert max(len(r.forward_block) and max(r.forward_block) for r in refs) == 4  # a row reached the last block
  # The cached forwards per window width, predicted from the rows' reference runs (lockstep iterations).
  want = {w: 0 for w in (40, 24, 16, 8)}
  per_iter = set()
  for ref in refs:
    seen = {}
    for (kind, _, _), blk in zip(ref.forwards, ref.forward_block):
      i = seen.get(blk, 0)
      seen[blk] = i + 1
      if kind == "cached":
        per_iter.add((blk, i))
  for blk, _ in per_iter:
    want[widths[blk]] += 1
  assert res.cached_windows == want and sum(want.values()) == res.forward_counts["cached"], (res.cached_windows, want)
  assert want[8] > 0 and want[40] > 0


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
  """Dense LLaDA, smoothing included (dInfer cannot smooth dense models; we do, docs/design.md D6)."""
  check_against_reference("dense", ROWS, make_config(decoder, cache, smoothing))


# ----------------------------------------------------------------------------- LLaDA2 block diffusion

def _llada2_rows():
  rng = np.random.default_rng(7)
  return [rng.integers(0, 496, size=n).tolist() for n in (5, 11, 16)]


LLADA2_ROWS = _llada2_rows()
G2 = 16  # LLaDA2 runs: fewer blocks, so fewer cache lengths for the reference to compile
LLADA2_DEFAULT = {("threshold", "prefix"), ("threshold", "none")}


@pytest.mark.parametrize("decoder,cache", [
    pytest.param(d, c, id=f"{d}-{c}", marks=() if (d, c) in LLADA2_DEFAULT else pytest.mark.slow)
    for d in DECODERS for c in ("prefix", "none")])
def test_llada2_block_diffusion_rows_equal_reference(decoder, cache):
  """cache 'prefix': block diffusion with its persisted cache (prefill + clean-K/V forward per block);
  cache 'none': a full forward under the block-causal mask every step. T is padded to a multiple of B."""
  gcfg = make_config(decoder, cache, False, gen_length=G2)
  res, refs = check_against_reference("llada2", LLADA2_ROWS, gcfg)
  for p, row in zip(LLADA2_ROWS, res.canvas):
    assert len(row) == -(-(len(p) + G2) // B) * B  # 24, 32, 32
  if cache == "prefix":
    assert all(r.forwards[0][0] == "prefill" for r in refs)


def test_reference_block_diffusion_step_matches_dinfer():
  """The reference's block-diffusion forwards against dInfer's recorded logits (golden/forward/tiny_llada2_moe):
  prefill x[:16] under the block-causal mask, extend the cache to 24, then a cached step on x[16:24]."""
  params, cfg = load_model("llada2")
  d = MODEL_DIRS["llada2"]
  x = np.load(d / "input_ids.npy")[0]
  want = np.load(d / "ref_logits_bd_cache.npy")[0]
  table = np.asarray(params["embed"])
  _, kv = ref_lib._fwd(params, cfg, table[x[:16]], 0, mask=ref_lib._block_causal(16, 8))
  pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, 8), (0, 0), (0, 0)))
  got, _ = ref_lib._fwd(params, cfg, table[x[16:24]], 16, cache=KVCache(pad(kv.k), pad(kv.v)))
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
  full, _ = ref_lib._fwd(params, cfg, table[x[:24]], 0, mask=ref_lib._block_causal(24, 8))
  np.testing.assert_allclose(full, np.load(d / "ref_logits_blockcausal.npy")[0], atol=2e-4, rtol=0)


@pytest.mark.parametrize("cache", ["prefix", pytest.param("none", marks=pytest.mark.slow)])
def test_llada2_early_stop_rows_equal_reference(cache):
  """Block diffusion with rows that stop early (per row: EOS fill from the block end, no more forwards)."""
  gcfg = make_config("threshold", cache, False, gen_length=G2)
  res, refs = check_against_reference("llada2_eos", LLADA2_ROWS, gcfg)
  stopped = [506 in ref.canvas[len(p):] for p, ref in zip(LLADA2_ROWS, refs)]
  assert stopped == [True, True, False]
  for p, ref in zip(LLADA2_ROWS[:2], refs[:2]):
    assert ref.canvas[16:] == [506] * (len(ref.canvas) - 16)  # EOS decoded in [8, 16): filled from 16


@pytest.mark.slow
def test_llada2_block_diffusion_batch1():
  check_against_reference("llada2", [LLADA2_ROWS[1]], make_config("threshold", "prefix", False, gen_length=G2))


@pytest.mark.parametrize("name", ["llada2", "llada2_eos"])
def test_llada2_cross_block_update_drops_the_clean_kv_forwards(name):
  """Block diffusion by default (dInfer v0.2): a block's first forward also takes the previous block as queries
  and rewrites its K/V from its final tokens, so no clean-K/V forward follows any block; dinfer_compat runs
  v0.1's after each block (after the last and an EOS-ended one too). Same tokens; per row as many forwards fewer
  as v0.1 ran clean-ups. The plain reference loop runs each the same way (the canvas and NFE match it)."""
  base = make_config("threshold", "prefix", False, gen_length=G2)
  compat, compat_refs = check_against_reference(name, LLADA2_ROWS, base.replace(dinfer_compat=True))
  res, refs = check_against_reference(name, LLADA2_ROWS, base)
  assert res.canvas == compat.canvas
  for r, (ref, cref) in enumerate(zip(refs, compat_refs)):
    kinds, finals = [k for k, _, _ in ref.forwards], [k for k, _, _ in cref.forwards].count("final")
    assert finals >= 1 and res.row_nfe[r] == compat.row_nfe[r] - finals, (r, kinds)
    assert "final" not in kinds and kinds.count("cross") == len(ref.blocks) - 1, kinds
