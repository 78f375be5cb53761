"""Bidirectional grouped-query attention over a (possibly cached) key set.

`attention` is the fast path (jax.nn.dot_product_attention: cuDNN's fused kernel on GPU, so the fp32
[B, N, T, S] scores are never written to memory; XLA's implementation elsewhere); `attention_reference` is
the plain einsum version the tests compare it with.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from dinfer_jax.model import moe

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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> jax.Array:
  """q [B, T, N, H], k/v [B, S, K, H], mask bool [B, 1, T, S] (attention_mask) -> [B, T, N, H].

  Same numerics as attention_reference: fp32 scores and softmax, the value product in the activation dtype
  with fp32 accumulation; a query with every key masked gets a uniform softmax (finite mask value)."""
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
