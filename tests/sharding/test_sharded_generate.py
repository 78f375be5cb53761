"""Sharded forward and generation on 8 fake CPU devices equal the single-device runs.

Meshes: 1; tensor 2; expert 4; tensor 2 x expert 4; data 2 x tensor 4; data 8. The forward's logits must
match to 1e-5 of their scale (fp32; tensor/expert parallelism only reorders sums), generation must give
identical tokens, commit steps and NFE (every decoder, the caches incl. dual + vicinity, smoothing,
sampling, block diffusion, token editing, a ragged batch that does not divide the data axis). The default run covers
every mesh and every case once (mesh i takes case i) and the forward on the three 8-device meshes; -m slow
runs the full 6 x 7 matrix and the forward on every mesh.
"""
import functools

import jax
import numpy as np
import pytest

import dinfer_jax
from dinfer_jax import GenerationConfig, make_mesh
from tests.engine.golden import GOLDEN, MODEL_DIRS

MESHES = {"1": {}, "t2": dict(tensor=2), "e4": dict(expert=4), "t2e4": dict(tensor=2, expert=4),
          "d2t4": dict(data=2, tensor=4), "d8": dict(data=8)}

RAGGED = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11]]  # 3 rows: no data axis divides it
BASE = dict(gen_length=16, block_length=8)
CASES = {
    "threshold_dual_vicinity": ("A", dict(decoder="threshold", threshold=0.85, cache="dual", prefix_look=4,
                                          after_look=4, warmup_steps=2)),
    "hierarchy_prefix_smoothing": ("A", dict(decoder="hierarchy", threshold=0.9, low_threshold=0.6,
                                             cache="prefix", cont_weight=0.3)),
    "credit_none_sampled": ("A", dict(decoder="credit", threshold=0.8, temperature=1.0)),
    "fixed_steps_dual": ("dense", dict(decoder="fixed_steps", steps_per_block=4, cache="dual")),
    "fastdllm_dual_vicinity_smoothing": ("dense", dict(decoder="fastdllm", threshold=0.9, cache="dual",
                                                       prefix_look=4, after_look=4, warmup_steps=1,
                                                       cont_weight=0.3)),
    "llada2_block_diffusion": ("llada2", dict(decoder="threshold", threshold=0.9, cache="dual")),
    # LLaDA2.1's token editing: blocks that end when they settle, committed tokens rewritten.
    "llada2_joint_threshold": ("llada2", dict(decoder="joint_threshold", threshold=0.5, edit_threshold=0.0,
                                              max_post_steps=4, cache="dual")),
}

_MESH_NAMES, _CASE_NAMES = list(MESHES), list(CASES)
# Mesh i takes case i; the cases past the meshes take the tensor x expert mesh.
DEFAULT = set(zip(_MESH_NAMES, _CASE_NAMES)) | {("t2e4", c) for c in _CASE_NAMES[len(_MESH_NAMES):]}
MATRIX = [pytest.param(m, c, marks=() if (m, c) in DEFAULT else pytest.mark.slow)
          for m in _MESH_NAMES for c in _CASE_NAMES]


def _need_8():
  if len(jax.devices()) < 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py sets it)")


@functools.cache
def _mesh(name):
  return make_mesh(**MESHES[name])


@functools.cache
def _model(model_name, mesh_name=None):
  return dinfer_jax.load(MODEL_DIRS[model_name], mesh=None if mesh_name is None else _mesh(mesh_name))


@functools.cache
def _reference(case):
  model_name, kw = CASES[case]
  return dinfer_jax.generate(_model(model_name), RAGGED, GenerationConfig(**BASE, **kw), seed=3)


@pytest.mark.parametrize("mesh_name,case", MATRIX)
def test_sharded_generate_equals_single_device(mesh_name, case):
  _need_8()
  model_name, kw = CASES[case]
  ref = _reference(case)
  model = _model(model_name, mesh_name)
  out = dinfer_jax.generate(model, RAGGED, GenerationConfig(**BASE, **kw), seed=3)
  assert out.canvas == ref.canvas
  assert out.tokens == ref.tokens
  assert out.commit_step == ref.commit_step
  assert (out.nfe, out.row_nfe, out.forward_counts) == (ref.nfe, ref.row_nfe, ref.forward_counts)


FORWARD_MODELS = ("tiny_llada_moe", "tiny_llada2_moe", "tiny_llada")


@functools.cache
def _forward_case(name):
  x = np.load(GOLDEN / "forward" / name / "input_ids.npy")
  x = np.concatenate([x, x[:, ::-1]], axis=0) if x.ndim == 2 else np.stack([x, x[::-1]])
  x = np.concatenate([x] * 4)  # 8 rows: every data axis divides them
  return x, np.asarray(dinfer_jax.forward(dinfer_jax.load(GOLDEN / "forward" / name), x))


@pytest.mark.parametrize("mesh_name", [m if m in ("t2e4", "d2t4", "d8") else pytest.param(m, marks=pytest.mark.slow)
                                       for m in _MESH_NAMES])
def test_sharded_forward_equals_single_device(mesh_name):
  _need_8()
  mesh = _mesh(mesh_name)
  for name in FORWARD_MODELS:
    x, ref = _forward_case(name)
    model = dinfer_jax.load(GOLDEN / "forward" / name, mesh=mesh)
    layers = model.params["moe_layers" if model.config.n_moe_layers else "dense_layers"]
    # The weights really are split as the rules table says (not silently replicated), per layer (the layout the
    # engine runs on, placed at load).
    assert isinstance(layers, list)
    if mesh.shape["tensor"] > 1:
      assert all(layer["q"].sharding.spec[1] == "tensor" for layer in layers)
    if model.config.n_moe_layers and mesh.shape["expert"] > 1:
      assert all(layer["experts"]["gate"].sharding.spec[0] == "expert" for layer in layers)
    out = dinfer_jax.forward(model, x)
    err = np.abs(np.asarray(out) - ref).max() / np.abs(ref).max()
    assert err <= 1e-5, (name, mesh_name, err)


@pytest.mark.slow
def test_quantised_weights_on_a_mesh():
  """8-bit weights (model/quant.py) split like the bf16 ones, their scales along the same axes: generation on
  tensor 2 x expert 4 equals the single-device run of the same quantised model."""
  _need_8()
  mesh = _mesh("t2e4")
  model_name, kw = CASES["threshold_dual_vicinity"]
  ref = dinfer_jax.generate(dinfer_jax.load(MODEL_DIRS[model_name], quantize="int8"), RAGGED,
                            GenerationConfig(**BASE, **kw), seed=3)
  model = dinfer_jax.load(MODEL_DIRS[model_name], quantize="int8", mesh=mesh)
  q = model.params["moe_layers"]["q"]
  assert q.qvalue.sharding.spec[2] == "tensor" and q.scale.sharding.spec[2] == "tensor"
  ex = model.params["moe_layers"]["experts"]["gate"]
  assert ex.qvalue.sharding.spec[1] == "expert" and ex.scale.sharding.spec[1] == "expert"
  out = dinfer_jax.generate(model, RAGGED, GenerationConfig(**BASE, **kw), seed=3)
  assert (out.canvas, out.commit_step, out.nfe) == (ref.canvas, ref.commit_step, ref.nfe)
