"""Small pure building blocks: RMSNorm, rotary embedding, SwiGLU."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dinfer_jax.model import quant


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """Normalises over the last axis. Statistics in fp32 (bf16 mean-of-squares loses digits), then cast back
  to x's dtype before the weight multiply, as the reference models do."""
  return w.astype(x.dtype) * rms_normalize(x, eps)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """rms_norm before its weight, in x's dtype (a kernel that applies the weight as it loads takes this)."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, *, theta: float, rot_dim: int) -> jax.Array:
  """Half-split ("rotate_half", NeoX) RoPE on the first rot_dim dims of each head.

  Args:
    x: [B, T, n, H] queries or keys.
    positions: [B, T] absolute positions (each row keeps its own when prompts are padded).
  Dims i and i + rot_dim/2 rotate together; dims past rot_dim pass through (LLaDA2's partial RoPE).
  The angles are computed in fp32 and the rotation done in fp32: positions up to 8k times the largest
  frequency would lose the low bits in bf16.
  """
  half = rot_dim // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / rot_dim)  # [rot/2]
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rot/2]
  cos = jnp.cos(ang)[:, :, None, :]
  sin = jnp.sin(ang)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2, rest = xf[..., :half], xf[..., half:rot_dim], xf[..., rot_dim:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
  return out.astype(x.dtype)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
  """down(silu(x @ gate) * (x @ up)) for kernels gate/up [D, F], down [F, D] (plain or quantised); x [..., D]."""
  g = quant.einsum("...D,DF->...F", x, gate)
  u = quant.einsum("...D,DF->...F", x, up)
  return quant.einsum("...F,FD->...D", jax.nn.silu(g) * u, down)


def slice_rows(a: jax.Array, start: jax.Array | int, size: int, axis: int = 1) -> jax.Array:
  """a[:, start:start + size] along `axis` (>= 1; axis 0 is the batch): `start` a scalar (one dynamic
  slice, the offline engine's shared block grid) or [B], one start per row (continuous batching, where
  every row is at its own block)."""
  if jnp.ndim(start) == 0:
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=axis)
  return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, size, axis=axis - 1))(a, start)


def update_rows(a: jax.Array, update: jax.Array, start: jax.Array | int, axis: int = 1) -> jax.Array:
  """a with update written at [start, start + update.shape[axis]) along `axis`; start as in slice_rows."""
  if jnp.ndim(start) == 0:
    return jax.lax.dynamic_update_slice_in_dim(a, update, start, axis=axis)
  return jax.vmap(lambda r, u, s: jax.lax.dynamic_update_slice_in_dim(r, u, s, axis=axis - 1))(a, update, start)


def write_rows(a: jax.Array, update: jax.Array, start: jax.Array | int, where: jax.Array) -> jax.Array:
  """a [B, S, ...] with update [B, T, ...] written at [start, start + T) along axis 1 only where `where`
  [B, T] (start a scalar or [B]). A scatter that drops the masked slots: the slots it keeps are never read,
  so XLA can write a buffer in place (a select against the old slots reads the buffer it writes and
  copies it)."""
  B, T = where.shape
  S = a.shape[1]
  cols = jnp.reshape(start, (-1, 1)) + jnp.arange(T)[None, :]
  cols = jnp.where(where, cols, S)  # out of bounds: dropped
  return a.at[jnp.arange(B)[:, None], cols].set(update, mode="drop")
