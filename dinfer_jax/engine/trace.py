"""What one trace of the generate program closes over (Trace) and one block as the step loop sees it (Block):
shared by the loop (engine.loop) and the cache policies' forwards (engine.cache_policy)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dinfer_jax.engine import iteration
from dinfer_jax.engine.cache_policy import rows_col
from dinfer_jax.engine.program import DenoiseProgram, Knobs
from dinfer_jax.engine.state import GenState
from dinfer_jax.model.layers import slice_rows
from dinfer_jax.model.transformer import forward


class Trace:
  """What one trace of the program closes over: the static program and the call's traced arguments."""

  def __init__(self, program: DenoiseProgram, params: dict, valid: jax.Array, positions: jax.Array,
               row_keys: jax.Array, knobs: Knobs):
    self.program, self.params, self.valid, self.positions, self.row_keys = program, params, valid, positions, row_keys
    self.knobs = knobs
    self.model, self.grid, self.decoder, self.policy = program.model, program.grid, program.decoder, program.cache
    self.smoothing = program.smoothing
    self.batch = valid.shape[0]
    self.col = jnp.arange(valid.shape[1])
    self.table = params["embed"]
    # Python 0.0 keeps the argmax program; the traced value when this program samples.
    self.temperature = knobs.temperature if program.sampling else 0.0
    self.full_mask = self.policy.full_mask(valid, self.grid.block_len)

  def forward(self, *args, **kw):
    return forward(self.params, self.model, *args, **kw)


class Block:
  """One block of every row, as the step loop sees it: its start s ([] on the shared grid, [B] when every row
  is at a block of its own), which rows take part, and the prefix cache's window for it."""

  def __init__(self, tr: Trace, st: GenState):
    g = tr.grid
    self.tr = tr
    self.s = g.first_block + st.block * g.block_len
    per_row = jnp.ndim(self.s) == 1
    # The prefix cache's window width for this block (one per block, not per step); rows at blocks of their
    # own take the widest.
    self.win = (iteration.prefix_window_index(self.s, widths=g.windows, gen_end=g.canvas_len)
                if g.windows and not per_row else None)
    self.windowed = len(g.windows) > 1 and not per_row
    self.done = st.done
    self.maskable = self.slice(tr.valid) & ~st.done[:, None]
    # The row's canvas goes on after this block.
    self.more_after = (tr.valid & (tr.col[None, :] >= rows_col(self.s) + g.block_len)).any(axis=1)

  def slice(self, a: jax.Array) -> jax.Array:
    return slice_rows(a, self.s, self.tr.grid.block_len)

  def has_masks(self, canvas: jax.Array) -> jax.Array:
    return (self.slice(canvas) == self.tr.program.mask_id).any(axis=1) & ~self.done

  def pending(self, canvas: jax.Array, dec) -> jax.Array:
    """[B]: the rows whose block is not done: it still holds a mask, or for a decoder that settles its blocks
    (decoders.Decoder.settles), the decoder's per-row state says so."""
    if not self.tr.decoder.settles:
      return self.has_masks(canvas)
    active = jax.vmap(lambda st, tk, mk: self.tr.decoder.block_active(st, tk[None], mk[None],
                                                                      mask_id=self.tr.program.mask_id))
    return active(dec, self.slice(canvas), self.maskable).reshape(-1) & ~self.done


