"""The TPU attention kernel (Pallas's splash attention, model/attention.py) in Pallas's interpreter on CPU:
key-validity masks as segment ids against the plain einsum attention, and when a TPU takes it."""
import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.model import attention as att, moe


def test_splash_matches_the_reference_with_a_key_mask():
  """fp32, 2 rows x 16 queries x 2 heads over 256 keys; row 0 has its last 100 keys invalid, row 1 every key
  (a padding row: a uniform softmax in both)."""
  B, T, N, S, H = 2, 16, 2, 256, 128
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, N, H), (B, S, N, H), (B, S, N, H)))
  valid = jnp.asarray(np.stack([np.arange(S) < S - 100, np.zeros(S, bool)]))
  out = att.splash_attention(q, k, v, valid, interpret=True)
  ref = att.attention_reference(q, k, v, att.mask_bias(valid, T))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[1], jnp.broadcast_to(v[1].mean(axis=0), (T, N, H)), rtol=1e-5, atol=1e-5)


def test_a_tpu_takes_splash_for_many_query_rows_and_a_key_mask():
  q = jax.ShapeDtypeStruct((1, 96, 16, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1280, 16, 128), jnp.bfloat16)
  valid = jax.ShapeDtypeStruct((1, 1280), jnp.bool_)
  q8 = jax.ShapeDtypeStruct((8, 96, 16, 128), jnp.bfloat16)
  with moe.target_backend("tpu"):
    assert not att.splash_fits(q, k, valid)  # 96 query rows: XLA's keeps the scores on the chip
    assert att.splash_fits(q8, k, valid)
    assert not att.splash_fits(q8, k, None)  # a per-query mask
    assert not att.splash_fits(q8, jax.ShapeDtypeStruct((1, 1280, 4, 128), jnp.bfloat16), valid)  # grouped kv heads
  with moe.target_backend("gpu"):
    assert not att.splash_fits(q8, k, valid)
