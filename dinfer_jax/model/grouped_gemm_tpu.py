"""The MoE's grouped GEMM on TPU: a Pallas-Mosaic kernel over (row tile, group) work items.

Rows come sorted by expert (moe.experts_ragged). A row tile of block_m rows can hold rows of several groups
and a group can span several tiles, so the grid walks work items, one per (tile, group) pair that shares
rows: at most tiles + G - 1 of them, in row order. Each item multiplies its tile's rows by its group's
weights and keeps the rows of that group (a mask by the group's bounds), accumulating into the tile's fp32
scratch; consecutive items of one tile share the output block, which stays in VMEM until the tile's last
item writes it. The weights of a group are read once per item: about once per expert when groups are at
least a tile tall, twice for a group split across a tile boundary.

Grid: (N tiles, items, K tiles), K innermost (the accumulation), N outermost so that a tile's items are
consecutive for each N tile (an output block revisited after another would be written back and lost).
The item tables (group, tile, whether real) are scalar-prefetched: the index maps read them to pick the
x tile and the weight tile. Items past the real ones repeat the last one and are skipped.

Rows past sum(sizes) are not any group's and are left zero. XLA TPU's ragged_dot walks the same work items;
compiled for a v6e it comes out cheaper by XLA's own cost model (moe.TPU_GROUPED_GEMM says by how much), so
the engine takes this kernel only with that switch on. Tests run it in Pallas's interpreter on CPU against
ragged_dot and, inside the MoE, against moe_loop_reference; bench/realistic.py charges it by its work items.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dinfer_jax.model import quant

NAME = "dinfer_gmm_tpu"
LANES = 128  # K and N blocks: the MXU's and the vector registers' 128 lanes


def block_m_for(M: int, G: int) -> int:
  """The row tile: the rows an expert gets on average, as a power of two in [128, 1024]. A group's weights
  are read once per tile it spans, so a taller tile reads them fewer times (the batch-8 refresh: 1280 rows
  per expert, 2 reads at 1024 rows against 10 at 128); past the average it only pads the matmuls."""
  per_group = max(M // max(G, 1), 1)
  return int(min(max(1 << (per_group - 1).bit_length(), 128), 1024))


def supports(x: jax.Array, w) -> bool:
  """Plain weights [G, K, N] with K and N multiples of the lanes (8-bit QArrays go through ragged_dot)."""
  if quant.is_qarray(w) or len(w.shape) != 3:
    return False
  _, K, N = w.shape
  return x.shape[1] == K and K % LANES == 0 and N % LANES == 0


def work_items(sizes: jax.Array, M: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(group, tile, real, starts) per work item for rows sorted by group with `sizes` [G] rows each: the
  (tile, group) pairs that share rows, in row order, padded to tiles + G - 1 items by repeating the last."""
  G = sizes.shape[0]
  tiles = -(-M // block_m)
  n_items = tiles + G - 1
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first = starts // block_m
  count = jnp.where(sizes > 0, (jnp.maximum(ends, 1) - 1) // block_m - first + 1, 0)
  before = jnp.cumsum(count) - count  # items ahead of each group's first
  i = jnp.arange(n_items)
  total = jnp.sum(count)
  last = jnp.maximum(total - 1, 0)
  j = jnp.minimum(i, last)
  group = jnp.clip(jnp.searchsorted(jnp.cumsum(count), j, side="right"), 0, G - 1).astype(jnp.int32)
  tile = (first[group] + j - before[group]).astype(jnp.int32)
  real = (i < total).astype(jnp.int32)
  return group, tile, real, starts.astype(jnp.int32)


def _kernel(group_ref, tile_ref, real_ref, starts_ref, sizes_ref, x_ref, w_ref, o_ref, acc_ref, *,
            block_m: int, n_items: int):
  i, k = pl.program_id(1), pl.program_id(2)
  nk = pl.num_programs(2)
  t = tile_ref[i]
  first = jnp.logical_or(i == 0, tile_ref[jnp.maximum(i - 1, 0)] != t)
  last = jnp.logical_or(i == n_items - 1, tile_ref[jnp.minimum(i + 1, n_items - 1)] != t)

  @pl.when(jnp.logical_and(k == 0, first))
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(real_ref[i] == 1)
  def _():
    g = group_ref[i]
    rows = t * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    lo = starts_ref[g]
    mine = jnp.logical_and(rows >= lo, rows < lo + sizes_ref[g])
    prod = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    acc_ref[...] += jnp.where(mine, prod, 0.0)

  @pl.when(jnp.logical_and(k == nk - 1, last))
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "block_n", "interpret"))
def gmm(x: jax.Array, w: jax.Array, sizes: jax.Array, *, block_m: int = 128, block_k: int = 512,
        block_n: int = 256, interpret: bool = False) -> jax.Array:
  """x [M, K] rows sorted by group, w [G, K, N], sizes [G] -> [M, N] in x's dtype (fp32 accumulation): each
  group's rows times its weights, as jax.lax.ragged_dot. K and N must be multiples of their blocks (they are
  at the model's shapes: 2048 and the expert FFN width, 128-aligned, per tensor-parallel shard); M is
  padded to a tile here."""
  M, K = x.shape
  G, K2, N = w.shape
  if K2 != K or sizes.shape != (G,):
    raise ValueError(f"gmm: x {x.shape}, w {w.shape}, sizes {sizes.shape}: expected x [M, K], w [G, K, N], "
                     "sizes [G]")
  if K % LANES or N % LANES:
    raise ValueError(f"gmm: K={K}, N={N} must be multiples of {LANES} (the lanes)")
  block_k, block_n = min(block_k, K), min(block_n, N)
  while K % block_k:  # the largest power-of-two multiple of the lanes up to block_k that divides K
    block_k //= 2
  while N % block_n:
    block_n //= 2
  w = w.astype(x.dtype)
  tiles = -(-M // block_m)
  Mp = tiles * block_m
  xp = jnp.pad(x, ((0, Mp - M), (0, 0)))
  group, tile, real, starts = work_items(sizes.astype(jnp.int32), M, block_m)
  n_items = tiles + G - 1
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5,
      grid=(N // block_n, n_items, K // block_k),
      in_specs=[pl.BlockSpec((block_m, block_k), lambda n, i, k, gr, ti, re, st, sz: (ti[i], k)),
                pl.BlockSpec((pl.Squeezed(), block_k, block_n), lambda n, i, k, gr, ti, re, st, sz: (gr[i], k, n))],
      out_specs=pl.BlockSpec((block_m, block_n), lambda n, i, k, gr, ti, re, st, sz: (ti[i], n)),
      scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)])
  itemsize = jnp.dtype(x.dtype).itemsize
  cost = pl.CostEstimate(flops=2 * M * K * N, transcendentals=0,
                         bytes_accessed=(M * K + G * K * N + M * N) * itemsize)
  out = pl.pallas_call(
      functools.partial(_kernel, block_m=block_m, n_items=n_items),
      grid_spec=spec, out_shape=jax.ShapeDtypeStruct((Mp, N), x.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name=f"{NAME}_bm{block_m}",  # bench/realistic.py reads the tile
  )(group, tile, real, starts, sizes.astype(jnp.int32), xp, w)
  # Tiles no item visits (rows past every group) were never written.
  covered = jnp.arange(Mp) < jnp.sum(sizes)
  return jnp.where(covered[:, None], out, 0)[:M]
