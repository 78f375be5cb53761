"""Iteration manager: the per-forward schedules that sit between the model and the decoder.

- Iteration smoothing (dInfer's IterationSmooth): masked positions are fed back as
  E[MASK] + w_n * softmax(z) @ E, with w_n = min(0.15 + 0.02 n, cont_weight) and the decoder's threshold
  relaxed from 1 as tau_n = max(1 - 0.02 n, threshold); n counts the row's forwards so far.
- The prefix cache's shrinking windows: the block and everything after it, in a few bucketed widths, and the
  same widths for smoothing's LM head over the rows from the block on.
(The cached forwards' windows themselves are the cache policies': engine.cache_policy.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dinfer_jax.engine.config import SMOOTH_THRESHOLD_DECAY, SMOOTH_WEIGHT_GROWTH, SMOOTH_WEIGHT_INIT
from dinfer_jax.model import quant


def smooth_weight(n: jax.Array, cont_weight: jax.Array | float) -> jax.Array:
  """w_n per row; n [B] int; cont_weight the (traced) cap."""
  return jnp.minimum(SMOOTH_WEIGHT_INIT + SMOOTH_WEIGHT_GROWTH * n.astype(jnp.float32),
                     jnp.asarray(cont_weight, jnp.float32))


def step_threshold(n: jax.Array, smoothing: bool, threshold: jax.Array | float) -> jax.Array:
  """The threshold the decoder uses at a row's forward n: tau_n with smoothing (static), else the configured
  one; `threshold` is its (traced) value."""
  threshold = jnp.asarray(threshold, jnp.float32)
  if not smoothing:
    return jnp.broadcast_to(threshold, n.shape)
  return jnp.maximum(1.0 - SMOOTH_THRESHOLD_DECAY * n.astype(jnp.float32), threshold)


def soft_embed(table: jax.Array, tokens: jax.Array, logits: jax.Array, masked: jax.Array,
               weight: jax.Array) -> jax.Array:
  """E[x] plus, at still-masked positions, w * softmax(z) @ E (additive: the MASK embedding keeps weight 1).

  Args:
    table: [V, D] input embedding (plain, or 8-bit with one scale per row: model/quant.py's take_rows and
      einsum; the row scales then multiply the probabilities). tokens [B, W]; logits [B, W, V] fp32;
      masked [B, W]; weight [B].
  Returns: [B, W, D] in the table's dtype.
  """
  base = quant.take_rows(table, tokens)
  p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  soft = quant.einsum("BWV,VD->BWD", p.astype(table.dtype), table, preferred_element_type=jnp.float32)
  add = jnp.where(masked[..., None], weight[:, None, None] * soft, 0.0)
  return (base.astype(jnp.float32) + add).astype(table.dtype)


# Prefix-cache window widths per program: the widest covers the whole generation, each next one half of it
# (in whole blocks). Every width is one more copy of the cached forward in the compiled program, so a few:
# for 16 blocks, widths of 16, 8, 4 and 2 blocks cost 10.75 blocks per forward on average instead of 16
# (8.5 would need one width per block).
MAX_PREFIX_WINDOWS = 4


def prefix_windows(num_blocks: int, block_len: int) -> tuple[int, ...]:
  """Bucketed widths of the prefix cache's cached forward, widest first (num_blocks * block_len, ...)."""
  return tuple(sorted({block_len * -(-num_blocks // 2**j) for j in range(MAX_PREFIX_WINDOWS)}, reverse=True))


def prefix_window_index(s: jax.Array, *, widths: tuple[int, ...], gen_end: int) -> jax.Array:
  """Which of `widths` the cached forward of the block starting at s takes: the narrowest that still holds
  [s, gen_end), the block and every position after it."""
  return (jnp.sum(jnp.asarray(widths) >= gen_end - s) - 1).astype(jnp.int32)


def tail_widths(gen_len: int, block_len: int) -> tuple[int, ...]:
  """Bucketed widths of the rows a full forward under smoothing takes through the LM head and the soft
  embedding: the block and every row after it, [gen_len - width, gen_len) of the generation region (the rows
  before hold no mask), in prefix_windows' widths (prefix_window_index picks one per block)."""
  return prefix_windows(gen_len // block_len, block_len)


def block_shares(widths: tuple[int, ...], gen_len: int, block_len: int) -> tuple[float, ...]:
  """The share of a generation's blocks that take each of `widths` (prefix_window_index's pick for the
  block starting at each multiple of block_len): how often each branch of a per-block choice of width runs."""
  n = -(-gen_len // block_len)
  picks = [int(prefix_window_index(k * block_len, widths=widths, gen_end=gen_len)) for k in range(n)]
  return tuple(picks.count(i) / n for i in range(len(widths)))


def prefix_window_start(s: jax.Array, width: int, canvas_len: int) -> jax.Array:
  """c0 of a prefix window of this width: at the block start, or moved left to stay on the canvas (the
  extra positions are recomputed as queries; their keys stay the cached ones, see cache_policy.DualCache.window)."""
  return jnp.minimum(s, canvas_len - width).astype(jnp.int32)
