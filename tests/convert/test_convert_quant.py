"""8-bit checkpoints: hf2jax --quantize writes what quantise-on-load computes, bit for bit, and reads back as
QArrays; bad trees are one-line errors naming the leaf and both shapes."""
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from ckpt_testlib import MODELS, leftovers

import dinfer_jax
from dinfer_jax import checkpoint
from dinfer_jax.model import params as params_lib
from dinfer_jax.model import quant

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _qleaves(params):
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=quant.is_qarray)[0]
  return {jax.tree_util.keystr(p): x for p, x in flat}


@pytest.mark.parametrize("name,spec", [("llada_moe", "int8-channel"),
                                       pytest.param("llada2_moe", "fp8-block", marks=pytest.mark.slow)])
def test_hf2jax_quantize_matches_quantise_on_load_bit_exact(tmp_path, name, spec):
  qc = quant.QuantConfig.parse(spec)
  qc = quant.QuantConfig(qc.weights, qc.scales, block=16)  # the tiny models' D is 64: several blocks each
  s = checkpoint.hf2jax(MODELS[name], tmp_path / "q", "bfloat16", quantize=qc)
  assert s["quantization"].startswith(qc.weights)
  meta = json.loads((tmp_path / "q" / "dinfer_jax.json").read_text())
  assert meta["quantization"] == qc.to_dict() and meta["dtype"] == "bfloat16"
  stored = dinfer_jax.load(tmp_path / "q", dtype="bfloat16")
  onload = dinfer_jax.load(MODELS[name], dtype="bfloat16", quantize=qc)
  a, b = _qleaves(stored.params), _qleaves(onload.params)
  assert a.keys() == b.keys()
  n_q = 0
  for k in a:
    assert quant.is_qarray(a[k]) == quant.is_qarray(b[k]), k
    if quant.is_qarray(a[k]):
      n_q += 1
      assert a[k].qvalue.dtype == qc.qtype and a[k].scale.dtype == np.float32
      np.testing.assert_array_equal(np.asarray(a[k].qvalue).view(np.uint8), np.asarray(b[k].qvalue).view(np.uint8))
      np.testing.assert_array_equal(np.asarray(a[k].scale), np.asarray(b[k].scale))
    else:
      np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
  assert n_q > 0
  # Asking for the format the checkpoint already has keeps it as stored (no requantisation).
  again = _qleaves(dinfer_jax.load(tmp_path / "q", dtype="bfloat16", quantize=qc).params)
  for k in a:
    if quant.is_qarray(a[k]):
      # (a requantisation would not reproduce them: absmax of 127 or 128 steps over qwix's 127.5)
      np.testing.assert_array_equal(np.asarray(again[k].scale), np.asarray(a[k].scale))
  ids = np.arange(12).reshape(1, 12) % stored.config.vocab_size
  np.testing.assert_array_equal(np.asarray(dinfer_jax.forward(stored, ids)), np.asarray(dinfer_jax.forward(onload, ids)))
  # The 8-bit values are what is on disk: the matmul weights take about half the bf16 bytes.
  rows = checkpoint.inspect(tmp_path / "q")
  q_bytes = sum(int(np.prod(s)) for n, s, d in rows if n.endswith(".qvalue"))
  assert q_bytes > 0 and all(d == np.dtype(qc.qtype).name for n, s, d in rows if n.endswith(".qvalue"))


def test_quantised_tree_errors_name_the_leaf_and_shapes(tmp_path):
  m = dinfer_jax.load(MODELS["llada"], dtype="bfloat16", quantize="int8")
  raw = json.loads((pathlib.Path(MODELS["llada"]) / "config.json").read_text())
  store = quant.to_storage(params_lib.stack_layers(m.params))
  bad = jax.tree_util.tree_map(lambda x: x, store)
  good_scale = bad["dense_layers"]["q"]["scale"]
  bad["dense_layers"]["q"]["scale"] = good_scale[..., :1]
  with pytest.raises(checkpoint.CheckpointError, match=r"leaf dense_layers\.q\.scale has shape .*, expected "
                     + str(tuple(good_scale.shape)).replace("(", r"\(").replace(")", r"\)")):
    checkpoint.save_converted(tmp_path / "x", bad, raw, quantization=quant.QuantConfig().to_dict())
  del bad["dense_layers"]["q"]["scale"]
  with pytest.raises(checkpoint.CheckpointError, match=r"missing leaf dense_layers\.q\.scale"):
    checkpoint.save_converted(tmp_path / "x", bad, raw, quantization=quant.QuantConfig().to_dict())
  assert leftovers(tmp_path, "x") == []
  # QArrays are accepted as they are, and an unsupported dtype in the metadata is named.
  checkpoint.save_converted(tmp_path / "ok", m.params, raw, quantization=quant.QuantConfig().to_dict())
  meta = json.loads((tmp_path / "ok" / "dinfer_jax.json").read_text())
  meta["quantization"]["weights"] = "int4"
  (tmp_path / "ok" / "dinfer_jax.json").write_text(json.dumps(meta))
  with pytest.raises(checkpoint.CheckpointError, match=r"dinfer_jax.json: bad quantization .*int4"):
    dinfer_jax.load(tmp_path / "ok")


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "convert", *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=180)


@pytest.mark.slow  # three CLI subprocesses; the same paths run in-process in the default run
def test_cli_quantize_inspect_and_jax2hf_refusal(tmp_path):
  r = _run("hf2jax", MODELS["llada_moe"], tmp_path / "q", "--quantize", "fp8", "--scales", "block")
  assert r.returncode == 0, r.stderr
  assert "fp8 weights, block scales (128x128)" in r.stdout
  r = _run("inspect", tmp_path / "q")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("format: bfloat16, matmul weights fp8 weights, block scales")
  assert re.search(r"moe_layers.experts.gate.qvalue\s+float8_e4m3fn", r.stdout)
  # FP8 with block scales has an HF layout: weights in float8_e4m3fn, each with its weight_scale_inv grid.
  r = _run("jax2hf", tmp_path / "q", tmp_path / "h")
  assert r.returncode == 0, r.stderr
  r = _run("inspect", tmp_path / "h")
  key = "model.layers.0.mlp.experts.0.gate_proj.weight"
  assert re.search(rf"{key}\s+float8_e4m3fn", r.stdout) and re.search(rf"{key}_scale_inv\s+float32\s+\[1, 1\]",
                                                                       r.stdout), r.stdout
  assert re.search(r"lm_head.weight\s+bfloat16", r.stdout)
  r = _run("hf2jax", MODELS["llada_moe"], tmp_path / "z", "--scales", "block")
  assert r.returncode == 2 and "--scales needs --quantize" in r.stderr


def test_jax2hf_refuses_a_layout_hf_does_not_have(tmp_path):
  checkpoint.hf2jax(MODELS["llada"], tmp_path / "q", quantize="int8")
  with pytest.raises(checkpoint.CheckpointError, match=r"holds int8 weights, channel scales; HF checkpoints have "
                     "an 8-bit layout for FP8 with block scales only"):
    checkpoint.jax2hf(tmp_path / "q", tmp_path / "h")
  assert not (tmp_path / "h").exists()


# ----------------------------------------------------------------------------- HF FP8 checkpoints
def _fp8_hf(directory, name="llada_moe", block=16, drop_scale=None, bad_scale=None):
  """The golden HF model as a DeepSeek-style FP8 checkpoint: every *_proj weight float8_e4m3fn with a
  [out/block, in/block] fp32 weight_scale_inv; also returns the dequantised weights (fp32) it stands for."""
  import ml_dtypes
  from ckpt_testlib import arrays, write_hf
  src = pathlib.Path(MODELS[name])
  cfg = json.loads((src / "config.json").read_text())
  cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [block, block]}
  fp8, deq = {}, {}
  for k, x in arrays(src).items():
    if not k.endswith("proj.weight"):
      fp8[k] = x
      deq[k] = x.astype(np.float32)
      continue
    w = x.astype(np.float32)
    o, i = w.shape
    blocks = np.abs(w).reshape(o // block, block, i // block, block).max(axis=(1, 3))
    s = (blocks / 448.0).astype(np.float32)
    rep = np.repeat(np.repeat(s, block, 0), block, 1)
    q = (w / rep).astype(ml_dtypes.float8_e4m3fn)
    fp8[k], fp8[k + "_scale_inv"] = q, s
    deq[k] = q.astype(np.float32) * rep
  if drop_scale:
    del fp8[drop_scale + "_scale_inv"]
  if bad_scale:
    fp8[bad_scale + "_scale_inv"] = fp8[bad_scale + "_scale_inv"][:, :1]
  write_hf(directory / "fp8", fp8, cfg)
  write_hf(directory / "deq", deq, {k: v for k, v in cfg.items() if k != "quantization_config"})
  for f in ("tokenizer.json", "tokenizer_config.json"):
    if (src / f).exists():
      (directory / "fp8" / f).write_bytes((src / f).read_bytes())
  return directory / "fp8", directory / "deq"


def test_hf_fp8_loads_as_stored_and_round_trips_bit_exact(tmp_path):
  from ckpt_testlib import raw_tensors
  fp8, deq = _fp8_hf(tmp_path)
  m = dinfer_jax.load(fp8, dtype="float32")
  ref = dinfer_jax.load(deq, dtype="float32")
  q = params_lib.stack_layers(m.params)["moe_layers"]["experts"]["gate"]
  assert quant.is_qarray(q) and q.qvalue.dtype == quant.SCHEMES["fp8"] and q.scale.shape[-2:] == (64 // 16, 32 // 16)
  a, b = _qleaves(quant.dequantize_params(m.params)), _qleaves(ref.params)
  for k in b:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
  # quantize="fp8" requantises the block-scaled weights per channel (the fast GEMM path).
  ch = params_lib.stack_layers(dinfer_jax.load(fp8, dtype="float32", quantize="fp8").params)["moe_layers"]["experts"]["gate"]
  assert ch.qvalue.dtype == quant.SCHEMES["fp8"] and ch.scale.shape == q.shape[:-2] + (1, q.shape[-1])
  err = np.abs(np.asarray(quant.dequantize(ch)) - np.asarray(quant.dequantize(q))).max()
  assert 0 < err <= np.abs(np.asarray(quant.dequantize(q))).max() * 2 ** -3
  # hf2jax keeps the FP8 values and scales as they are; jax2hf writes the same tensors back.
  s = checkpoint.hf2jax(fp8, tmp_path / "j")
  assert s["quantization"] == "fp8 weights, block scales (16x16)"
  checkpoint.jax2hf(tmp_path / "j", tmp_path / "back")
  assert raw_tensors(tmp_path / "back") == raw_tensors(fp8)
  assert json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 16]


def test_hf_fp8_errors(tmp_path):
  key = "model.layers.0.self_attn.q_proj.weight"
  fp8, _ = _fp8_hf(tmp_path / "a", drop_scale=key)
  with pytest.raises(checkpoint.CheckpointError, match=rf"tensor '{key}' .* is float8_e4m3fn but "
                     rf"'{key}_scale_inv' is missing"):
    dinfer_jax.load(fp8)
  fp8, _ = _fp8_hf(tmp_path / "b", bad_scale=key)
  with pytest.raises(checkpoint.CheckpointError, match=rf"scale '{key}_scale_inv' .* has shape \(4, 1\), "
                     rf"expected \(4, 4\) for weight '{key}' \(64, 64\) in 16x16 blocks"):
    checkpoint.hf2jax(fp8, tmp_path / "b" / "out")
  assert leftovers(tmp_path / "b", "out") == []
  fp8, _ = _fp8_hf(tmp_path / "c")
  with pytest.raises(checkpoint.CheckpointError, match="already FP8 with 16x16 block scales"):
    checkpoint.hf2jax(fp8, tmp_path / "c" / "out", quantize="int8")


@pytest.mark.parametrize("spec", ["fp8+a8", "int8+embed"])
def test_hf2jax_refuses_load_time_options(tmp_path, spec):
  """8-bit activations and the 8-bit embedding table are chosen on load: conversion names them and writes
  nothing."""
  with pytest.raises(checkpoint.CheckpointError, match=r"\+a8.*\+embed.*chosen when a model is loaded"):
    checkpoint.hf2jax(MODELS["llada_moe"], tmp_path / "q", "bfloat16", quantize=spec)
  assert not (tmp_path / "q").exists()
