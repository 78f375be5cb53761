"""8-bit checkpoints: hf2jax --quantize writes what quantise-on-load computes, bit for bit, and reads back as
QArrays; bad trees are one-line errors naming the leaf and both shapes."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from ckpt_testlib import MODELS, leftovers

import dinfer_jax
from dinfer_jax import checkpoint
from dinfer_jax.model import quant

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _qleaves(params):
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=quant.is_qarray)[0]
  return {jax.tree_util.keystr(p): x for p, x in flat}


@pytest.mark.parametrize("name,spec", [("llada_moe", "int8-channel"), ("llada2_moe", "fp8-block")])
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
  ids = np.arange(12).reshape(1, 12) % stored.config.vocab_size
  np.testing.assert_array_equal(np.asarray(dinfer_jax.forward(stored, ids)), np.asarray(dinfer_jax.forward(onload, ids)))
  # The 8-bit values are what is on disk: the matmul weights take about half the bf16 bytes.
  rows = checkpoint.inspect(tmp_path / "q")
  q_bytes = sum(int(np.prod(s)) for n, s, d in rows if n.endswith(".qvalue"))
  assert q_bytes > 0 and all(d == np.dtype(qc.qtype).name for n, s, d in rows if n.endswith(".qvalue"))


def test_quantised_tree_errors_name_the_leaf_and_shapes(tmp_path):
  m = dinfer_jax.load(MODELS["llada"], dtype="bfloat16", quantize="int8")
  raw = json.loads((pathlib.Path(MODELS["llada"]) / "config.json").read_text())
  store = quant.to_storage(m.params)
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


def test_cli_quantize_inspect_and_jax2hf_refusal(tmp_path):
  r = _run("hf2jax", MODELS["llada_moe"], tmp_path / "q", "--quantize", "fp8", "--scales", "block")
  assert r.returncode == 0, r.stderr
  assert "fp8 weights, block scales (128x128)" in r.stdout
  r = _run("inspect", tmp_path / "q")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("format: bfloat16, matmul weights fp8 weights, block scales")
  assert "moe_layers.experts.gate.qvalue  float8_e4m3fn" in r.stdout
  r = _run("jax2hf", tmp_path / "q", tmp_path / "h")
  assert r.returncode == 2 and "jax2hf writes bf16/fp16/fp32 checkpoints only" in r.stderr
  assert not (tmp_path / "h").exists()
  r = _run("hf2jax", MODELS["llada_moe"], tmp_path / "z", "--scales", "block")
  assert r.returncode == 2 and "--scales needs --quantize" in r.stderr
