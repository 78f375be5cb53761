"""KV cache data: keys and values of every layer, a plain pytree, stacked or one buffer per layer."""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """k, v: stacked [n_layers, B, S, K, H], or per layer: tuples of n_layers [B, S, K, H] buffers (the
  engine's layout: a cached forward writes a layer's fresh K/V into its own buffer in place, where a slice
  of a stacked array would be copied out first; transformer.forward(keep_cache=True)).
  Keys are stored after qk-norm and RoPE for every family (dense LLaDA upstream caches pre-RoPE keys and
  re-rotates them every call; storing rotated keys gives the same attention with absolute positions and
  saves that work)."""
  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]

  @classmethod
  def zeros(cls, n_layers: int, batch: int, length: int, n_kv: int, head_dim: int, dtype, *,
            per_layer: bool = False) -> "KVCache":
    if per_layer:
      shape = (batch, length, n_kv, head_dim)
      return cls(tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
                 tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)))
    shape = (n_layers, batch, length, n_kv, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  @property
  def per_layer(self) -> bool:
    return isinstance(self.k, (tuple, list))

  @property
  def length(self) -> int:
    return self.k[0].shape[1] if self.per_layer else self.k.shape[2]

  def stacked(self) -> "KVCache":
    """The [n_layers, B, S, K, H] form (a copy when per layer)."""
    return KVCache(jnp.stack(self.k), jnp.stack(self.v)) if self.per_layer else self


# The policies that decide which rows refresh, read and write this cache are engine/cache_policy.py.
def select_rows(rows: jax.Array, new: KVCache, old: KVCache) -> KVCache:
  """Per-row cache update: rows [B] bool picks `new` (a refresh, or a persisted block-diffusion step).
  Both caches in the same layout (stacked or per layer)."""
  def sel(n, o):
    m = rows.reshape((1,) * (o.ndim - 4) + (-1, 1, 1, 1))  # the batch axis is 4th from the end
    return jnp.where(m, n.astype(o.dtype), o)
  return jax.tree_util.tree_map(sel, new, old)
