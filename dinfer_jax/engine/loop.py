"""The whole denoising loop as one XLA program: blocks and steps under nested lax.while_loops.

Per block, every row runs steps until its block holds no mask. A step reads: the cache policy's phase for
each row (which forward it takes) -> the policy's forwards (each kind at most once per step, batched over
the rows that need it) -> the decoder on the block's logits -> smoothing's soft embeddings -> the commit and
the counters. Rows whose block is done take no part: their tokens, counters and decoder state stay frozen,
so every row behaves exactly as if it ran alone. The state is engine.state's structs; the static side is an
engine.program.DenoiseProgram, the traced knobs an engine.program.Knobs.
"""
from __future__ import annotations

import functools
import itertools
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dinfer_jax.engine import iteration
from dinfer_jax.engine.cache_policy import CACHED, FULL, REFRESH, rows_col
from dinfer_jax.engine.program import DenoiseProgram, Knobs
from dinfer_jax.engine.state import BlockCarry, Counters, GenState, RunOutput, constrain
from dinfer_jax.engine.trace import Block, Trace
from dinfer_jax.model import quant
from dinfer_jax.model.layers import slice_rows, update_rows
from dinfer_jax.model.transformer import lm_head

# A step's forwards, fixed by the caller where it knows what every active row takes: (run the full forward,
# the cached forward's prefix-window index or None). None: picked per step at run time.
Plan = tuple[bool, "int | None"]


class Roles(NamedTuple):
  """[B] per row this step: masks_before (the block was not done: it held a mask, or its decoder had not
  settled it), active (takes part: that, or a forward owed), full (takes the full forward), cached (takes the cached one), refresh (its full forward refreshes
  its cache)."""
  masks_before: jax.Array
  active: jax.Array
  full: jax.Array
  cached: jax.Array
  refresh: jax.Array


class Schedule(NamedTuple):
  """[B] per row this step, from its forward count n: the decoder's threshold (smoothing relaxes it), the
  row's PRNG key, and smoothing's soft-embedding weight (None without smoothing)."""
  threshold: jax.Array
  keys: jax.Array
  weight: jax.Array | None


def schedule(tr: Trace, n: jax.Array) -> Schedule:
  return Schedule(iteration.step_threshold(n, tr.smoothing, tr.knobs.decoder.threshold),
                  jax.vmap(jax.random.fold_in)(tr.row_keys, n),
                  iteration.smooth_weight(n, tr.knobs.cont_weight) if tr.smoothing else None)


class Forwards(NamedTuple):
  """A step's forward outputs: full (the full forward's block logits, or with smoothing its final-normed
  generation rows; zeros where it did not run), cache, cached_logits / c0 / write (the cached forward's
  logits, window start and written positions; None without a cache)."""
  full: jax.Array
  cache: Any
  cached_logits: jax.Array | None
  c0: jax.Array | None
  write: jax.Array | None


def decode_rows(decoder, state, logits, tokens, maskable, knobs, threshold, keys, *, mask_id, temperature):
  """Runs the decoder row by row (vmap of batch-1 calls), so each row has its own threshold (the smoothing
  schedule is per row), its own decoder state and its own PRNG key."""
  def one(st, lg, tk, mk, th, key):
    nt, cm, ns = decoder.step(st, lg[None], tk[None], mk[None], knobs.replace(threshold=th), mask_id=mask_id,
                              temperature=temperature, rng=key)
    return nt[0], cm[0], ns
  return jax.vmap(one)(state, logits, tokens, maskable, threshold, keys)


def init_rows(decoder, tokens, maskable):
  return jax.vmap(lambda tk, mk: decoder.init_state(tk[None], mk[None]))(tokens, maskable)


def _where_rows(rows: jax.Array, new, old):
  """Per-row select over a pytree whose leaves have a leading batch axis."""
  def sel(a, b):
    return jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  return jax.tree_util.tree_map(sel, new, old)


# ----------------------------------------------------------------------------- one step

def roles(tr: Trace, blk: Block, b: BlockCarry) -> Roles:
  masks_before = blk.pending(b.gen.canvas, b.dec)
  active = masks_before | b.owed
  phase = tr.policy.phase(b.gen.n, b.refreshed)
  return Roles(masks_before, active, active & ((phase == FULL) | (phase == REFRESH)), active & (phase == CACHED),
               active & (phase == REFRESH))


def run_forwards(tr: Trace, blk: Block, b: BlockCarry, r: Roles, plan: Plan | None) -> Forwards:
  """The step's forwards. plan None picks them at run time: one switch over every combination the rows may
  need, not one conditional per forward kind (on GPU each conditional's predicate is read by the host, so two
  cost two syncs per step) and not nested ones (XLA copies the cache buffers that a nested conditional's
  branches update in place). Branch full * len(cacheds) + cached, cached = 0 (none) or 1 + the prefix window's
  index; in practice every active row takes one of the forwards, so (neither) is never taken."""
  pol, g = tr.policy, tr.grid
  if plan is not None:
    return _plan(tr, blk, r, *plan)(b)
  fulls = (False, True) if pol.has_full else (False,)
  cacheds = ((None,) + (tuple(range(len(g.windows))) if blk.windowed else (0,))) if pol.has_cache else (None,)
  idx = jnp.zeros((), jnp.int32)
  if pol.has_full:
    idx = idx + r.full.any().astype(jnp.int32) * len(cacheds)
  if pol.has_cache:
    idx = idx + jnp.where(r.cached.any(), 1 + (blk.win if blk.windowed else 0), 0).astype(jnp.int32)
  return Forwards(*jax.lax.switch(idx, [_plan(tr, blk, r, f, c) for f in fulls for c in cacheds], b))


def _plan(tr: Trace, blk: Block, r: Roles, do_full: bool, cached: int | None) -> Callable[[BlockCarry], Forwards]:
  """One combination of forwards: the full one or not, and the cached one (with the prefix window's index
  into grid.windows) or not (None). What did not run is zeros."""
  pol, g, B, V = tr.policy, tr.grid, tr.batch, tr.model.vocab_size

  def branch(b: BlockCarry) -> Forwards:
    st = b.gen
    if do_full:
      fl, cache = pol.full_forward(tr, blk, st, r.refresh)
    else:
      fl = (jnp.zeros((B, g.canvas_len - g.first_block, tr.model.d_model), tr.table.dtype) if tr.smoothing
            else jnp.zeros((B, g.block_len, V), jnp.float32))
      cache = st.cache
    if not pol.has_cache:
      return Forwards(fl, cache, None, None, None)
    # The cached forward reads the cache as refreshed by this step's full forward (a refreshing row is never
    # cached in the same step, so that read only matters for other rows: unchanged).
    if cached is not None:
      logits, cache, c0, write = pol.cached_forward(tr, blk, st.replace(cache=cache), r.cached, cached)
      return Forwards(fl, cache, logits, c0, write)
    c0, _, _ = pol.window(tr, blk.s)
    zeros = jnp.zeros((B, g.window if tr.smoothing else g.block_len, V), jnp.float32)
    return Forwards(fl, cache, zeros, jnp.asarray(c0, jnp.int32), jnp.zeros((B, g.window), bool))
  return branch


class Update(NamedTuple):
  """What a step's decode writes: the decoder state, canvas, commit steps and (smoothing) embeddings."""
  dec: Any
  canvas: jax.Array
  commit: jax.Array
  emb: jax.Array | None


def decode(tr: Trace, blk: Block, b: BlockCarry, r: Roles, sc: Schedule, fw: Forwards, may: tuple[bool, bool],
           full_logits: jax.Array | None, f0: int | jax.Array) -> Update:
  """The step after its forwards: decode the block, commit, and (smoothing) soft-embed what is still masked.
  full_logits: the full forward's logits of canvas rows [f0, Tc) with smoothing (of the block without);
  may: (the full forward may have run, the cached one may have run) in this step."""
  may_full, may_cached = may
  st, p = b.gen, tr.program
  if tr.smoothing:
    full_blk = None if full_logits is None else slice_rows(full_logits, blk.s - f0, tr.grid.block_len)
    cached_blk = None if fw.cached_logits is None else slice_rows(fw.cached_logits, blk.s - fw.c0, tr.grid.block_len)
  else:
    full_blk, cached_blk = full_logits, fw.cached_logits
  if not may_cached:
    logits = full_blk
  elif not may_full:
    logits = cached_blk
  else:
    logits = jnp.where(r.full[:, None, None], full_blk, cached_blk)

  tokens = blk.slice(st.canvas)
  new_tokens, committed, new_dec = decode_rows(tr.decoder, b.dec, logits, tokens, blk.maskable, tr.knobs.decoder,
                                               sc.threshold, sc.keys, mask_id=p.mask_id, temperature=tr.temperature)
  committed = committed & r.active[:, None]
  new_tokens = jnp.where(r.active[:, None], new_tokens, tokens)
  canvas = update_rows(st.canvas, new_tokens, blk.s)
  step_idx = st.n + 1  # this forward's 1-based index for the row
  commit = update_rows(st.commit, jnp.where(committed, step_idx[:, None], blk.slice(st.commit)), blk.s)
  emb = smooth(tr, b, r, sc, fw, may, canvas, full_logits, f0) if tr.smoothing else st.emb
  return Update(_where_rows(r.active, new_dec, b.dec), canvas, commit, emb)


def smooth(tr: Trace, b: BlockCarry, r: Roles, sc: Schedule, fw: Forwards, may: tuple[bool, bool],
           canvas: jax.Array, full_logits: jax.Array | None, f0: int | jax.Array) -> jax.Array:
  """Iteration smoothing: the positions each forward saw get E[x] + w * softmax(z) @ E where still masked."""
  may_full, may_cached = may
  W, mask_id = tr.grid.window, tr.program.mask_id
  w, emb = sc.weight, b.gen.emb
  if may_full:
    soft_full = iteration.soft_embed(tr.table, canvas[:, f0:], full_logits, (canvas == mask_id)[:, f0:], w)
    emb = emb.at[:, f0:].set(jnp.where(r.full[:, None, None], soft_full, emb[:, f0:]))
  if may_cached:
    wtok = slice_rows(canvas, fw.c0, W)
    soft_win = iteration.soft_embed(tr.table, wtok, fw.cached_logits, wtok == mask_id, w)
    upd = r.cached[:, None, None] & fw.write[:, :, None]
    emb = update_rows(emb, jnp.where(upd, soft_win, slice_rows(emb, fw.c0, W)), fw.c0)
  return emb


def decode_step(tr: Trace, blk: Block, b: BlockCarry, r: Roles, sc: Schedule, fw: Forwards,
                may: tuple[bool, bool]) -> Update:
  """decode, with smoothing's LM head where the full forward ran: over the rows from the block on,
  [Tc - width, Tc) in the narrowest of a few bucketed widths that holds them (iteration.tail_widths: 10.75 of
  16 blocks on average): the blocks before hold no mask, their embeddings are already their tokens'. Both the
  head and the soft embedding are [rows, V] x [V, D] products, a third of a batch-8 refresh at 7B-A1B. Only
  where every row runs the full forward (the block entry, no cache) and shares the block; the step's other
  iterations keep one width, so no conditional is added to them."""
  may_full, may_cached = may
  if not (tr.smoothing and may_full):
    return decode(tr, blk, b, r, sc, fw, may, fw.full if may_full else None, blk.s)
  g = tr.grid
  C, Tc = g.first_block, g.canvas_len
  widths = (Tc - C,)
  if not may_cached and jnp.ndim(blk.s) == 0:
    widths = iteration.tail_widths(Tc - C, g.block_len)
  branches = [lambda bb, f0=Tc - wd: decode(tr, blk, bb, r, sc, fw, may, lm_head(tr.params, fw.full[:, f0 - C:]),
                                            f0) for wd in widths]
  rest = b.replace(gen=b.gen.replace(cache=None))  # the cache stays out of the conditional
  if len(widths) == 1:
    return branches[0](rest)
  return jax.lax.switch(iteration.prefix_window_index(blk.s, widths=widths, gen_end=Tc), branches, rest)


def step(tr: Trace, blk: Block, b: BlockCarry, plan: Plan | None) -> BlockCarry:
  """One iteration: phase -> the policy's forwards -> decode -> smoothing -> commit, then the counters."""
  pol = tr.policy
  r = roles(tr, blk, b)
  fw = run_forwards(tr, blk, b, r, plan)
  # Which forwards this step may run. Where the plan fixed them, the other kind's logits are zeros and every
  # use of them is dead; tracing that use anyway is not free: XLA cannot drop a soft embedding of zero logits
  # behind a runtime select, and the full canvas's (uniform probabilities times the whole table: [B*Tc, V] x
  # [V, D], ~1 ms on an H200 at 7B-A1B) ran in every cached step.
  may = (pol.has_full and (plan is None or plan[0]), pol.has_cache and (plan is None or plan[1] is not None))
  up = decode_step(tr, blk, b, r, schedule(tr, b.gen.n), fw, may)
  ran_full, ran_cached = r.full.any().astype(jnp.int32), r.cached.any().astype(jnp.int32)
  c = b.gen.counters
  counters = c.replace(nfe=c.nfe + ran_full + ran_cached, n_full=c.n_full + ran_full,
                       n_cached=c.n_cached + ran_cached,
                       n_window=c.n_window if blk.win is None else c.n_window.at[blk.win].add(ran_cached))
  gen = b.gen.replace(canvas=up.canvas, commit=up.commit, emb=up.emb, n=b.gen.n + r.active.astype(jnp.int32),
                      counters=counters, cache=fw.cache if pol.has_cache else b.gen.cache)
  return constrain(BlockCarry(gen=gen, dec=up.dec, refreshed=b.refreshed | r.refresh,
                              owed=pol.owed_after(tr, blk, b.owed, r, up.canvas), iters=b.iters + 1))


class Steps:
  """The step loop of one block, as a cache policy lays it out (CachePolicy.run_steps)."""

  def __init__(self, tr: Trace, blk: Block):
    self.tr, self.blk = tr, blk
    # Per block: at most L commit steps (a settling decoder's own bound), plus the refresh's owed cached step,
    # the warm-up forwards and block diffusion's final forward, all counted per row and rows can be out of step
    # with each other.
    self.max_iters = 2 * (tr.decoder.max_steps(tr.grid.block_len) + tr.policy.warmup_steps + 2)

  def cond(self, b: BlockCarry) -> jax.Array:
    # The iteration cap is a backstop against a decoder that stops committing (every decoder commits at least
    # one token per row per step while masks remain, so it is never reached in practice): a device loop that
    # never ends would hang the whole program with no way to interrupt it.
    return (self.blk.pending(b.gen.canvas, b.dec) | b.owed).any() & (b.iters < self.max_iters)

  def in_warmup(self, b: BlockCarry) -> jax.Array:
    """Some active row is still in the vicinity warm-up or has not refreshed yet: its forward is picked."""
    active = self.blk.pending(b.gen.canvas, b.dec) | b.owed
    return (active & ((b.gen.n < self.tr.policy.warmup_steps) | ~b.refreshed)).any()

  def step(self, b: BlockCarry, plan: Plan | None) -> BlockCarry:
    return step(self.tr, self.blk, b, plan)

  def loop(self, b: BlockCarry, plan: Plan | None, also: Callable[[BlockCarry], jax.Array] | None = None):
    cond = self.cond if also is None else (lambda c: self.cond(c) & also(c))
    return jax.lax.while_loop(cond, functools.partial(self.step, plan=plan), b)


# ----------------------------------------------------------------------------- one block, the whole program

def block_body(tr: Trace) -> Callable[[GenState], GenState]:
  """The function that decodes one block of every row: GenState -> GenState, run by `run`'s block loop and,
  one call per program, by continuous batching (engine.slots). With a scalar block index every row's block
  starts at the same canvas index (layout's shared grid); with [B] each row's block is its own, and slices of
  the canvas, the logits and the cache window are taken per row (gathers instead of dynamic slices). Rows
  whose `done` is set take no part."""
  def body(st: GenState) -> GenState:
    blk = Block(tr, st)
    carry = constrain(BlockCarry(gen=st, dec=init_rows(tr.decoder, blk.slice(st.canvas), blk.maskable),
                                 refreshed=jnp.zeros((tr.batch,), bool), owed=jnp.zeros((tr.batch,), bool),
                                 iters=jnp.zeros((), jnp.int32)))
    carry = tr.policy.run_steps(Steps(tr, blk), carry)
    return end_block(tr, blk, st, carry.gen)
  return body


def end_block(tr: Trace, blk: Block, st: GenState, out: GenState) -> GenState:
  """Early stop: an EOS (any stop token) anywhere in the finished block fills the rest of the row with EOS and
  ends it."""
  p, L = tr.program, tr.grid.block_len
  if p.early_stop:
    has_eos = p.is_stop(blk.slice(out.canvas)).any(axis=1) & blk.slice(tr.valid).any(axis=1) & ~st.done
    fill = has_eos[:, None] & (tr.col[None, :] >= rows_col(blk.s) + L) & tr.valid
    out = out.replace(canvas=jnp.where(fill, p.eos_id, out.canvas), done=st.done | has_eos)
  return constrain(out.replace(block=st.block + 1))


def init_state(program: DenoiseProgram, params: dict, canvas: jax.Array, valid: jax.Array,
               block: jax.Array | None = None) -> GenState:
  """The block loop's carry before the first block: block a scalar (the offline loop's shared block grid) or,
  given as [B], one block index per row (continuous batching)."""
  B, Tc = canvas.shape
  mcfg = program.model
  return constrain(GenState(
      canvas=canvas, commit=jnp.full((B, Tc), -1, jnp.int32), n=jnp.zeros((B,), jnp.int32),
      done=~valid.any(axis=1), block=jnp.zeros((), jnp.int32) if block is None else block,
      counters=Counters.zeros(len(program.grid.windows)),
      emb=quant.take_rows(params["embed"], canvas) if program.smoothing else None,
      cache=program.cache.init_cache(mcfg, B, Tc, params["embed"].dtype) if program.cache.has_cache else None))


def run(program: DenoiseProgram, params: dict, canvas: jax.Array, valid: jax.Array, positions: jax.Array,
        seed: jax.Array, knobs: Knobs, stream_id: jax.Array | None = None) -> RunOutput:
  """The jitted body (see engine.generate for the host side).

  Args:
    program: the static side (jit static argument).
    canvas [B, Tc] int32, valid [B, Tc] bool, positions [B, Tc] int32: from layout.make_layout.
    seed: a PRNG key.
    knobs: Knobs.of(gcfg) (traced scalars): one program serves every value.
    stream_id: with program.stream, every finished block's canvas goes to the host callback registered under
      this id (register_stream) while the program runs.
  """
  B = canvas.shape[0]
  row_keys = jax.vmap(lambda r: jax.random.fold_in(seed, r))(jnp.arange(B))
  tr = Trace(program, params, valid, positions, row_keys, knobs)
  st = program.cache.prefill(tr, init_state(program, params, canvas, valid))
  body = block_body(tr)

  def one_block(st: GenState) -> GenState:
    out = body(st)
    if program.stream:  # the block is final: hand it to the host now, not when the whole program returns
      io_callback(_emit_block, None, stream_id, st.block, out.canvas, ordered=True)
    return out

  st = jax.lax.while_loop(lambda st: (st.block < program.grid.num_blocks) & ~st.done.all(), one_block, st)
  return RunOutput(canvas=st.canvas, commit=st.commit, row_nfe=st.n, counters=st.counters)


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
  """The compiled entry point, the DenoiseProgram its static argument. The canvas buffer is rebuilt on the
  host for every call and the result has its shape: donating it lets XLA write the output canvas in place
  instead of allocating a second [B, Tc] buffer. (CPU ignores donation and would warn, so only accelerators
  donate.)"""
  donate = (2,) if jax.default_backend() != "cpu" else ()
  return jax.jit(run, static_argnums=0, donate_argnums=donate, compiler_options=compiler_options() or None)
