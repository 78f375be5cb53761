"""Tensor + expert parallel on 8 fake CPU devices gives the single-device logits."""
import pathlib

import jax
import numpy as np
import pytest

import dinfer_jax
from dinfer_jax.sharding import make_mesh

GOLD = pathlib.Path(__file__).parent.parent / "golden" / "forward"


@pytest.mark.parametrize("name,tensor,expert", [("tiny_llada_moe", 2, 4), ("tiny_llada2_moe", 2, 4),
                                                ("tiny_llada", 4, 2)])
def test_sharded_forward_equals_single_device(name, tensor, expert):
  if len(jax.devices()) < 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py sets it)")
  x = np.load(GOLD / name / "input_ids.npy")
  ref = dinfer_jax.forward(dinfer_jax.load(GOLD / name), x)
  mesh = make_mesh(tensor=tensor, expert=expert)
  model = dinfer_jax.load(GOLD / name, mesh=mesh)
  if model.config.n_moe_layers:
    gate = model.params["moe_layers"]["experts"]["gate"]
    assert gate.sharding.spec[1] == "expert"  # experts really are split across devices
  q = model.params[("moe_layers" if model.config.n_moe_layers else "dense_layers")]["q"]
  assert q.sharding.spec[2] == "tensor"
  out = dinfer_jax.forward(model, x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4)
