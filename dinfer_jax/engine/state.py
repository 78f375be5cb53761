"""The denoising loop's state: named pytrees whose fields declare their logical axes where they are defined.

GenState is the block loop's carry (one generation: canvas, commit steps, per-row forward counts, the KV
cache, smoothing's embeddings); BlockCarry is the step loop's carry inside one block (the GenState plus the
decoder's per-row state and the block's bookkeeping). `constrain` pins every field to its axes (batch rows on
"data", the cache's kv heads on "tensor"), so GSPMD keeps the state split the same way in every iteration; it
is a no-op without a mesh.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from dinfer_jax.cache import KVCache
from dinfer_jax.sharding import CACHE_AXES, CANVAS_AXES, EMBED_AXES, ROW_AXES, shard, shard_rows

# How a field is constrained (its metadata "axes"): a tuple of logical axes; ROWS (every leaf's leading axis is
# the batch: per-row vectors and the decoder's per-row state; scalars stay as they are); CACHE (each K/V buffer
# [..., B, S, K, H] on CACHE_AXES); NESTED (a struct of its own); REPLICATED (counters shared by all rows).
ROWS, CACHE, NESTED, REPLICATED = "rows", "cache", "nested", "replicated"


def axes(kind: Any) -> Any:
  """A pytree field constrained as `kind` (see above)."""
  return flax.struct.field(pytree_node=True, metadata={"axes": kind})


def constrain(tree: Any) -> Any:
  """Every field of a state struct pinned to its declared axes (recursively); a no-op without a mesh."""
  out = {}
  for f in dataclasses.fields(tree):
    v = getattr(tree, f.name)
    kind = f.metadata.get("axes", REPLICATED)
    if v is None or kind == REPLICATED:
      out[f.name] = v
    elif kind == NESTED:
      out[f.name] = constrain(v)
    elif kind == ROWS:
      out[f.name] = shard_rows(v)
    elif kind == CACHE:  # one buffer per layer, or stacked with a leading layers axis
      out[f.name] = jax.tree_util.tree_map(lambda a: shard(a, CACHE_AXES[-a.ndim:]), v)
    else:
      out[f.name] = shard(v, kind)
  return tree.replace(**out)


@flax.struct.dataclass
class Counters:
  """What a call ran, for NFE and benchmarks (scalars, shared by all rows).

  nfe: forwards executed (a forward batched over rows counts once); n_full / n_cached: of those, full-canvas
  (refresh, warm-up, no cache) and cached window forwards; n_window [W]: cached forwards per prefix-cache
  window width (layout.Grid.windows; one unused slot in the other modes).
  """
  n_cached: jax.Array = axes(REPLICATED)
  n_full: jax.Array = axes(REPLICATED)
  n_window: jax.Array = axes(REPLICATED)
  nfe: jax.Array = axes(REPLICATED)

  @classmethod
  def zeros(cls, windows: int) -> "Counters":
    z = jnp.zeros((), jnp.int32)
    return cls(n_cached=z, n_full=z, n_window=jnp.zeros((max(windows, 1),), jnp.int32), nfe=z)


@flax.struct.dataclass
class GenState:
  """The block loop's carry.

  canvas [B, Tc] int32; commit [B, Tc] int32 (the row's 1-based forward index that committed each position,
  -1 never); n [B] the row's forwards so far; done [B] (finished, or never valid); block: the block index, a
  scalar (the offline loop's shared block grid) or [B] (continuous batching: every row at its own block);
  emb [B, Tc, D]: smoothing's soft embeddings (None without smoothing); cache: the KV cache, one buffer per
  layer (None without a cache).
  """
  # (The field order is the loop carry's tuple order, which XLA's fusion passes see: kept as it was when the
  # carry was a dict, keys sorted, so the compiled program stays the same.)
  block: jax.Array = axes(ROWS)
  cache: KVCache | None = axes(CACHE)
  canvas: jax.Array = axes(CANVAS_AXES)
  commit: jax.Array = axes(CANVAS_AXES)
  done: jax.Array = axes(ROW_AXES)
  emb: jax.Array | None = axes(EMBED_AXES)
  n: jax.Array = axes(ROW_AXES)
  counters: Counters = axes(NESTED)


@flax.struct.dataclass
class BlockCarry:
  """The step loop's carry inside one block.

  gen: the generation state; dec: the decoder's per-row state (a leading batch axis on every leaf);
  refreshed [B]: the row's cache was refreshed since the block started; owed [B]: the row owes a forward
  although its block has no mask (the cache policy's: dInfer's cached step after a refresh under
  dinfer_compat, block diffusion's clean-K/V forward); iters: the block's iterations so far (a backstop).
  """
  gen: GenState = axes(NESTED)
  dec: Any = axes(ROWS)
  refreshed: jax.Array = axes(ROW_AXES)
  owed: jax.Array = axes(ROW_AXES)
  iters: jax.Array = axes(REPLICATED)


@flax.struct.dataclass
class RunOutput:
  """What the generate program returns: canvas [B, Tc], commit [B, Tc] (as GenState), row_nfe [B] (forwards
  each row took part in), counters."""
  canvas: jax.Array
  commit: jax.Array
  row_nfe: jax.Array
  counters: Counters
