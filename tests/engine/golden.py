"""Shared helpers of the engine tests: the tiny golden models in fp32, golden traces, config mapping."""
from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp

from dinfer_jax.checkpoint import load_hf_params, read_hf_config
from dinfer_jax.engine.config import GenerationConfig

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
DECODE = GOLDEN / "decode"
MODEL_DIRS = {
    "A": DECODE / "A",  # tiny LLaDA-MoE
    "dense": DECODE / "dense",  # tiny dense LLaDA
    "llada2": GOLDEN / "forward" / "tiny_llada2_moe",  # tiny LLaDA2-MoE
}

# dInfer's double refresh, which the engine deliberately does not copy (docs/design.md, D7).
DOUBLE_REFRESH = ("A/e_thr0.8_dual_vicinity4-4-2/p1", "A/h2_itersmooth0.3_thr0.9_dual_vicinity4-4-2/p0")


@functools.cache
def load_model(name: str):
  """(params, ModelConfig) of a golden model, weights widened to fp32 (the traces ran in fp32)."""
  cfg, _ = read_hf_config(MODEL_DIRS[name])
  params = load_hf_params(MODEL_DIRS[name], cfg, "float32")
  return jax.tree_util.tree_map(jnp.asarray, params), cfg


@functools.cache
def load_traces(set_name: str) -> dict:
  return json.loads((DECODE / set_name / "traces.json").read_text())


def golden_cases(set_name: str) -> list[dict]:
  """The traces to compare exactly: everything but the unrolled x* extras and the double refreshes."""
  return [c for c in load_traces(set_name)["cases"]
          if not c["config_name"].startswith("x") and c["name"] not in DOUBLE_REFRESH]


def trace_config(case: dict) -> GenerationConfig:
  """A golden case's dInfer knobs as a GenerationConfig."""
  c = case["config"]
  decoder = {"ThresholdParallelDecoder": "threshold", "HierarchyDecoder": "hierarchy",
             "CreditThresholdParallelDecoder": "credit"}[c["decoder"]]
  kw = dict(gen_length=c["gen_length"], block_length=c["block_length"], decoder=decoder,
            threshold=c["threshold"], cache=c["cache"] or "none", prefix_look=c["prefix_look"] or 0,
            after_look=c["after_look"] or 0, warmup_steps=c["warmup_steps"] or 0,
            cont_weight=c["cont_weight"] or 0.0, temperature=c["temperature"], early_stop=c["early_stop"],
            start_block_align=c["start_block_align"], mask_id=c["mask_id"], eos_id=c["eos_id"],
            dinfer_compat=True)  # dInfer's exact forward sequence, the forwards that commit nothing included
  if decoder == "hierarchy":
    kw["low_threshold"] = c["low_threshold"]
  if decoder == "credit":
    kw.update(credit_alpha=c["credit_alpha"], credit_gamma=c["boost_gamma"], credit_beta=c["decay_beta"])
  assert c["maximum_unroll"] == 1 and c["cache_update_freq"] is None and not c["use_shift"]
  if c["cont_weight"]:
    assert (c["cont_weight_init"], c["cont_weight_growth"], c["threshold_decay"]) == (0.15, 0.02, 0.02)
  return GenerationConfig(**kw)
