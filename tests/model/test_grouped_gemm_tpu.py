"""The TPU grouped GEMM (Pallas-Mosaic, model/grouped_gemm_tpu.py) in Pallas's interpreter on CPU: its work
items by hand, the matmul against XLA's ragged_dot, and the MoE through it against the plain loop."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.model import grouped_gemm_tpu as gt, moe, quant
from tests.moe_case import random_moe


def test_work_items_by_hand():
  """Rows of 3 groups (5, 0, 7 rows) in tiles of 4: group 0 spans tiles 0-1, group 2 tiles 1-2; the empty
  group has none. 3 tiles + 3 groups - 1 = 5 items, the last repeating the fourth and not real."""
  group, tile, real, starts = gt.work_items(jnp.array([5, 0, 7], jnp.int32), 12, 4)
  assert group.tolist() == [0, 0, 2, 2, 2]
  assert tile.tolist() == [0, 1, 1, 2, 2]
  assert real.tolist() == [1, 1, 1, 1, 0]
  assert starts.tolist() == [0, 5, 5]


@pytest.mark.parametrize("M,K,N,G,bm", [(300, 256, 256, 5, 128), (40, 128, 128, 64, 128), (1000, 768, 384, 16, 256)])
def test_gmm_matches_ragged_dot(M, K, N, G, bm):
  rng = np.random.default_rng(M)
  sizes = rng.multinomial(M, rng.dirichlet(np.full(G, 0.5))).astype(np.int32)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((G, K, N)), jnp.float32)
  out = gt.gmm(x, w, jnp.asarray(sizes), block_m=bm, interpret=True)
  np.testing.assert_allclose(out, jax.lax.ragged_dot(x, w, jnp.asarray(sizes)), rtol=1e-5, atol=1e-4)


def test_rows_past_every_group_are_zero_and_shapes_are_checked():
  x = jnp.ones((10, 128), jnp.float32)
  w = jnp.ones((2, 128, 128), jnp.float32)
  out = gt.gmm(x, w, jnp.array([3, 4], jnp.int32), interpret=True)
  assert float(jnp.abs(out[7:]).max()) == 0.0 and float(out[0, 0]) == 128.0
  with pytest.raises(ValueError, match="multiples of 128"):
    gt.gmm(jnp.ones((4, 192)), jnp.ones((2, 192, 128)), jnp.array([2, 2]), interpret=True)
  with pytest.raises(ValueError, match=r"expected x \[M, K\]"):
    gt.gmm(jnp.ones((4, 128)), jnp.ones((2, 256, 128)), jnp.array([2, 2]), interpret=True)


def test_block_m_follows_the_rows_per_expert():
  assert gt.block_m_for(768, 64) == 128  # 12 rows per expert: the smallest tile
  assert gt.block_m_for(10240, 64) == 256  # batch-1 refresh, 160 per expert
  assert gt.block_m_for(81920, 64) == 1024  # batch-8 refresh, 1280 per expert: the largest


def test_moe_through_the_tpu_kernel_matches_the_loop_reference():
  """The ragged MoE (sort by expert, gate/up/down grouped) with the Mosaic kernel as its grouped matmul, in
  fp32, against a Python loop over experts; and the kernel declines 8-bit weights (they go to ragged_dot)."""
  T, D, F, E, k = 48, 128, 256, 8, 2
  h, w, idx, ex = random_moe(T, D, F, E, k, seed=0)
  dot = functools.partial(gt.gmm, block_m=32, interpret=True)
  out = moe.experts_ragged(h, w, idx, ex, E, dot=dot)
  np.testing.assert_allclose(out, moe.moe_loop_reference(h, w, idx, ex, E), rtol=1e-5, atol=1e-4)
  q = quant.quantize_leaf(("layers", "experts", "gate"), ex["gate"], quant.QuantConfig.parse("int8"))
  assert quant.is_qarray(q) and not gt.supports(h, q)
  assert gt.supports(h, ex["gate"]) and not gt.supports(h[:, :64], ex["gate"][:, :64])
