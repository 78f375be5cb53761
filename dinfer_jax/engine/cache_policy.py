"""The KV-cache manager (dInfer's DiffusionKVCacheManager and BlockDiffusionPrefixCacheManager) as policy
objects: which forward each row takes per iteration (its phase), where the cached forward reads and writes
(its windows), the forward calls themselves, and how a block's step loop is laid out.

Four policies, chosen from the model's decoding and the generation config (`for_config`):
- NoCache: every iteration is a full-canvas forward (block-causal under block diffusion).
- PrefixCache: a block starts with a refresh forward over the whole canvas whose K/V become the cache, then
  cached forwards over the block and everything after it, in a few bucketed widths that shrink with the block.
- DualCache: the refresh, then cached forwards over the block alone, or with the vicinity refresh over
  [s - prefix_look, e + after_look) and the first warmup_steps forwards plain full ones.
- BlockDiffusionCache (LLaDA2): the prompt's blocks are prefilled under the block-causal mask, every
  iteration is a cached forward over the block whose fresh K/V persist, and a finished block gets one more
  forward on its final tokens so that the cache holds their clean K/V.

Policies are frozen dataclasses: static arguments of the compiled program (engine.program.DenoiseProgram).
Their forward methods run inside the program and take its trace context: `tr` an engine.trace.Trace (the
program, params and the call's traced arguments), `blk` an engine.trace.Block (the block being decoded).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from dinfer_jax import cache as cache_lib, decoders
from dinfer_jax.cache import KVCache
from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import iteration
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.state import GenState
from dinfer_jax.model.layers import slice_rows

def rows_col(x: jax.Array) -> jax.Array:
  """A scalar or [B] per-row index as a column ([1, 1] or [B, 1]) to compare against a row of positions."""
  return jnp.reshape(x, (-1, 1))


def block_causal_mask(valid: jax.Array, qcol: jax.Array, block_len: int) -> jax.Array:
  """LLaDA2's block-causal mask [B, T, S]: the query at canvas column qcol ([T], or [B, T] per row) sees the
  valid ([B, S]) keys of its own block and the blocks before it. Canvas blocks are position blocks (block
  diffusion keeps pads whole blocks)."""
  qblk = jnp.asarray(qcol) // block_len
  kblk = jnp.arange(valid.shape[1]) // block_len
  return valid[:, None, :] & (kblk[None, None, :] <= jnp.reshape(qblk, (-1,) + qblk.shape[-1:])[:, :, None])


# The forward a row takes in an iteration (its phase).
FULL = 1  # full canvas forward, no cache read or write (no cache, vicinity warm-up)
REFRESH = 2  # full canvas forward whose K/V replace the row's cache (block entry)
CACHED = 3  # window forward reading the cache
# The cached-forward variant of block diffusion's block entry with dInfer v0.2's cross-block update (a window
# index, as the prefix cache's windows are).
CROSS_BLOCK = -1


@dataclasses.dataclass(frozen=True)
class CachePolicy:
  """Base of the policies.

  Class attributes:
    name: the mode's name (GenerationConfig.cache, or "block_diffusion").
    has_full: iterations may run the full-canvas forward.
    has_cache: the program carries a KV cache and runs cached window forwards.
    block_diffusion: the layout of block diffusion (blocks aligned to position blocks, the canvas padded to
      whole blocks).
  """

  name: ClassVar[str] = ""
  has_full: ClassVar[bool] = True
  has_cache: ClassVar[bool] = True
  block_diffusion: ClassVar[bool] = False

  # ------------------------------------------------------------------ shapes (host side, for the layout)
  def window_width(self, block_len: int, num_blocks: int) -> int:
    """Width of the cached forward's input (0 without a cache; the widest of window_widths)."""
    return block_len

  def window_widths(self, block_len: int, num_blocks: int) -> tuple[int, ...]:
    """The prefix cache's bucketed widths (layout.Grid.windows); () for the others."""
    return ()

  @property
  def warmup_steps(self) -> int:
    """Each row's first forwards that are plain full forwards (the vicinity warm-up)."""
    return 0

  # ------------------------------------------------------------------ inside the program
  def init_cache(self, mcfg: ModelConfig, batch: int, length: int, dtype) -> KVCache | None:
    # One buffer per layer: cached forwards update them in place (transformer.forward keep_cache).
    return KVCache.zeros(mcfg.n_layers, batch, length, mcfg.n_kv_heads, mcfg.head_dim, dtype, per_layer=True)

  def phase(self, n: jax.Array, refreshed: jax.Array) -> jax.Array:
    """[B] int32 phase of each row this iteration; n [B] the row's forwards so far, refreshed [B] whether its
    cache was refreshed since the block started. As in dInfer, a block's first iteration is the refresh
    forward (its block logits decode) and then the cached steps; unlike dInfer, exactly one refresh per block
    entry (no double refresh when block 0 finishes during the vicinity warm-up)."""
    phase = jnp.where(refreshed, CACHED, REFRESH)
    if self.warmup_steps:
      phase = jnp.where(n < self.warmup_steps, FULL, phase)
    return phase.astype(jnp.int32)

  def full_mask(self, valid: jax.Array, block_len: int) -> jax.Array:
    """The full forward's attention mask: bidirectional over the valid positions."""
    del block_len
    return valid

  def prefill(self, tr: Any, st: GenState, rows: jax.Array | None = None) -> GenState:
    """Work before a row's first block (block diffusion's prompt prefill): for every row, or for `rows` [B]
    (continuous batching: the rows that just joined). None by default."""
    del tr, rows
    return st

  def window(self, tr: Any, s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(c0, lo, hi) of the cached forward of the block starting at s: its fixed-width input window starts at
    canvas index c0, and fresh K/V are written for positions in [lo, hi) only."""
    raise NotImplementedError

  def full_forward(self, tr: Any, blk: Any, st: GenState, refresh: jax.Array):
    """Whole-canvas forward; refresh rows [B] take its K/V into their cache. Returns (the block's logits, or
    with smoothing the final-normed rows of the generation region [C, Tc), and the cache). With smoothing the
    step takes the rows from the block on through the LM head (the prompt holds no mask, nor do the blocks
    before this one)."""
    C, L, Tc = tr.grid.first_block, tr.grid.block_len, tr.grid.canvas_len
    inp = {"embeds": st.emb} if tr.smoothing else {"tokens": st.canvas}
    lg = {"logits_start": C, "logits_len": Tc - C} if tr.smoothing else {"logits_start": blk.s, "logits_len": L}
    out = tr.forward(positions=tr.positions, mask=tr.full_mask, kv_layers=self.has_cache, head=not tr.smoothing,
                     **inp, **lg)
    new_cache = cache_lib.select_rows(refresh, out.kv, st.cache) if self.has_cache else None
    return (out.hidden if tr.smoothing else out.logits), new_cache

  def window_forward(self, tr: Any, st: GenState, s: jax.Array, c0: jax.Array, width: int,
                     key_mask: jax.Array, write: jax.Array, *, keep_cache: bool = True):
    """Forward of the canvas window [c0, c0 + width) over the cache, fresh K/V where `write`.

    keep_cache (prefix and dual caches): the forward writes the window's fresh K/V into the cache buffers in
    place (out.kv is the cache, to carry on). Nothing reads those slots before they are written again: every
    cached forward of the block rewrites the same [lo, hi) before attending, and the next block's refresh
    rewrites the whole cache (rows that sit a step out, or run full warm-up forwards, refresh before their
    next cached forward). So the cache attended to equals dInfer's block-entry cache with the window
    replaced, without putting the old slots back (4 fewer kernels per layer). Block diffusion gets the
    attended K/V to persist instead."""
    if tr.smoothing:
      inp, lg = {"embeds": slice_rows(st.emb, c0, width)}, {}
    else:
      inp = {"tokens": slice_rows(st.canvas, c0, width)}
      lg = {"logits_start": s - c0, "logits_len": tr.grid.block_len}
    return tr.forward(positions=slice_rows(tr.positions, c0, width), mask=key_mask, cache=st.cache,
                      cache_start=c0, write_mask=write, keep_cache=keep_cache, **inp, **lg)

  def cached_forward(self, tr: Any, blk: Any, st: GenState, rows: jax.Array, win: int):
    """The cached forward over the policy's window. rows [B]: the rows taking it; win: the prefix window's
    index into grid.windows (static: one switch branch per width). Returns (logits, cache, c0, write)."""
    W = tr.grid.window
    c0, lo, hi = self.window(tr, blk.s)
    wcol = rows_col(c0) + jnp.arange(W)
    write = jnp.broadcast_to((wcol >= rows_col(lo)) & (wcol < rows_col(hi)), (tr.batch, W))
    out = self.window_forward(tr, st, blk.s, c0, W, tr.valid, write)
    return out.logits, out.kv, c0, write  # the cache, updated in place

  def owed_after(self, tr: Any, blk: Any, owed: jax.Array, roles: Any, canvas: jax.Array) -> jax.Array:
    """[B]: the rows that owe a forward after this iteration although their block may hold no mask. Under
    dinfer_compat, dInfer's cached step after every refresh (even one that completed the block)."""
    del blk, canvas
    if not tr.program.dinfer_compat:
      return owed
    return jnp.where(roles.refresh, True, jnp.where(roles.cached, False, owed))

  def run_steps(self, steps: Any, carry: Any) -> Any:
    """A block's step loop. Block entry: no row has a fresh cache yet, so every active row's first forward is
    a full one (the refresh, or a warm-up forward). Then every iteration is the cached forward, except while
    some row is still in the vicinity warm-up (its first warmup_steps forwards are full, then it refreshes):
    those iterations pick per step. Sequential loops, not a conditional around them (XLA copies every cache
    buffer into a conditional whose branches update it). Host-driven, one predicate read per step (the loop's
    condition) instead of two; the prefix cache's narrowing windows keep their per-step switch."""
    carry = jax.lax.cond(steps.cond(carry), lambda c: steps.step(c, (True, None)), lambda c: c, carry)
    if self.warmup_steps:
      carry = steps.loop(carry, None, also=steps.in_warmup)
    return steps.loop(carry, None if steps.blk.windowed else (False, 0))


@dataclasses.dataclass(frozen=True)
class NoCache(CachePolicy):
  """Every iteration is a full forward over the canvas; block_causal: LLaDA2's block diffusion without a
  cache (the full forward under the block-causal mask)."""

  block_causal: bool = False
  name: ClassVar[str] = "none"
  has_cache: ClassVar[bool] = False

  @property
  def block_diffusion(self) -> bool:  # type: ignore[override]
    return self.block_causal

  def window_width(self, block_len: int, num_blocks: int) -> int:
    return 0

  def init_cache(self, mcfg, batch, length, dtype) -> None:
    return None

  def phase(self, n: jax.Array, refreshed: jax.Array) -> jax.Array:
    return jnp.full(n.shape, FULL, jnp.int32)

  def full_mask(self, valid: jax.Array, block_len: int) -> jax.Array:
    if not self.block_causal:
      return valid
    return block_causal_mask(valid, jnp.arange(valid.shape[1]), block_len)

  def run_steps(self, steps: Any, carry: Any) -> Any:
    return steps.loop(carry, (True, None))


@dataclasses.dataclass(frozen=True)
class PrefixCache(CachePolicy):
  """The refresh, then cached forwards over the block and everything after it."""

  name: ClassVar[str] = "prefix"

  def window_width(self, block_len: int, num_blocks: int) -> int:
    return num_blocks * block_len

  def window_widths(self, block_len: int, num_blocks: int) -> tuple[int, ...]:
    return iteration.prefix_windows(num_blocks, block_len)

  def window(self, tr: Any, s: jax.Array):
    # Block and everything after it, recomputed each step; the window starts at the first block.
    return jnp.asarray(tr.grid.first_block, jnp.int32), s, jnp.asarray(tr.grid.canvas_len, jnp.int32)

  def cached_forward(self, tr: Any, blk: Any, st: GenState, rows: jax.Array, win: int):
    if not blk.windowed:
      return super().cached_forward(tr, blk, st, rows, win)
    return self._narrow_forward(tr, blk, st, tr.grid.windows[win])

  def _narrow_forward(self, tr: Any, blk: Any, st: GenState, width: int):
    """The cached forward over the narrowest bucketed window that holds the block and everything after it
    (grid.windows), not the whole generation every time. With smoothing the window's logits go back to the
    widest window's coordinates (it starts at C), where the rest of the step expects them."""
    C, W, Tc, s = tr.grid.first_block, tr.grid.window, tr.grid.canvas_len, blk.s
    c0 = iteration.prefix_window_start(s, width, Tc)
    write = jnp.broadcast_to((c0 + jnp.arange(width) >= s)[None, :], (tr.batch, width))
    out = self.window_forward(tr, st, s, c0, width, tr.valid, write)
    logits = out.logits
    if tr.smoothing:
      logits = jax.lax.dynamic_update_slice_in_dim(
          jnp.zeros((tr.batch, W, tr.model.vocab_size), logits.dtype), logits, c0 - C, axis=1)
    write = jnp.broadcast_to((C + jnp.arange(W) >= s)[None, :], (tr.batch, W))
    return logits, out.kv, jnp.asarray(C, jnp.int32), write


@dataclasses.dataclass(frozen=True)
class DualCache(CachePolicy):
  """The refresh, then cached forwards over the block; with the vicinity refresh (prefix_look, after_look,
  warmup_steps) over [s - prefix_look, e + after_look) after warmup_steps plain full forwards."""

  prefix_look: int = 0
  after_look: int = 0
  vicinity_warmup: int = 0
  name: ClassVar[str] = "dual"

  @property
  def warmup_steps(self) -> int:
    return self.vicinity_warmup

  def window_width(self, block_len: int, num_blocks: int) -> int:
    return self.prefix_look + block_len + self.after_look

  def window(self, tr: Any, s: jax.Array):
    """dInfer's window [max(0, s - pl), min(T, e + al)) changes width at the canvas edges; a fixed width keeps
    one compiled shape, and writing only [lo, hi) keeps the attended keys equal."""
    lo = s - self.prefix_look
    hi = s + tr.grid.block_len + self.after_look
    c0 = jnp.clip(lo, 0, tr.grid.canvas_len - tr.grid.window)
    return c0.astype(jnp.int32), lo, hi


@dataclasses.dataclass(frozen=True)
class BlockDiffusionCache(CachePolicy):
  """LLaDA2's block diffusion with its prefix cache (dInfer's BlockDiffusionRunner): the cache holds exactly
  the positions before the block's end and each step persists the block's fresh K/V.

  The K/V a block's last forward wrote were computed from its tokens before that forward's commits. With
  cross_block (dInfer v0.2, the default) the next block's first forward also takes the previous block as
  queries, under the block-causal mask, and rewrites its K/V from its final tokens: the same tokens as a
  clean-up forward after each block (dInfer v0.1, dinfer_compat), one forward fewer per block. Without it, a
  block that finished takes one more forward on its final tokens for their clean K/V."""

  cross_block: bool = True
  name: ClassVar[str] = "block_diffusion"
  has_full: ClassVar[bool] = False
  block_diffusion: ClassVar[bool] = True

  def phase(self, n: jax.Array, refreshed: jax.Array) -> jax.Array:
    return jnp.full(n.shape, CACHED, jnp.int32)

  def prefill(self, tr: Any, st: GenState, rows: jax.Array | None = None) -> GenState:
    """The prompt's blocks under the block-causal mask (dInfer's BlockDiffusionRunner.prefill): one forward,
    its K/V into the cache of every row (or of `rows` [B], the rest keep theirs)."""
    P, L = tr.grid.prefill_len, tr.grid.block_len
    bc = block_causal_mask(tr.valid[:, :P], jnp.arange(P), L)
    out = tr.forward(st.canvas[:, :P], positions=tr.positions[:, :P], mask=bc, kv_layers=True)
    if rows is None:
      cache = jax.tree_util.tree_map(lambda c, n: c.at[:, :P].set(n.astype(c.dtype)), st.cache, out.kv)
      return st.replace(cache=cache, counters=st.counters.replace(nfe=st.counters.nfe + 1), n=st.n + 1)
    m = rows.reshape(-1, 1, 1, 1)
    cache = jax.tree_util.tree_map(lambda c, n: c.at[:, :P].set(jnp.where(m, n.astype(c.dtype), c[:, :P])),
                                   st.cache, out.kv)
    return st.replace(cache=cache, counters=st.counters.replace(nfe=st.counters.nfe + rows.any().astype(jnp.int32)),
                      n=st.n + rows.astype(jnp.int32))

  def window(self, tr: Any, s: jax.Array):
    return s, s, s + tr.grid.block_len

  def cached_forward(self, tr: Any, blk: Any, st: GenState, rows: jax.Array, win: int):
    """The block over the cache; the rows taking it persist its fresh K/V. win == CROSS_BLOCK: the block
    entry's forward that also rewrites the previous block's K/V."""
    if win == CROSS_BLOCK:
      return self._cross_block_forward(tr, blk, st, rows)
    W, s = tr.grid.window, blk.s
    c0, lo, hi = self.window(tr, s)
    key_mask = tr.valid & (tr.col[None, :] < rows_col(s) + tr.grid.block_len)  # the positions before the block end
    wcol = rows_col(c0) + jnp.arange(W)
    write = jnp.broadcast_to((wcol >= rows_col(lo)) & (wcol < rows_col(hi)), (tr.batch, W))
    out = self.window_forward(tr, st, s, c0, W, key_mask, write, keep_cache=False)
    return out.logits, cache_lib.select_rows(rows, out.kv, st.cache), c0, write

  def _cross_block_forward(self, tr: Any, blk: Any, st: GenState, rows: jax.Array):
    """The window [s - L, s + L): the previous block's queries see what they saw before (the blocks up to their
    own), the current block's the blocks up to theirs; both blocks' fresh K/V persist. The first block after
    the prefill keeps the prefill's K/V of the block before it (only the current block is written)."""
    L, C, Tc, s = tr.grid.block_len, tr.grid.first_block, tr.grid.canvas_len, blk.s
    c0 = jnp.clip(s - L, 0, Tc - 2 * L).astype(jnp.int32)
    qcol = rows_col(c0) + jnp.arange(2 * L)  # [1 or B, 2L] canvas index of each query
    key_mask = block_causal_mask(tr.valid, qcol, L)
    lo = jnp.where(s > C, s - L, s)
    write = jnp.broadcast_to((qcol >= rows_col(lo)) & (qcol < rows_col(s) + L), (tr.batch, 2 * L))
    out = self.window_forward(tr, st, s, c0, 2 * L, key_mask, write, keep_cache=False)
    return out.logits, cache_lib.select_rows(rows, out.kv, st.cache), c0, write[:, :tr.grid.window]

  def owed_after(self, tr: Any, blk: Any, owed: jax.Array, roles: Any, canvas: jax.Array) -> jax.Array:
    """The clean-K/V forward is owed by a row whose block just lost its last mask, for the blocks after it:
    none after the last block, nor after an EOS that ends the row (dinfer_compat runs it anyway). It is paid
    by the row's next iteration, which runs with no mask. None with cross_block (the next block's first
    forward rewrites those K/V) nor for a decoder that settles its blocks (its last forward saw them final)."""
    p = tr.program
    if tr.decoder.settles or self.cross_block:
      return owed
    masks_after = blk.has_masks(canvas)
    ends_row = (p.is_stop(blk.slice(canvas)).any(axis=1) if p.early_stop
                else jnp.zeros((tr.batch,), bool))
    wanted = jnp.full((tr.batch,), True) if p.dinfer_compat else blk.more_after & ~ends_row
    return jnp.where(roles.active & roles.masks_before & ~masks_after & wanted, True,
                     jnp.where(roles.active & ~roles.masks_before, False, owed))

  def run_steps(self, steps: Any, carry: Any) -> Any:
    if self.cross_block and steps.tr.grid.canvas_len >= 2 * steps.tr.grid.block_len:
      carry = jax.lax.cond(steps.cond(carry), lambda c: steps.step(c, (False, CROSS_BLOCK)), lambda c: c, carry)
    return steps.loop(carry, None)


def for_config(mcfg: ModelConfig, gcfg: GenerationConfig) -> CachePolicy:
  """The policy for a model and a generation config. Block diffusion (the model's decoding) takes its own
  cache with any cache mode and the block-causal full forward without one."""
  if mcfg.block_diffusion:
    if gcfg.smoothing:
      raise ValueError("GenerationConfig.cont_weight: iteration smoothing is not supported with LLaDA2's "
                       "block diffusion; set cont_weight=0")
    if gcfg.vicinity:
      raise ValueError("GenerationConfig.prefix_look/after_look/warmup_steps: the vicinity refresh does not "
                       "apply to LLaDA2's block diffusion (its cache is exact); set them to 0")
    if gcfg.cache == "none":
      return NoCache(block_causal=True)
    # dInfer v0.2's cross-block update by default; v0.1's clean-up forward under dinfer_compat; neither for a
    # decoder whose blocks end on a forward that saw their final tokens.
    return BlockDiffusionCache(cross_block=not gcfg.dinfer_compat and not decoders.get(gcfg.decoder).settles)
  if gcfg.cache == "prefix":
    return PrefixCache()
  if gcfg.cache == "dual":
    return DualCache(gcfg.prefix_look, gcfg.after_look, gcfg.warmup_steps if gcfg.vicinity else 0)
  return NoCache()
