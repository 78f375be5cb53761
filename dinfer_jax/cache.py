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


# ----------------------------------------------------------------------------- cache manager
# dInfer's DiffusionKVCacheManager as a per-row policy. Each loop iteration every active row takes one
# of these forwards; rows of different kinds in the same iteration share the batched forward of their kind.
FULL = 1  # full canvas forward, no cache read or write (cache "none", vicinity warm-up)
REFRESH = 2  # full canvas forward whose K/V replace the row's cache (block entry)
CACHED = 3  # window forward reading the cache (prefix / dual / vicinity; block diffusion steps)


def row_phase(*, cache_mode: str, vicinity_warmup: int, n: jax.Array, refreshed: jax.Array) -> jax.Array:
  """Which forward each row takes this iteration. n [B] the row's forwards so far; refreshed [B] whether
  its cache was refreshed since the current block started.

  As in dInfer, a block's first iteration is the refresh forward (its block logits decode) and then one
  cached step; unlike dInfer, there is exactly one refresh per block entry (no double refresh when block 0
  finishes during the vicinity warm-up).
  """
  if cache_mode == "none":
    return jnp.full(n.shape, FULL, jnp.int32)
  if cache_mode == "block_diffusion":
    return jnp.full(n.shape, CACHED, jnp.int32)
  phase = jnp.where(refreshed, CACHED, REFRESH)
  if vicinity_warmup:
    phase = jnp.where(n < vicinity_warmup, FULL, phase)
  return phase.astype(jnp.int32)


def select_rows(rows: jax.Array, new: KVCache, old: KVCache) -> KVCache:
  """Per-row cache update: rows [B] bool picks `new` (a refresh, or a persisted block-diffusion step).
  Both caches in the same layout (stacked or per layer)."""
  def sel(n, o):
    m = rows.reshape((1,) * (o.ndim - 4) + (-1, 1, 1, 1))  # the batch axis is 4th from the end
    return jnp.where(m, n.astype(o.dtype), o)
  return jax.tree_util.tree_map(sel, new, old)
