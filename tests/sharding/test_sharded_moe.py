"""The ragged MoE on a tensor-parallel mesh (8 fake CPU devices): each device's expert-FFN columns under
shard_map, the partial outputs summed, equal the plain loop over experts; and the kernel choice that takes
it (a TPU slice split by tensor only, above the dense kernel's token count)."""
import jax
import numpy as np
import pytest

from dinfer_jax import make_mesh, sharding
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import moe
from tests.moe_case import random_moe


@pytest.mark.parametrize("layout", [dict(tensor=4), dict(data=2, tensor=4)])
def test_ragged_moe_split_by_tensor_matches_the_loop(layout):
  T, D, F, E, k = 24, 16, 32, 8, 2
  h, w, idx, ex = random_moe(T, D, F, E, k, seed=1)
  mesh = make_mesh(**layout)
  axes = {n: moe._EXPERT_AXES[n] for n in ex}
  ex_sharded = jax.device_put(ex, sharding.param_shardings(ex, axes, mesh))
  assert ex_sharded["gate"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
  with sharding.use_mesh(mesh), moe.partitioned(True):
    out = jax.jit(lambda *a: moe.experts_ragged(*a, E))(h, w, idx, ex_sharded)
  np.testing.assert_allclose(out, moe.moe_loop_reference(h, w, idx, ex, E), rtol=1e-5, atol=1e-5)


def test_a_tpu_slice_split_by_tensor_takes_the_ragged_kernel_above_the_dense_count():
  cfg = ModelConfig.llada_moe_7b_a1b()
  many, few = moe.ACCEL_DENSE_MAX_TOKENS + 1, moe.ACCEL_DENSE_MAX_TOKENS
  with moe.target_backend("tpu"), moe.partitioned(True):
    with sharding.use_mesh(make_mesh(tensor=4)):
      assert (moe.choose_impl(cfg, many), moe.choose_impl(cfg, few)) == ("ragged", "dense")
      assert moe.choose_impl(cfg, moe.SLICE_RAGGED_MAX_TOKENS + 1) == "dense"  # every chip runs every row
    with sharding.use_mesh(make_mesh(tensor=2, expert=2)):
      assert moe.choose_impl(cfg, many) == "dense"  # experts split across chips: the dense einsums
  with moe.target_backend("gpu"), moe.partitioned(True), sharding.use_mesh(make_mesh(tensor=4)):
    assert moe.choose_impl(cfg, many) == "dense"  # GPU meshes unchanged
