"""The whole denoising loop as one XLA program: blocks and steps under nested lax.while_loops.

Per iteration every active row takes one forward chosen by the cache manager (cache.row_phase): a full
canvas forward (no cache, warm-up, or block-entry refresh) or a cached window forward. Each kind runs at
most once per iteration, batched over the rows that need it, under lax.cond so an iteration where no row
needs a kind skips it. The decoder then commits tokens per row; rows that are waiting for others (their
block is done) take no part: their tokens, counters and decoder state stay frozen, so every row behaves
exactly as if it ran alone.
"""
from __future__ import annotations

import functools
import itertools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dinfer_jax import cache as cache_lib
from dinfer_jax import decoders
from dinfer_jax.cache import CACHED, FULL, REFRESH, KVCache
from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import iteration
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.layout import Grid
from dinfer_jax.model import quant
from dinfer_jax.model.layers import slice_rows, update_rows
from dinfer_jax.model.transformer import forward, lm_head
from dinfer_jax.sharding import CACHE_AXES, CANVAS_AXES, EMBED_AXES, ROW_AXES, shard, shard_rows


def _where_rows(rows: jax.Array, new, old):
  """Per-row select over a pytree whose leaves have a leading batch axis."""
  def sel(a, b):
    return jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  return jax.tree_util.tree_map(sel, new, old)


def _decode_rows(decoder, state, logits, tokens, maskable, thr, keys, *, mask_id, temperature):
  """Runs the decoder row by row (vmap of batch-1 calls), so each row can have its own threshold (the
  smoothing schedule is per row) and its own decoder state."""
  def one(st, lg, tk, mk, th, key):
    nt, cm, ns = decoder.step(st, lg[None], tk[None], mk[None], mask_id=mask_id, threshold=th,
                              temperature=temperature, rng=key)
    return nt[0], cm[0], ns
  return jax.vmap(one)(state, logits, tokens, maskable, thr, keys)


def _constrain(st: dict[str, Any]) -> dict[str, Any]:
  """Pins the loop carry to its logical axes (batch rows on "data", the cache's kv heads on "tensor"), so
  GSPMD keeps the state split the same way in every iteration; a no-op without a mesh."""
  axes = {"canvas": CANVAS_AXES, "commit": CANVAS_AXES, "emb": EMBED_AXES}
  out = {}
  for k, v in st.items():
    if k == "cache":  # one buffer per layer
      out[k] = jax.tree_util.tree_map(lambda a: shard(a, CACHE_AXES[1:]), v)
    elif k == "dec":
      out[k] = shard_rows(v)
    elif k in axes:
      out[k] = shard(v, axes[k])
    elif k == "n_window":  # a counter per window width, not per row
      out[k] = v
    else:
      out[k] = shard(v, ROW_AXES) if v.ndim == 1 else v
  return out


def _init_rows(decoder, tokens, maskable):
  return jax.vmap(lambda tk, mk: decoder.init_state(tk[None], mk[None]))(tokens, maskable)


def run(params: dict, canvas: jax.Array, valid: jax.Array, positions: jax.Array, seed: jax.Array,
        knobs: dict[str, jax.Array] | None = None, *,
        mcfg: ModelConfig, gcfg: GenerationConfig, grid: Grid, decoder: Any, mode: str,
        block_causal: bool, mask_id: int, eos_id: int, stream: bool = False,
        stream_id: jax.Array | None = None) -> dict[str, jax.Array]:
  """The jitted body (see engine.generate for the host side).

  Args:
    canvas [B, Tc] int32, valid [B, Tc] bool, positions [B, Tc] int32: from layout.make_layout.
    seed: a PRNG key.
    knobs: GenerationConfig.knob_values() (fp32 scalars): the thresholds, temperature and smoothing cap as
      runtime values, with gcfg = its program_config() so that one program serves every value. None: gcfg's
      own values, compiled in.
    mode: "none" | "prefix" | "dual" | "block_diffusion".
    block_causal: full forwards use LLaDA2's block-causal mask (block diffusion without a cache).
    stream, stream_id: when stream, every finished block's canvas goes to the host callback registered
      under stream_id (register_stream) while the program runs.
  Returns: dict with canvas [B, Tc], commit [B, Tc] (1-based forward index of the row, -1 never),
    row_nfe [B], nfe [] (forwards executed by the call), full/cached forward counts, n_window: cached
    forwards per prefix window width (grid.windows).
  """
  Bsz, Tc = canvas.shape
  knobs = gcfg.knob_values() if knobs is None else knobs
  row_keys = jax.vmap(lambda r: jax.random.fold_in(seed, r))(jnp.arange(Bsz))
  st = init_state(params, canvas, valid, mcfg=mcfg, gcfg=gcfg, grid=grid, mode=mode)
  if mode == "block_diffusion":
    # Prefill the prompt's blocks with the block-causal mask (dInfer's BlockDiffusionRunner.prefill).
    P = grid.prefill_len
    blk_of = jnp.arange(P) // grid.block_len
    bc = (blk_of[None, :, None] >= blk_of[None, None, :]) & valid[:, None, :P]
    out = forward(params, mcfg, canvas[:, :P], positions=positions[:, :P], mask=bc, kv_layers=True)
    st["cache"] = jax.tree_util.tree_map(lambda c, n: c.at[:, :P].set(n.astype(c.dtype)), st["cache"], out.kv)
    st["nfe"] = st["nfe"] + 1
    st["n"] = st["n"] + 1

  body = block_body(params, valid, positions, row_keys, knobs, mcfg=mcfg, gcfg=gcfg, grid=grid, decoder=decoder,
                    mode=mode, block_causal=block_causal, mask_id=mask_id, eos_id=eos_id)

  def one_block(st):
    out = body(st)
    if stream:  # the block is final: hand it to the host now, not when the whole program returns
      io_callback(_emit_block, None, stream_id, st["block"], out["canvas"], ordered=True)
    return out

  def block_cond(st):
    return (st["block"] < grid.num_blocks) & ~st["done"].all()

  st = jax.lax.while_loop(block_cond, one_block, st)
  return {"canvas": st["canvas"], "commit": st["commit"], "row_nfe": st["n"], "nfe": st["nfe"],
          "n_full": st["n_full"], "n_cached": st["n_cached"], "n_window": st["n_window"]}


def init_state(params: dict, canvas: jax.Array, valid: jax.Array, *, mcfg: ModelConfig, gcfg: GenerationConfig,
               grid: Grid, mode: str, block: jax.Array | None = None) -> dict[str, Any]:
  """The loop carry before the first block: block a scalar (the offline loop's shared block grid) or, given
  as [B], one block index per row (continuous batching)."""
  Bsz, Tc = canvas.shape
  st: dict[str, Any] = {
      "canvas": canvas,
      "commit": jnp.full((Bsz, Tc), -1, jnp.int32),
      "n": jnp.zeros((Bsz,), jnp.int32),
      "nfe": jnp.zeros((), jnp.int32),
      "n_full": jnp.zeros((), jnp.int32),
      "n_cached": jnp.zeros((), jnp.int32),
      "done": ~valid.any(axis=1),
      "block": jnp.zeros((), jnp.int32) if block is None else block,
      # cached forwards per prefix window width (grid.windows); one unused slot in the other modes
      "n_window": jnp.zeros((max(len(grid.windows), 1),), jnp.int32),
  }
  if gcfg.smoothing:
    st["emb"] = quant.take_rows(params["embed"], canvas)
  if mode in ("prefix", "dual", "block_diffusion"):
    # One buffer per layer: cached forwards update them in place (transformer.forward keep_cache).
    st["cache"] = KVCache.zeros(mcfg.n_layers, Bsz, Tc, mcfg.n_kv_heads, mcfg.head_dim, params["embed"].dtype,
                                per_layer=True)
  return _constrain(st)


def block_body(params: dict, valid: jax.Array, positions: jax.Array, row_keys: jax.Array,
               knobs: dict[str, jax.Array], *, mcfg: ModelConfig, gcfg: GenerationConfig, grid: Grid,
               decoder: Any, mode: str, block_causal: bool, mask_id: int, eos_id: int):
  """The function that decodes one block of every row: st -> st (init_state's carry), run by `run`'s block
  loop and, one call per program, by continuous batching (engine.slots).

  With a scalar st["block"] every row's block starts at the same canvas index (layout's shared grid); with
  [B] blocks each row's block is its own, and slices of the canvas, the logits and the cache window are
  taken per row (gathers instead of dynamic slices). Rows whose `done` is set take no part.
  """
  Bsz, Tc = valid.shape
  L, C, W = grid.block_len, grid.first_block, grid.window
  decoder = decoders.with_knobs(decoder, knobs)
  # Python 0.0 keeps the argmax program; a value means this program samples (gcfg.temperature > 0).
  temperature = knobs["temperature"] if gcfg.temperature > 0 else 0.0
  smoothing = gcfg.smoothing
  cached_mode = mode in ("prefix", "dual", "block_diffusion")
  table = params["embed"]
  col = jnp.arange(Tc)
  warmup = gcfg.warmup_steps if gcfg.vicinity else 0
  # Per block: at most L commit steps, plus the refresh's owed cached step, the warm-up forwards and block
  # diffusion's final forward, all counted per row and rows can be out of step with each other.
  max_iters = 2 * (L + warmup + 2)
  rows_col = lambda x: jnp.reshape(x, (-1, 1))  # noqa: E731  a scalar or [B] per-row index, as a column

  blk_of = col // L  # canvas blocks; block diffusion keeps pads whole blocks, so these are position blocks
  if block_causal:
    full_mask = (blk_of[None, :, None] >= blk_of[None, None, :]) & valid[:, None, :]
  else:
    full_mask = valid

  def full_forward(st, s, rows_refresh):
    """Whole-canvas forward; refresh rows take its K/V into their cache. Returns the block's logits, or with
    smoothing the final-normed rows of the generation region [C, Tc): step_body takes the rows from the
    block on through the LM head (the prompt holds no mask, nor do the blocks before this one)."""
    inp = {"embeds": st["emb"]} if smoothing else {"tokens": st["canvas"]}
    lg = {"logits_start": C, "logits_len": Tc - C} if smoothing else {"logits_start": s, "logits_len": L}
    out = forward(params, mcfg, positions=positions, mask=full_mask, kv_layers=cached_mode, head=not smoothing,
                  **inp, **lg)
    new_cache = cache_lib.select_rows(rows_refresh, out.kv, st["cache"]) if cached_mode else None
    return (out.hidden if smoothing else out.logits), new_cache

  def window_forward(st, s, c0, width, key_mask, write):
    """Forward of the canvas window [c0, c0 + width) over the cache; fresh K/V where `write`. Prefix and
    dual caches: the forward writes the window's fresh K/V into the cache buffers in place (out.kv is the
    cache, to carry on instead of st["cache"]). Nothing reads those slots before they are written again:
    every cached forward of the block rewrites the same [lo, hi) before attending, and the next block's
    refresh rewrites the whole cache (rows that sit a step out, or run full warm-up forwards, refresh before
    their next cached forward). So the cache attended to equals dInfer's block-entry cache with the window
    replaced, as before, without putting the old slots back (4 fewer kernels per layer). Block diffusion
    gets the attended K/V to persist."""
    if smoothing:
      inp = {"embeds": slice_rows(st["emb"], c0, width)}
      lg = {}
    else:
      inp = {"tokens": slice_rows(st["canvas"], c0, width)}
      lg = {"logits_start": s - c0, "logits_len": L}
    return forward(params, mcfg, positions=slice_rows(positions, c0, width),
                   mask=key_mask, cache=st["cache"], cache_start=c0, write_mask=write,
                   keep_cache=mode != "block_diffusion", **inp, **lg)

  def prefix_forward(st, s, width):
    """The prefix cache's cached forward over the narrowest bucketed window that holds the block and
    everything after it (grid.windows; the iteration's switch has one branch per width), not the whole
    generation every time. With smoothing the window's logits go back to the widest window's coordinates
    (it starts at C), where the rest of the step expects them."""
    c0 = iteration.prefix_window_start(s, width, Tc)
    write = jnp.broadcast_to((c0 + jnp.arange(width) >= s)[None, :], (Bsz, width))
    out = window_forward(st, s, c0, width, valid, write)
    logits = out.logits
    if smoothing:
      logits = jax.lax.dynamic_update_slice_in_dim(
          jnp.zeros((Bsz, W, mcfg.vocab_size), logits.dtype), logits, c0 - C, axis=1)
    write = jnp.broadcast_to((C + jnp.arange(W) >= s)[None, :], (Bsz, W))
    return logits, out.kv, jnp.asarray(C, jnp.int32), write

  def body(st):
    s = C + st["block"] * L  # [] or [B]
    per_row = jnp.ndim(s) == 1
    # The prefix cache's window width for this block (one per block, not per step); rows at blocks of their
    # own take the widest.
    win = iteration.prefix_window_index(s, widths=grid.windows, gen_end=Tc) if grid.windows and not per_row else None
    windowed = mode == "prefix" and len(grid.windows) > 1 and not per_row
    blk = lambda a: slice_rows(a, s, L)  # noqa: E731
    maskable = blk(valid) & ~st["done"][:, None]
    more_after = (valid & (col[None, :] >= rows_col(s) + L)).any(axis=1)  # the row's canvas goes on after this block
    bst = dict(st)
    bst["dec"] = _init_rows(decoder, blk(st["canvas"]), maskable)
    bst["refreshed"] = jnp.zeros((Bsz,), bool)
    # dinfer_compat: the cached step dInfer owes after a refresh, run even when the refresh left no mask.
    bst["forced"] = jnp.zeros((Bsz,), bool)
    bst["final"] = jnp.zeros((Bsz,), bool)  # block diffusion's clean-K/V forward after the last commit
    bst["iters"] = jnp.zeros((), jnp.int32)
    bst = _constrain(bst)

    def cached_forward(st, rows_persist, win):
      """Window forward over the cache; block diffusion persists the fresh K/V of its rows. win: the prefix
      window's index into grid.windows (static: one switch branch per width)."""
      if windowed:
        return prefix_forward(st, s, grid.windows[win])
      if mode == "block_diffusion":
        c0, lo, hi = s, s, s + L
        key_mask = valid & (col[None, :] < rows_col(s) + L)  # the cache holds exactly the positions before the block end
      else:
        c0, lo, hi = iteration.cached_window(s, gcfg=gcfg, first_block=C, canvas_len=Tc, width=W)
        key_mask = valid
      wcol = rows_col(c0) + jnp.arange(W)
      write = jnp.broadcast_to((wcol >= rows_col(lo)) & (wcol < rows_col(hi)), (Bsz, W))
      out = window_forward(st, s, c0, W, key_mask, write)
      if mode == "block_diffusion":
        return out.logits, cache_lib.select_rows(rows_persist, out.kv, st["cache"]), c0, write
      return out.logits, out.kv, c0, write  # the cache, updated in place

    def has_masks(cv):
      return (blk(cv) == mask_id).any(axis=1) & ~st["done"]

    def step_cond(b):
      # The iteration cap is a backstop against a decoder that stops committing (every decoder commits at
      # least one token per row per step while masks remain, so it is never reached in practice): a device
      # loop that never ends would hang the whole program with no way to interrupt it.
      return (has_masks(b["canvas"]) | b["forced"] | b["final"]).any() & (b["iters"] < max_iters)

    def step_body(b, branch=None):
      """One iteration. branch: None picks the forwards at run time (a lax.switch over every combination the
      rows may need); (do_full, cached) runs that one combination, for an iteration where the caller knows
      what every active row takes (no conditional: on GPU each conditional's index is read by the host)."""
      masks_before = has_masks(b["canvas"])
      active = masks_before | b["forced"] | b["final"]
      phase = cache_lib.row_phase(cache_mode=mode, vicinity_warmup=warmup, n=b["n"], refreshed=b["refreshed"])
      use_full = active & ((phase == FULL) | (phase == REFRESH))
      use_cached = active & (phase == CACHED)
      refresh_rows = active & (phase == REFRESH)
      nb = dict(b)

      V = mcfg.vocab_size
      full_zeros = (jnp.zeros((Bsz, Tc - C, mcfg.d_model), table.dtype) if smoothing
                    else jnp.zeros((Bsz, L, V), jnp.float32))
      win_shape = (Bsz, W if smoothing else L, V)
      can_full, can_cached = mode != "block_diffusion", cached_mode

      def run_forwards(do_full: bool, cached: int | None):
        """One branch of the iteration's switch: the full forward or not, and the cached one (with the
        prefix window's index into grid.windows) or not (None)."""
        do_cached = cached is not None

        def branch(b):
          if do_full:
            fl, cache = full_forward(b, s, refresh_rows)
          else:
            fl, cache = full_zeros, b.get("cache")
          if not can_cached:
            return fl, cache
          # The cached forward reads the cache as refreshed by this iteration's full forward (a refreshing
          # row is never cached in the same iteration, so that read only matters for other rows: unchanged).
          if do_cached:
            cl, cache, c0, write = cached_forward(dict(b, cache=cache), use_cached, cached)
          else:
            c0, _, _ = iteration.cached_window(s, gcfg=gcfg, first_block=C, canvas_len=Tc, width=W) \
                if mode != "block_diffusion" else (s, s, s + L)
            cl, c0, write = jnp.zeros(win_shape, jnp.float32), jnp.asarray(c0, jnp.int32), jnp.zeros((Bsz, W), bool)
          return fl, cache, cl, c0, write
        return branch

      # One conditional per iteration, not one per forward kind (on GPU each conditional's predicate is
      # read by the host, so two of them cost two syncs per step) and not nested: XLA copies the cache
      # buffers that a nested conditional's branches update in place. Branch full * len(cacheds) + cached,
      # cached = 0 (none) or 1 + the prefix window's index; in practice every active row takes one of the
      # forwards, so (neither) is never taken.
      fulls = (False, True) if can_full else (False,)
      cacheds = (None,) + (tuple(range(len(grid.windows))) if windowed else (0,)) if can_cached else (None,)
      branches = [run_forwards(f, c) for f in fulls for c in cacheds]
      idx = jnp.zeros((), jnp.int32)
      if can_full:
        idx = idx + use_full.any().astype(jnp.int32) * len(cacheds)
      if can_cached:
        idx = idx + jnp.where(use_cached.any(), 1 + (win if windowed else 0), 0).astype(jnp.int32)
      outs = jax.lax.switch(idx, branches, b) if branch is None else run_forwards(*branch)(b)
      # Which forwards this iteration may run. Where the caller fixed the branch, the other kind's logits are
      # zeros and every use of them is dead; tracing that use anyway is not free: XLA cannot drop a
      # soft embedding of zero logits behind a runtime select, and the full canvas's (uniform probabilities
      # times the whole table: [B*Tc, V] x [V, D], ~1 ms on an H200 at 7B-A1B) ran in every cached step.
      may_full = can_full and (branch is None or branch[0])
      may_cached = can_cached and (branch is None or branch[1] is not None)
      if can_cached:
        full_out, _, cached_logits, c0, write = outs
        nb["cache"] = outs[1]
      else:
        (full_out, _), cached_logits, c0, write = outs, None, None, None

      thr = iteration.step_threshold(b["n"], gcfg, knobs["threshold"])
      keys = jax.vmap(jax.random.fold_in)(row_keys, b["n"])
      w = iteration.smooth_weight(b["n"], knobs["cont_weight"]) if smoothing else None

      def decode(b, full_logits, f0):
        """The iteration after its forwards: decode the block, commit, and (smoothing) soft-embed what is
        still masked. full_logits: the full forward's logits of canvas rows [f0, Tc) with smoothing (of the
        block without)."""
        nb = {}
        # The block's logits per row, from whichever forward the row took.
        if smoothing:
          full_blk = None if full_logits is None else slice_rows(full_logits, s - f0, L)
          cached_blk = None if cached_logits is None else slice_rows(cached_logits, s - c0, L)
        else:
          full_blk, cached_blk = full_logits, cached_logits
        if not may_cached:
          logits = full_blk
        elif not may_full:
          logits = cached_blk
        else:
          logits = jnp.where(use_full[:, None, None], full_blk, cached_blk)

        tokens = blk(b["canvas"])
        new_tokens, committed, new_dec = _decode_rows(decoder, b["dec"], logits, tokens, maskable, thr, keys,
                                                      mask_id=mask_id, temperature=temperature)
        committed = committed & active[:, None]
        new_tokens = jnp.where(active[:, None], new_tokens, tokens)
        nb["dec"] = _where_rows(active, new_dec, b["dec"])
        nb["canvas"] = update_rows(b["canvas"], new_tokens, s)
        step_idx = b["n"] + 1  # this forward's 1-based index for the row
        commit_blk = jnp.where(committed, step_idx[:, None], blk(b["commit"]))
        nb["commit"] = update_rows(b["commit"], commit_blk, s)

        if smoothing:
          masked_now = nb["canvas"] == mask_id
          emb = b["emb"]
          if may_full:
            soft_full = iteration.soft_embed(table, nb["canvas"][:, f0:], full_logits, masked_now[:, f0:], w)
            emb = emb.at[:, f0:].set(jnp.where(use_full[:, None, None], soft_full, emb[:, f0:]))
          if may_cached:
            wtok = slice_rows(nb["canvas"], c0, W)
            soft_win = iteration.soft_embed(table, wtok, cached_logits, wtok == mask_id, w)
            old_win = slice_rows(emb, c0, W)
            upd = use_cached[:, None, None] & write[:, :, None]
            emb = update_rows(emb, jnp.where(upd, soft_win, old_win), c0)
          nb["emb"] = emb
        return nb

      if not (smoothing and may_full):
        nb.update(decode(b, full_out if may_full else None, s))
      else:
        # The LM head and the soft embedding over the rows from the block on, [Tc - width, Tc) in the
        # narrowest of a few bucketed widths that holds them (iteration.tail_widths: 10.75 of 16 blocks on
        # average): the blocks before hold no mask, their embeddings are already their tokens'. Both are
        # [rows, V] x [V, D] products, a third of a batch-8 refresh at 7B-A1B. Only where every row runs the
        # full forward (the block entry, no cache) and shares the block; the step's other iterations keep
        # one width, so no conditional is added to them.
        widths = (Tc - C,)
        if not may_cached and jnp.ndim(s) == 0:
          widths = iteration.tail_widths(Tc - C, L)
        branches = [lambda bb, f0=Tc - wd: decode(bb, lm_head(params, full_out[:, f0 - C:]), f0) for wd in widths]
        rest = {k: v for k, v in b.items() if k != "cache"}  # the cache stays out of the conditional
        if len(widths) == 1:
          nb.update(branches[0](rest))
        else:
          tail = iteration.prefix_window_index(s, widths=widths, gen_end=Tc)
          nb.update(jax.lax.switch(tail, branches, rest))

      nb["iters"] = b["iters"] + 1
      nb["n"] = b["n"] + active.astype(jnp.int32)
      ran_full = use_full.any().astype(jnp.int32)
      ran_cached = use_cached.any().astype(jnp.int32)
      nb["nfe"] = b["nfe"] + ran_full + ran_cached
      nb["n_full"] = b["n_full"] + ran_full
      nb["n_cached"] = b["n_cached"] + ran_cached
      if win is not None:
        nb["n_window"] = b["n_window"].at[win].add(ran_cached)
      nb["refreshed"] = b["refreshed"] | refresh_rows
      if gcfg.dinfer_compat:
        nb["forced"] = jnp.where(refresh_rows, True, jnp.where(use_cached, False, b["forced"]))
      if mode == "block_diffusion":
        masks_after = has_masks(nb["canvas"])
        # The clean-K/V forward is for the blocks after this one: none after the last block, nor after an
        # EOS that ends the row (dinfer_compat runs it anyway).
        ends_row = (blk(nb["canvas"]) == eos_id).any(axis=1) if gcfg.early_stop else jnp.zeros((Bsz,), bool)
        wanted = jnp.full((Bsz,), True) if gcfg.dinfer_compat else more_after & ~ends_row
        nb["final"] = jnp.where(active & masks_before & ~masks_after & wanted, True,
                                jnp.where(active & ~masks_before, False, b["final"]))
      return _constrain(nb)

    def loop(b, branch=None):
      return jax.lax.while_loop(step_cond, functools.partial(step_body, branch=branch), b)

    if mode == "block_diffusion":
      bst = loop(bst)
    elif not cached_mode:  # no cache: every iteration is a full forward
      bst = loop(bst, branch=(True, None))
    else:
      # Block entry: no row has a fresh cache yet, so every active row's first forward is a full one (the
      # refresh, or a warm-up forward). Then every iteration is the cached forward, except while some row is
      # still in the vicinity warm-up (its first warmup_steps forwards are full, then it refreshes): those
      # iterations pick per step. Sequential loops, not a conditional around them (XLA copies every cache
      # buffer into a conditional whose branches update it). Host-driven, one predicate read per step (the
      # loop's condition) instead of two; the prefix cache's narrowing windows keep their per-step switch.
      bst = jax.lax.cond(step_cond(bst), functools.partial(step_body, branch=(True, None)), lambda x: x, bst)
      if warmup:
        def mixed(b):
          active = has_masks(b["canvas"]) | b["forced"]
          return (active & ((b["n"] < warmup) | ~b["refreshed"])).any()
        bst = jax.lax.while_loop(lambda b: step_cond(b) & mixed(b), step_body, bst)
      bst = loop(bst, branch=None if windowed else (False, 0))

    out = {k: bst[k] for k in st}
    # Early stop: an EOS anywhere in the finished block fills the rest of the row with EOS and ends it.
    cv = out["canvas"]
    has_eos = (blk(cv) == eos_id).any(axis=1) & blk(valid).any(axis=1) & ~st["done"]
    if gcfg.early_stop:
      fill = has_eos[:, None] & (col[None, :] >= rows_col(s) + L) & valid
      out["canvas"] = jnp.where(fill, eos_id, cv)
      out["done"] = st["done"] | has_eos
    out["block"] = st["block"] + 1
    return _constrain(out)

  return body


STATIC = ("mcfg", "gcfg", "grid", "decoder", "mode", "block_causal", "mask_id", "eos_id", "stream")

# Streaming: host callbacks of running programs, by id (the id is a traced argument, so one compiled
# program serves every stream).
_STREAMS: dict[int, Any] = {}
_STREAM_IDS = itertools.count(1)


def register_stream(fn) -> int:
  """Registers fn(block_index, canvas [B, Tc] numpy) for a program run with stream=True; returns its id."""
  sid = next(_STREAM_IDS)
  _STREAMS[sid] = fn
  return sid


def unregister_stream(sid: int) -> None:
  _STREAMS.pop(sid, None)


def _emit_block(stream_id, block, canvas) -> None:
  fn = _STREAMS.get(int(stream_id))
  if fn is not None:
    fn(int(block), np.asarray(canvas))


# XLA's GPU command buffers (CUDA graphs) hold the kinds of thunks listed; with WHILE and CONDITIONAL they also
# hold the denoising loop's while loops and its per-block conditionals, as CUDA-graph conditional nodes (CUDA
# >= 12.3): the loop's control then stays on the device, with no predicate read by the host per step. The
# other kinds are XLA's defaults for one GPU.
DEVICE_LOOP_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"


def compiler_options(backend: str | None = None) -> dict[str, str]:
  """XLA options of the engine's programs on `backend` (default: the running one): on GPU the device-driven
  loop (DEVICE_LOOP_COMMANDS) unless DINFER_JAX_DEVICE_LOOP=0 (the host-driven loop: one predicate read per
  step). A loop that calls the host (streaming's callback) stays host-driven either way."""
  backend = backend or jax.default_backend()
  if backend != "gpu" or os.environ.get("DINFER_JAX_DEVICE_LOOP", "1") == "0":
    return {}
  return {"xla_gpu_enable_command_buffer": DEVICE_LOOP_COMMANDS}


@functools.cache
def run_jit():
  """The compiled entry point. The canvas buffer is rebuilt on the host for every call and the result has
  its shape: donating it lets XLA write the output canvas in place instead of allocating a second [B, Tc]
  buffer. (CPU ignores donation and would warn, so only accelerators donate.)"""
  donate = (1,) if jax.default_backend() != "cpu" else ()
  return jax.jit(run, static_argnames=STATIC, donate_argnums=donate, compiler_options=compiler_options() or None)
