"""Bidirectional grouped-query attention over a (possibly cached) key set.

`attention` is the fast path (jax.nn.dot_product_attention: cuDNN's fused kernel on GPU, so the fp32
[B, N, T, S] scores are never written to memory; on a TPU, for many query rows and a per-key mask, Pallas's
splash attention kernel; XLA's implementation elsewhere); `attention_reference` is the plain einsum version
the tests compare it with.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from dinfer_jax import sharding
from dinfer_jax.model import moe

# Query rows (batch x length) from which a TPU takes the splash kernel. Compiled deviceless for a v6e (16 heads
# of 128 against 1280 keys, bf16; bench/realistic.py per layer): batch 1 x 96 queries 12.9 us XLA, 15.5
# splash (XLA keeps the scores on the chip: bytes at the floor); batch 8 x 96: 280 against 73 us; 1 x 1280
# (the refresh): 170 against 22 us (XLA writes the fp32 scores to HBM, 231 MB against a 21 MB floor).
SPLASH_MIN_ROWS = 128

# Finite, so a query whose keys are all masked (a padding row) gets a uniform softmax instead of NaN.
_MASKED = -1e30


def mask_bias(mask: jax.Array | None, T: int) -> jax.Array | None:
  """mask [B, S] (key validity) or [B, T, S] (per query), True = may attend -> additive fp32 bias
  broadcastable to the scores [B, K, G, T, S]."""
  if mask is None:
    return None
  if mask.ndim == 2:
    mask = mask[:, None, :]
  return jnp.where(mask, 0.0, _MASKED).astype(jnp.float32)[:, None, None, :, :]


def attention_mask(mask: jax.Array | None, T: int) -> jax.Array | None:
  """mask [B, S] or [B, T, S] (True = may attend) -> bool [B, 1, T, S] for dot_product_attention (cuDNN
  wants the query length spelled out)."""
  if mask is None:
    return None
  if mask.ndim == 2:
    mask = jnp.broadcast_to(mask[:, None, :], (mask.shape[0], T, mask.shape[1]))
  return mask[:, None]


def _blocks(n: int, most: int) -> int | None:
  """The largest tile of at most `most` that divides n: n itself when small, else a multiple of 128."""
  if n <= most and n % 8 == 0:
    return n
  return next((b for b in (512, 256, 128) if b <= most and n % b == 0), None)


def splash_fits(q: jax.Array, k: jax.Array, keys_valid: jax.Array | None) -> bool:
  """Whether a TPU takes the splash kernel: a per-key mask, one kv head per query head, tileable lengths and
  at least SPLASH_MIN_ROWS query rows."""
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  return (moe.backend() == "tpu" and keys_valid is not None and N == K and B * T >= SPLASH_MIN_ROWS
          and _blocks(T, 512) is not None and _blocks(S, 512) is not None and S % 128 == 0)


@functools.lru_cache(maxsize=None)
def _splash_kernel(T: int, S: int, N: int, interpret: bool):
  bq, bkv = _blocks(T, 512), _blocks(S, 512)
  sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                            block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
  mask = splash.MultiHeadMask([splash.FullMask((T, S)) for _ in range(N)])
  return splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, keys_valid: jax.Array, *,
                     interpret: bool = False) -> jax.Array:
  """q [B, T, N, H], k/v [B, S, N, H], keys_valid bool [B, S] -> [B, T, N, H] through Pallas's TPU splash
  kernel: the key mask as segment ids (every query in segment 1, a valid key in 1, the rest in 0), the
  1/sqrt(H) scale on q. Traced for a mesh (moe.partitioned) it runs per chip under shard_map on its heads."""
  mesh = sharding.current_mesh()
  if moe.partitioned_now() and mesh is not None and mesh.size > 1:
    heads = sharding.spec_for(("act_batch", "act_len", "q_heads", "head_dim"), mesh, q.shape)
    keys = sharding.spec_for(("act_batch", "act_len"), mesh, keys_valid.shape)
    local = functools.partial(splash_attention, interpret=interpret)
    with sharding.use_mesh(None):
      return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, keys), out_specs=heads,
                           check_vma=False)(q, k, v, keys_valid)  # a Pallas call declares no varying axes
  B, T, N, H = q.shape
  kernel = _splash_kernel(T, k.shape[1], N, interpret)
  qs = (q * jnp.asarray(H ** -0.5, q.dtype)).transpose(0, 2, 1, 3)

  def one(q1, k1, v1, valid1):
    return kernel(q1, k1, v1, segment_ids=splash.SegmentIds(q=jnp.ones((T,), jnp.int32), kv=valid1.astype(jnp.int32)))
  o = jax.vmap(one)(qs, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), keys_valid)
  return o.transpose(0, 2, 1, 3).astype(q.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
              keys_valid: jax.Array | None = None) -> jax.Array:
  """q [B, T, N, H], k/v [B, S, K, H], mask bool [B, 1, T, S] (attention_mask) -> [B, T, N, H]. keys_valid:
  the same mask as [B, S] where it is one per key (lets a TPU take the splash kernel: splash_fits).

  Same numerics as attention_reference: fp32 scores and softmax, the value product in the activation dtype
  with fp32 accumulation; a query with every key masked gets a uniform softmax (finite mask value)."""
  if splash_fits(q, k, keys_valid):
    return splash_attention(q, k, v, keys_valid)
  # cuDNN's fused kernel takes fp16/bf16 only: fp32 models (tests of numerics, fp32 training) on a GPU use
  # XLA's implementation instead of failing. DINFER_JAX_ATTENTION=xla asks for XLA's on a GPU too (the GPU
  # check's safe items run before the fused kernels are tried), read when a program is traced.
  fused = (moe.backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
           and os.environ.get("DINFER_JAX_ATTENTION", "auto") != "xla")
  impl = "cudnn" if fused else None
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl).astype(q.dtype)


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None) -> jax.Array:
  """q [B, T, N, H], k/v [B, S, K, H] -> [B, T, N, H]. kv head g serves q heads g*G .. g*G+G-1.

  Scores and softmax in fp32; the value product back in the activation dtype with fp32 accumulation.
  """
  B, T, N, H = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, N // K, H)
  s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * (H ** -0.5)
  if bias is not None:
    s = s + bias
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o.astype(q.dtype).reshape(B, T, N, H)
