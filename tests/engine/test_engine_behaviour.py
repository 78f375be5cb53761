"""Engine behaviour beyond exact decoding: compilation reuse, early stop and the user-facing tokens,
temperature sampling, the token counter, and input validation."""
from __future__ import annotations

import numpy as np
import pytest

from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import count_generated, generate
from dinfer_jax.engine.loop import run_jit
from tests.engine.golden import load_traces, trace_config
from tests.engine.reference import reference_generate


def _case(name: str) -> dict:
  set_name = name.split("/")[0]
  return next(c for c in load_traces(set_name)["cases"] if c["name"] == name)


# ----------------------------------------------------------------------------- (a) no recompilation

def test_same_bucket_does_not_recompile(model_a):
  """Prompts are padded to a bucket (32): another prompt (other length, other ids) of the same bucket and
  batch size reuses the compiled program; a prompt of the next bucket compiles a new one."""
  gcfg = GenerationConfig(gen_length=16, block_length=8, threshold=0.85, cache="dual")
  rng = np.random.default_rng(3)
  generate(model_a, [rng.integers(0, 496, 11).tolist()], gcfg)
  n = run_jit()._cache_size()
  for length in (13, 30, 1):
    res = generate(model_a, [rng.integers(0, 496, length).tolist()], gcfg)
    assert res.prompt_lengths == [length] and len(res.canvas[0]) == length + 16
    assert run_jit()._cache_size() == n, f"a prompt of length {length} recompiled"
  generate(model_a, [rng.integers(0, 496, 40).tolist()], gcfg)  # bucket 64: a new program
  assert run_jit()._cache_size() == n + 1


@pytest.mark.parametrize("base,knob,values", [
    (GenerationConfig(gen_length=16, block_length=8, cache="dual"), "threshold", (0.3, 0.6, 0.95)),
    (GenerationConfig(gen_length=16, block_length=8, temperature=0.5), "temperature", (0.01, 30.0)),
    (GenerationConfig(gen_length=16, block_length=8, cont_weight=0.3), "cont_weight", (0.1, 0.9)),
    (GenerationConfig(gen_length=16, block_length=8, decoder="hierarchy", threshold=0.95), "low_threshold",
     (0.0, 0.95)),
    (GenerationConfig(gen_length=16, block_length=8, decoder="credit"), "credit_alpha", (0.0, 2.0)),
])
def test_runtime_knobs_do_not_recompile(model_a, base, knob, values):
  """Thresholds, temperature, the smoothing cap and the decoders' knobs are traced values of one program:
  a sweep compiles nothing new, and each value still acts (the outputs are not all alike)."""
  prompts = [[5, 9, 3, 17, 40, 2], [7, 7, 1]]
  first = generate(model_a, prompts, base, seed=1)
  n = run_jit()._cache_size()
  outs = [first]
  for v in values:
    outs.append(generate(model_a, prompts, base.replace(**{knob: v}), seed=1))
    assert run_jit()._cache_size() == n, f"{knob}={v} recompiled"
  assert len({(tuple(map(tuple, o.canvas)), o.nfe, tuple(map(tuple, o.commit_step))) for o in outs}) > 1, \
      f"every {knob} value gave the same output: is the knob reaching the program?"


def test_traced_knobs_equal_compiled_in_values(model_a):
  """The shared program (knobs traced) gives what a program with the values compiled in gives."""
  import functools

  import jax
  import jax.numpy as jnp

  from dinfer_jax.engine import generate as gen_lib
  from dinfer_jax.engine import loop
  from dinfer_jax.engine.program import Knobs
  params, mcfg = model_a
  prompts = [[5, 9, 3, 17, 40, 2], [7, 7, 1]]
  for gcfg in (GenerationConfig(gen_length=16, block_length=8, threshold=0.55, cache="dual"),
               GenerationConfig(gen_length=16, block_length=8, threshold=0.7, cont_weight=0.4, temperature=0.8),
               GenerationConfig(gen_length=16, block_length=8, decoder="credit", threshold=0.6, credit_beta=0.5,
                                credit_gamma=0.5, credit_alpha=1.5)):
    res = generate(model_a, prompts, gcfg, seed=4)
    lay, prog = gen_lib.prepare(mcfg, prompts, gcfg)
    compiled_in = functools.partial(loop.run, prog, knobs=Knobs.of(gcfg))  # closed over: constants
    out = jax.jit(compiled_in)(gen_lib.engine_params(params), jnp.asarray(lay.canvas), jnp.asarray(lay.valid),
                               jnp.asarray(lay.positions), jax.random.PRNGKey(4))
    ref = gen_lib.collect(lay, out, len(prompts), prog.eos_id)
    assert (res.canvas, res.commit_step, res.nfe) == (ref.canvas, ref.commit_step, ref.nfe), gcfg


def test_program_holds_the_structure_not_the_knobs(model_a):
  """The DenoiseProgram (the jit static argument) is the same for every knob value and differs where the
  structure does; the knobs travel as values."""
  from dinfer_jax.engine.generate import prepare
  from dinfer_jax.engine.program import Knobs
  mcfg = model_a[1]
  g = GenerationConfig(threshold=0.4, temperature=0.3, cont_weight=0.2, decoder="hierarchy", low_threshold=0.1)
  prog = lambda c: prepare(mcfg, [[5, 9, 3]], c)[1]  # noqa: E731
  p = prog(g)
  assert p == prog(g.replace(threshold=0.95, temperature=2.0, cont_weight=0.9, low_threshold=0.5))
  assert hash(p) == hash(prog(g.replace(threshold=0.95)))
  assert p != prog(g.replace(temperature=0.0))  # argmax vs sampling: another program
  assert p != prog(g.replace(cont_weight=0.0))  # smoothing off: another program
  assert p != prog(g.replace(cache="dual"))
  assert p.decoder == prog(g.replace(decoder="hierarchy", low_threshold=0.3)).decoder
  k = Knobs.of(g)
  assert (float(k.decoder.threshold), float(k.decoder.low_threshold), float(k.temperature), float(k.cont_weight)) \
      == (np.float32(0.4), np.float32(0.1), np.float32(0.3), np.float32(0.2))


# ----------------------------------------------------------------------------- (b) early stop

def test_early_stop_fill_and_returned_tokens(model_a):
  """Golden A/a/p1: the block [16, 32) decodes an EOS (with non-EOS tokens after it inside the block), so
  [32, 59) is filled with EOS and never decoded. `tokens` stops before the first EOS; `canvas` keeps the
  whole block, junk after the EOS included."""
  case = _case("A/a_thr0.9_nocache/p1")
  eos, P = case["config"]["eos_id"], case["prompt_length"]
  assert case["early_stop_triggered"] and case["first_block_with_eos"] == [16, 32]
  res = generate(model_a, [case["prompt_ids"]], trace_config(case))
  canvas, commit = res.canvas[0], res.commit_step[0]
  assert canvas == case["canvas"] and len(canvas) == case["total_length"]
  # The fill: everything after the EOS block is EOS and was never committed by a forward.
  assert all(t == eos for t in canvas[32:])
  assert all(c == -1 for c in commit[32 - P:])
  # Every position up to the block end was decoded.
  assert all(c >= 1 for c in commit[:32 - P])
  # Tokens: the generated ones before the first EOS (position 16 here: 5 tokens).
  first = canvas.index(eos, P)
  assert first == 16
  assert res.tokens[0] == canvas[P:first] and res.num_tokens == [first - P]
  assert eos not in res.tokens[0]
  # The canvas keeps what came after the first EOS inside the block.
  assert any(t != eos for t in canvas[first:32])
  assert res.nfe == case["num_forwards"]


def test_no_early_stop_without_eos(model_a):
  """Golden A/a/p0 generates no EOS: every position is decoded and `tokens` is the whole generation."""
  case = _case("A/a_thr0.9_nocache/p0")
  res = generate(model_a, [case["prompt_ids"]], trace_config(case))
  assert res.canvas[0] == case["canvas"]
  assert res.tokens[0] == case["canvas"][case["prompt_length"]:]
  assert min(res.commit_step[0]) >= 1


# ----------------------------------------------------------------------------- (c) temperature

def test_temperature_sampling_is_reproducible_and_seeded(model_a):
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, 496, n).tolist() for n in (6, 9)]
  gcfg = GenerationConfig(gen_length=16, block_length=8, threshold=0.9, temperature=1.0)
  a = generate(model_a, prompts, gcfg, seed=0)
  b = generate(model_a, prompts, gcfg, seed=0)
  assert a.canvas == b.canvas and a.commit_step == b.commit_step and a.nfe == b.nfe
  others = [generate(model_a, prompts, gcfg, seed=s).canvas for s in (1, 2)]
  assert any(o != a.canvas for o in others), "different seeds gave the same samples"
  # Same program for every seed: the seed is a traced argument.
  n = run_jit()._cache_size()
  generate(model_a, prompts, gcfg, seed=3)
  assert run_jit()._cache_size() == n


def test_temperature_zero_ignores_the_seed(model_a):
  case = _case("A/a_thr0.9_nocache/p1")
  res = generate(model_a, [case["prompt_ids"]], trace_config(case), seed=1234)
  assert res.canvas[0] == case["canvas"]


# ----------------------------------------------------------------------------- (d) token counter

@pytest.mark.parametrize("generated,want", [
    ([], 0),
    ([5, 6, 7], 3),  # no EOS: everything counts
    ([9], 0),
    ([9, 9, 9], 0),  # EOS first: nothing
    ([5, 9, 6, 9], 1),  # stops at the first EOS; later non-EOS tokens do not count
    ([5, 6, 9], 2),
    ([0, 0, 0, 0, 9, 9], 4),
])
def test_count_generated(generated, want):
  assert count_generated(generated, 9) == want
  assert count_generated(np.asarray(generated, np.int32), 9) == want
  assert count_generated(tuple(generated), 9) == want


def test_count_generated_mask_is_not_eos():
  assert count_generated([509, 509, 506], 506) == 2


# ----------------------------------------------------------------------------- (e) bad inputs

OK = dict(gen_length=16, block_length=8)


@pytest.mark.parametrize("prompts,match", [
    ([[]], r"prompt 0 is empty"),
    ([[1, 2], []], r"prompt 1 is empty"),
    ([], r"non-empty"),
    ([[1] * 250], r"max_position"),  # 250 + 16 > 256
    ([[1, 2, 512]], r"512.*outside the vocabulary"),
    ([[-1, 2]], r"-1.*outside the vocabulary"),
    ([[3, 509]], r"mask token"),
])
def test_bad_prompts(model_a, prompts, match):
  with pytest.raises(ValueError, match=match):
    generate(model_a, prompts, GenerationConfig(**OK))


@pytest.mark.parametrize("kw,match", [
    (dict(decoder="fixed_steps", steps_per_block=2, gen_length=20, block_length=8), r"block_length.*gen_length"),
    (dict(threshold=0.0), r"threshold"),
    (dict(threshold=1.5), r"threshold"),
    (dict(threshold=-0.1), r"threshold"),
    (dict(decoder="greedy"), r"decoder.*unknown"),
    (dict(cache="prefix", prefix_look=4), r"vicinity.*dual"),
    (dict(cache="none", warmup_steps=2), r"vicinity.*dual"),
    (dict(cache="none", after_look=1), r"vicinity.*dual"),
    (dict(cache="paged"), r"cache"),
    (dict(gen_length=0), r"gen_length"),
    (dict(temperature=-1.0), r"temperature"),
])
def test_bad_config(kw, match):
  with pytest.raises(ValueError, match=match):
    GenerationConfig(**{**OK, **kw})


def test_threshold_one_is_allowed():
  assert GenerationConfig(**OK, threshold=1.0).threshold == 1.0


def test_llada2_rejects_smoothing_and_vicinity(model_llada2):
  with pytest.raises(ValueError, match="cont_weight"):
    generate(model_llada2, [[1, 2, 3]], GenerationConfig(**OK, cache="prefix", cont_weight=0.3))
  with pytest.raises(ValueError, match="vicinity"):
    generate(model_llada2, [[1, 2, 3]], GenerationConfig(**OK, cache="dual", prefix_look=4))


def test_skipping_the_owed_forward_moves_the_smoothing_schedule(model_a):
  """docs/design.md D8: the default skips dInfer's cached step after a refresh that completed the block.
  Without smoothing that keeps every token (test_golden_traces.py::test_engine_without_idle_forwards_matches_trace);
  with smoothing the skipped forward would have advanced the schedule and soft-embedded the window past the
  block, so the canvas can differ (this prompt: 12 forwards under dinfer_compat, 16 without). The plain
  reference loop agrees with the engine in both modes."""
  params, cfg = model_a
  g = trace_config(_case("A/h2_itersmooth0.3_thr0.9_dual_vicinity4-4-2/p1")).replace(cont_weight=0.3)
  prompt = [348, 11, 225, 364]
  canvases = {}
  for compat in (True, False):
    gc = g.replace(dinfer_compat=compat)
    res = generate(model_a, [prompt], gc)
    ref = reference_generate(params, cfg, prompt, gc)
    assert (res.canvas[0], res.nfe) == (ref.canvas, ref.nfe), compat
    canvases[compat] = res.canvas[0]
  assert canvases[True] != canvases[False]
