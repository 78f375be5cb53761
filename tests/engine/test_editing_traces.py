"""LLaDA2.1's token editing (the joint_threshold decoder) against the golden editing traces: 17 cases decoded by
SGLang 0.5.23's JointThreshold step on a tiny LLaDA2-MoE (tests/golden/decode/editing/README.md). The plain
reference loop, with the step written out in numpy, reproduces every forward's unmasked and edited positions
and tokens; the engine (no cache, and block diffusion's cache) reproduces the canvas, the NFE and each
position's last write."""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax import decoders
from dinfer_jax.checkpoint import load_hf_params, read_hf_config
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import generate
from tests.engine.golden import DECODE
from tests.engine.reference import reference_generate

EDITING = DECODE / "editing"
TRACES = json.loads((EDITING / "traces.json").read_text())
CASES = TRACES["cases"]


@functools.cache
def model():
  cfg, _ = read_hf_config(EDITING)
  return jax.tree_util.tree_map(jnp.asarray, load_hf_params(EDITING, cfg, "float32")), cfg


def config(case: dict, cache: str = "none") -> GenerationConfig:
  c = case["config"]
  assert c["mask_guard"] and c["temperature"] == 0 and c["penalty_lambda"] == 0
  return GenerationConfig(gen_length=c["gen_length"], block_length=c["block_length"], decoder="joint_threshold",
                          threshold=c["threshold"], edit_threshold=c["edit_threshold"],
                          max_post_steps=c["max_post_steps"], cache=cache, mask_id=c["mask_id"],
                          eos_id=c["eos_id"], prompt_bucket=c["block_length"])


def _params(cases):
  return [pytest.param(c, id=c["name"]) for c in cases]


def _decoded_end(case: dict) -> int:
  B = case["config"]["block_length"]
  return (case["prompt_length"] // B) * B + case["num_blocks_decoded"] * B


@pytest.mark.parametrize("case", _params(CASES))
def test_reference_matches_every_forward(case):
  with jax.default_matmul_precision("highest"):
    params, cfg = model()
    ref = reference_generate(params, cfg, case["prompt_ids"], config(case))
  end = _decoded_end(case)
  assert ref.canvas[:end] == case["canvas"][:end]
  assert ref.nfe == case["nfe"]
  assert [ref.forward_block.count(k) for k in range(len(ref.blocks))] == case["nfe_per_block"]
  for got, want in zip(ref.writes, case["forwards"], strict=True):
    assert got["unmasked"] == [(u["pos"], u["token"]) for u in want["unmasked"]], want["forward"]
    assert got["edited"] == [(e["pos"], e["old"], e["new"]) for e in want["edited"]], want["forward"]


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("case", _params(CASES))
def test_engine_matches_canvas_nfe_and_last_writes(case, cache):
  """cache "dual" is LLaDA2's block-diffusion cache: one prefill forward more (counted, D1); every block ends on
  a forward that saw its final tokens, so no clean-K/V forward follows (docs/design.md, D13)."""
  with jax.default_matmul_precision("highest"):
    res = generate(model(), [case["prompt_ids"]], config(case, cache))
  P, eos = case["prompt_length"], case["config"]["eos_id"]
  end = _decoded_end(case)
  assert res.canvas[0][:end] == case["canvas"][:end] and set(res.canvas[0][end:]) <= {eos}
  prefill = 1 if cache == "dual" else 0
  assert res.nfe == case["nfe"] + prefill
  last = {}
  for f in case["forwards"]:
    for w in f["unmasked"] + f["edited"]:
      last[w["pos"]] = f["forward"] + prefill
  assert res.commit_step[0] == [last.get(P + j, -1) for j in range(len(res.commit_step[0]))]
  # What a user reads: the output cut before the first EOS (the trace keeps the EOS itself).
  out = case["output_ids"]
  assert res.tokens[0] == (out[:out.index(eos)] if eos in out else out)


def test_rows_in_a_batch_equal_rows_alone():
  """Three prompt slots decoded in one batch (their blocks and budgets run out of step) and each alone."""
  cases = [c for c in CASES if c["name"] in ("shared/S_b4_g12_p0", "shared/S_guard_b4_g12_g0")]
  prompts = [c["prompt_ids"] for c in cases] + [[7, 8, 9, 10, 11, 12, 13, 14]]
  g = config(cases[0], "dual")
  with jax.default_matmul_precision("highest"):
    both = generate(model(), prompts, g)
    for i, p in enumerate(prompts):
      alone = generate(model(), [p], g)
      assert (alone.canvas[0], alone.commit_step[0], alone.row_nfe[0]) == \
          (both.canvas[i], both.commit_step[i], both.row_nfe[i])
  assert both.canvas[0][:_decoded_end(cases[0])] == cases[0]["canvas"][:_decoded_end(cases[0])]


def test_presets_and_validation():
  dec = decoders.get("joint_threshold")
  assert dec.PRESETS == {"S": {"threshold": 0.5, "edit_threshold": 0.0}, "Q": {"threshold": 0.7, "edit_threshold": 0.5}}
  g = GenerationConfig(decoder="joint_threshold", max_post_steps=3, edit_threshold=1.5)
  assert decoders.from_config(g, vocab_size=8) == decoders.JointThresholdDecoder(max_post_steps=3)
  for bad, field in ((dict(max_post_steps=-1), "max_post_steps"), (dict(edit_threshold=-0.1), "edit_threshold"),
                     (dict(temperature=0.5), "temperature")):
    with pytest.raises(ValueError, match=field):
      GenerationConfig(decoder="joint_threshold", **bad)
  with pytest.raises(ValueError, match="only the joint_threshold decoder uses max_post_steps"):
    GenerationConfig(decoder="threshold", max_post_steps=3)
  # One program serves every threshold pair: the knobs are traced, the budget is the program's.
  a = decoders.get("joint_threshold").knobs_of(g)
  assert (float(a.threshold), float(a.edit_threshold)) == (np.float32(0.9), np.float32(1.5))
