"""Continuous batching: a batch of slots whose rows each decode their own block, one block per program call.

The offline engine runs a whole generation as one program (loop.run), every row on one block grid. A
server cannot wait for that: requests arrive while others run. Here a pool's state (canvas, commit indices,
per-row forward counters, per-row block index, PRNG keys, smoothing's embeddings) stays on the device, and
one call of the step program decodes the next block of every active row (loop.block_body with per-row
blocks). Between calls the host takes finished rows out and puts waiting requests into the freed slots
(`regroup`, on the device); a new row starts at its own block 0 while the others go on with theirs.

Each row is laid out exactly as it would be alone (layout.make_layout of its prompt: the same first block
C and canvas length Tc; a pool holds the rows of one (GenerationConfig, C, Tc)), its PRNG key is the one it
would get alone, and rows never see each other (per-row masks, counters and decoder state), so its answer
equals the request run alone. The masked-diffusion caches (prefix, dual) are not carried between calls: every
block starts with a refresh forward that rewrites the row's whole cache, so the program makes it afresh.
Block diffusion (LLaDA2) keeps each row's cache across blocks: it lives in the pool's state beside the canvas,
a row that joins has its prompt prefilled in the call that starts it, and its next block's first forward
rewrites its last block's K/V (the cross-block update), as when it runs alone. With a prefix store
(engine.prefix_cache) a joining row is prefilled before the call instead, by a program of its own that
reuses the K/V of the whole prompt blocks other requests already had and computes only the blocks after
them (none when all of them hit).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import cache_policy, loop
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import bucket_rows, committed_tokens, engine_params, prepare
from dinfer_jax.engine.layout import Layout
from dinfer_jax.engine.prefix_cache import PrefixStore
from dinfer_jax.engine.program import DenoiseProgram, Knobs
from dinfer_jax.cache import KVCache
from dinfer_jax.engine.state import CACHE, ROWS, axes
from dinfer_jax.engine.trace import Trace
from dinfer_jax.model.transformer import forward


@flax.struct.dataclass
class PoolState:
  """A pool's rows on the device, [S] or [S, Tc] per field (S slots): each row's canvas, valid positions and
  RoPE positions as laid out alone, its PRNG key, commit steps, forward count, done flag, block index and
  (smoothing) soft embeddings [S, Tc, D]."""
  canvas: jax.Array = axes(ROWS)
  valid: jax.Array = axes(ROWS)
  positions: jax.Array = axes(ROWS)
  keys: jax.Array = axes(ROWS)
  commit: jax.Array = axes(ROWS)
  n: jax.Array = axes(ROWS)
  done: jax.Array = axes(ROWS)
  block: jax.Array = axes(ROWS)
  emb: jax.Array | None = axes(ROWS)
  # Block diffusion: each row's K/V, kept across calls (one buffer per layer, [S, Tc, K, H]); None otherwise.
  cache: KVCache | None = axes(CACHE)
  # [S] rows whose prompt was prefilled before the call (prefill_slot); the step prefills the other joiners.
  prefilled: jax.Array | None = axes(ROWS)


@flax.struct.dataclass
class Fresh:
  """Host-made rows for regroup: canvas, valid, positions [S, Tc], seed_key [S, 2] and key_row [S] (the row's
  PRNG key is fold_in(seed_key, key_row), as loop.run gives row key_row of a call with that seed; an
  all-invalid row is an empty slot)."""
  canvas: Any
  valid: Any
  positions: Any
  seed_key: Any
  key_row: Any


class StepCounts(NamedTuple):
  """What one step call ran: nfe, n_full, n_cached as in engine.state.Counters (rows at blocks of their own
  take the widest prefix window, so there is no per-window count)."""
  nfe: jax.Array
  n_full: jax.Array
  n_cached: jax.Array


def step(program: DenoiseProgram, params: dict, st: PoolState, knobs: Knobs) -> tuple[PoolState, StepCounts]:
  """One block of every active row: (new state, this call's counts). A row is done after its last block or
  at an EOS (early stop); done rows take part in nothing."""
  done = st.done | (st.block >= program.grid.num_blocks)
  inner = loop.init_state(program, params, st.canvas, st.valid, block=st.block)
  inner = inner.replace(commit=st.commit, n=st.n, done=done, emb=st.emb if program.smoothing else inner.emb)
  tr = Trace(program, params, st.valid, st.positions, st.keys, knobs)
  if st.cache is not None:
    # Block diffusion keeps each row's cache across blocks, so across calls: a row that just joined has its
    # prompt prefilled first (one forward for all of them; none when no row joined).
    joined = (st.block == 0) & ~done & ~st.prefilled
    inner = jax.lax.cond(joined.any(), lambda s: program.cache.prefill(tr, s, joined), lambda s: s,
                         inner.replace(cache=st.cache))
  out = loop.block_body(tr)(inner)
  new = st.replace(canvas=out.canvas, commit=out.commit, n=out.n, block=out.block,
                   done=out.done | (out.block >= program.grid.num_blocks), emb=out.emb if program.smoothing else st.emb,
                   cache=out.cache if st.cache is not None else None)
  return new, StepCounts(out.counters.nfe, out.counters.n_full, out.counters.n_cached)


def step_first(program: DenoiseProgram, rows: int, params: dict, st: PoolState,
               knobs: Knobs) -> tuple[PoolState, StepCounts]:
  """`step` over the first `rows` slots of a state of more: the pool's state keeps one shape (its capacity),
  so one regroup program serves it, while the step runs at the batch bucket of the rows in use (regroup keeps
  them first)."""
  head = jax.tree_util.tree_map(lambda a: a[:rows], st)
  new, counts = step(program, params, head, knobs)
  return jax.tree_util.tree_map(lambda a, n: a.at[:rows].set(n), st, new), counts


@functools.cache
def step_jit():
  """The step program, the DenoiseProgram and the row count its static arguments. The state is donated on
  accelerators (each call replaces it in place); CPU ignores donation."""
  donate = (3,) if jax.default_backend() != "cpu" else ()
  return jax.jit(step_first, static_argnums=(0, 1), donate_argnums=donate,
                 compiler_options=loop.compiler_options() or None)


def regroup(st: PoolState, src: jax.Array, fresh: Fresh, table: jax.Array | None) -> PoolState:
  """The next call's state: row i is the old state's row src[i], or (src[i] < 0) the fresh row i. table: the
  input embedding, for smoothing's initial embeddings (None without smoothing)."""
  valid = fresh.valid
  new = PoolState(canvas=fresh.canvas, valid=valid, positions=fresh.positions,
                  keys=jax.vmap(jax.random.fold_in)(fresh.seed_key, fresh.key_row),
                  commit=jnp.full(valid.shape, -1, jnp.int32), n=jnp.zeros(valid.shape[:1], jnp.int32),
                  done=~valid.any(axis=1), block=jnp.zeros(valid.shape[:1], jnp.int32),
                  emb=None if table is None else jnp.take(table, fresh.canvas, axis=0),
                  cache=None if st.cache is None else jax.tree_util.tree_map(jnp.zeros_like, st.cache),
                  prefilled=jnp.zeros(valid.shape[:1], bool))
  keep = src >= 0
  old = jax.tree_util.tree_map(lambda a: jnp.take(a, jnp.maximum(src, 0), axis=0), st)
  return jax.tree_util.tree_map(lambda o, v: jnp.where(keep.reshape((-1,) + (1,) * (v.ndim - 1)), o, v), old, new)


@functools.cache
def regroup_jit():
  donate = (0,) if jax.default_backend() != "cpu" else ()
  return jax.jit(regroup, donate_argnums=donate)


def prefill_slot(mcfg: ModelConfig, block_len: int, width: int, params: dict, st: PoolState, slot: jax.Array,
                 cache: KVCache) -> tuple[PoolState, KVCache]:
  """Block diffusion's prompt prefill of the row in `slot` against a prefix store (engine.prefix_cache): its
  cache columns [0, C) start from `cache` (per layer [1, C, K, H]: the blocks that hit, from the store), a
  forward of the last `width` columns of [0, C) under the block-causal mask computes the rest (none when
  width is 0: every whole prompt block hit). Returns (the state with the row's cache written and its forward
  counted, the row's K/V columns [0, C) for the store)."""
  C, L = cache.length, block_len
  row = lambda a: jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=True)
  if width:
    q0 = C - width
    canvas, positions, valid = row(st.canvas)[:, :C], row(st.positions)[:, :C], row(st.valid)[:, :C]
    mask = cache_policy.block_causal_mask(valid, q0 + jnp.arange(width), L)
    out = forward(params, mcfg, canvas[:, q0:], positions=positions[:, q0:], mask=mask, cache=cache,
                  cache_start=q0, head=False)
    cache = out.kv
  put = lambda c, n: jax.lax.dynamic_update_slice_in_dim(c, jax.lax.dynamic_update_slice_in_dim(
      row(c), n.astype(c.dtype), 0, axis=1), slot, axis=0)
  new = st.replace(cache=jax.tree_util.tree_map(put, st.cache, cache),
                   n=st.n.at[slot].add(1 if width else 0), prefilled=st.prefilled.at[slot].set(True))
  return new, cache


@functools.cache
def prefill_jit():
  """prefill_slot's program, the model config, block length and width static. The state is donated on
  accelerators (it is replaced in place)."""
  donate = (4,) if jax.default_backend() != "cpu" else ()
  return jax.jit(prefill_slot, static_argnums=(0, 1, 2), donate_argnums=donate)


@dataclasses.dataclass
class Row:
  """Host bookkeeping of one slot's row: where its prompt and generation sit on the canvas, and whose it is."""
  owner: Any
  pad: int  # canvas index of the first prompt token
  prompt_len: int
  end: int  # one past the last generated position a user reads (layout.Layout.answer_end)
  canvas: np.ndarray  # [Tc] int32, valid [Tc], positions [Tc]: the row's own layout (alone)
  valid: np.ndarray
  positions: np.ndarray
  seed_key: np.ndarray  # [2] uint32: PRNGKey(seed) of the request
  key_row: int  # the row's index among the request's rows: its key is fold_in(seed_key, key_row)

  def tokens(self, canvas_row: np.ndarray, upto: int, eos_id: int) -> list[int]:
    """The row's generated tokens committed before canvas index `upto`, cut at the first EOS."""
    return committed_tokens(canvas_row, self.pad + self.prompt_len, self.end, upto, eos_id)


@dataclasses.dataclass
class Finished:
  owner: Any
  tokens: list[int]  # before the first EOS
  gen_length: int  # generated positions of the canvas
  row_nfe: int


def seed_key(seed: int) -> np.ndarray:
  """jax.random.PRNGKey(seed)'s data made on the host (no device round trip per request): JAX without x64
  keeps the seed's low 32 bits."""
  return np.array([0, int(seed) % (1 << 32)], np.uint32)


class SlotPool:
  """The running rows of one (GenerationConfig, canvas geometry): add rows, call `step` for one block of
  each, collect the finished ones. Not thread-safe: one engine thread owns it.

  The device state has `capacity` slots whatever the rows in use: one regroup program per pool geometry;
  the rows in use are kept first and the step program runs over the batch bucket that holds them.

  Args:
    params, mcfg: the model (params stacked or per layer).
    gcfg: the generation config every row of the pool shares (its knobs are the program's runtime values).
    prompt: any prompt of the pool's geometry (see `key`).
    capacity: most rows at once (the server's max batch).
    programs: an engine.programs.ProgramCache for the step and regroup programs (default: jit's own cache).
    prefix_store: block diffusion's prefix cache across requests (engine.prefix_cache.PrefixStore, of the
      config's block length), shared with other pools of the model; None: every row prefills its prompt.
  """

  def __init__(self, params: dict, mcfg: ModelConfig, gcfg: GenerationConfig, prompt: Sequence[int], *,
               capacity: int = 16, programs=None, prefix_store: PrefixStore | None = None):
    lay, prog = prepare(mcfg, [list(prompt)], gcfg, batch_bucket=1)
    if capacity < 1:
      raise ValueError(f"SlotPool: capacity={capacity} must be >= 1")
    self.mcfg, self.gcfg, self.capacity = mcfg, gcfg, capacity
    self.params = engine_params(params, mcfg)
    self.prog = prog
    self.knobs = jax.tree_util.tree_map(jnp.asarray, Knobs.of(gcfg))
    self.grid1 = lay.grid
    self.eos_id, self.stop_ids = prog.eos_id, prog.stop_ids
    self.programs = programs
    if prefix_store is not None and (prog.cache.name != "block_diffusion" or prefix_store.block_len != lay.grid.block_len):
      raise ValueError(f"SlotPool: a prefix store serves block diffusion with block_length={prefix_store.block_len} "
                       f"(this pool: {prog.cache.name} cache, block_length={lay.grid.block_len})")
    self.store = prefix_store
    self._prefills = 0  # prefill forwards run before the next step call (its counts take them)
    self.rows: list[Row | None] = []  # slot i's row, for the slots in use
    self.state: PoolState | None = None
    self._waiting: list[Row] = []
    self._leaving: set[int] = set()

  @staticmethod
  def layout(mcfg: ModelConfig, gcfg: GenerationConfig, prompt: Sequence[int]) -> Layout:
    """The prompt's layout alone (raises the engine's ValueError for a prompt it refuses)."""
    return prepare(mcfg, [list(prompt)], gcfg, batch_bucket=1)[0]

  @staticmethod
  def key(mcfg: ModelConfig, gcfg: GenerationConfig, prompt: Sequence[int]) -> tuple:
    """Prompts with equal keys share a pool (raises the engine's ValueError for a prompt it refuses)."""
    return gcfg, SlotPool.layout(mcfg, gcfg, prompt).grid

  # ------------------------------------------------------------------ membership

  @property
  def active(self) -> int:
    """Rows running or waiting to start at the next call."""
    return sum(r is not None for i, r in enumerate(self.rows) if i not in self._leaving) + len(self._waiting)

  def add(self, owner: Any, prompt: Sequence[int], seed: int = 0, key_row: int = 0, *,
          layout: Layout | None = None) -> None:
    """Queues a row: it starts at the next `step`, sampling (if it does) as row key_row of a call seeded
    with `seed` would. layout: the prompt's SlotPool.layout, if the caller has it."""
    if self.active >= self.capacity:
      raise ValueError(f"SlotPool.add: all {self.capacity} slots are taken")
    lay = layout if layout is not None else self.layout(self.mcfg, self.gcfg, prompt)
    if lay.grid != self.grid1:
      raise ValueError(f"SlotPool.add: prompt of {len(prompt)} tokens has another canvas geometry than the pool's")
    self._waiting.append(Row(owner, int(lay.pad[0]), int(lay.prompt_len[0]), int(lay.answer_end[0]), lay.canvas[0],
                             lay.valid[0], lay.positions[0], seed_key(seed), int(key_row)))

  def remove(self, which) -> None:
    """Takes the rows whose owner `which(owner)` holds out at the next call (a cancelled request)."""
    self._waiting = [r for r in self._waiting if not which(r.owner)]
    self._leaving |= {i for i, r in enumerate(self.rows) if r is not None and which(r.owner)}

  def bucket(self, rows: int | None = None) -> int:
    """The batch bucket for this many rows (default: the active ones): a power of two, at most capacity."""
    return min(bucket_rows(max(self.active if rows is None else rows, 1)), self.capacity)

  # ------------------------------------------------------------------ programs

  def _state_shapes(self) -> PoolState:
    S, Tc = self.capacity, self.grid1.canvas_len
    sds = jax.ShapeDtypeStruct
    emb = sds((S, Tc, self.mcfg.d_model), self.params["embed"].dtype) if self.gcfg.smoothing else None
    cache = None
    if self.prog.cache.name == "block_diffusion":
      m = self.mcfg
      layer = sds((S, Tc, m.n_kv_heads, m.head_dim), self.params["embed"].dtype)
      cache = KVCache(k=(layer,) * m.n_layers, v=(layer,) * m.n_layers)
    return PoolState(canvas=sds((S, Tc), jnp.int32), valid=sds((S, Tc), bool), positions=sds((S, Tc), jnp.int32),
                     keys=sds((S, 2), jnp.uint32), commit=sds((S, Tc), jnp.int32), n=sds((S,), jnp.int32),
                     done=sds((S,), bool), block=sds((S,), jnp.int32), emb=emb, cache=cache,
                     prefilled=sds((S,), bool))

  def _fresh(self) -> Fresh:
    S, Tc = self.capacity, self.grid1.canvas_len
    return Fresh(canvas=np.full((S, Tc), self.eos_id, np.int32), valid=np.zeros((S, Tc), bool),
                 positions=np.zeros((S, Tc), np.int32), seed_key=np.zeros((S, 2), np.uint32),
                 key_row=np.zeros((S,), np.int32))

  def program_key(self, B: int) -> tuple:
    return ("slots", self.prog, self.capacity, B)

  def _regroup_key(self) -> tuple:
    return ("slots-regroup", self.prog, self.capacity)

  def _compile(self, B: int):
    return step_jit().lower(self.prog, B, self.params, self._state_shapes(), self.knobs).compile()

  def _compile_regroup(self):
    table = self.params["embed"] if self.gcfg.smoothing else None
    S = self.capacity
    return regroup_jit().lower(self._state_shapes(), jax.ShapeDtypeStruct((S,), jnp.int32), self._fresh(),
                               table).compile()

  def ready(self, B: int) -> bool:
    return self.programs is None or (self.programs.ready(self.program_key(B))
                                     and self.programs.ready(self._regroup_key()))

  def compile(self, B: int) -> bool:
    """Builds the step program for B slots and the pool's regroup program (into `programs`); returns
    whether anything had to be built."""
    if self.programs is None or self.ready(B):
      return False
    self.programs.get(self._regroup_key(), self._compile_regroup)
    self.programs.get(self.program_key(B), lambda: self._compile(B))
    return True

  def _step_program(self, B: int):
    if self.programs is None:
      return functools.partial(step_jit(), self.prog, B)
    return self.programs.get(self.program_key(B), lambda: self._compile(B))

  def _regroup_program(self):
    if self.programs is None:
      return regroup_jit()
    return self.programs.get(self._regroup_key(), self._compile_regroup)

  # ------------------------------------------------------------------ running

  def _regroup(self) -> None:
    """Leaving rows out, waiting rows in, the rows in use first (running ones in their order)."""
    if not self._waiting and not self._leaving and self.state is not None:
      return
    keep = [i for i, r in enumerate(self.rows) if r is not None and i not in self._leaving]
    fresh = self._fresh()
    src = np.full(self.capacity, -1, np.int32)
    src[:len(keep)] = keep
    rows: list[Row | None] = [self.rows[i] for i in keep]
    for j, r in enumerate(self._waiting, start=len(keep)):
      fresh.canvas[j], fresh.valid[j], fresh.positions[j] = r.canvas, r.valid, r.positions
      fresh.seed_key[j], fresh.key_row[j] = r.seed_key, r.key_row
      rows.append(r)
    state = self.state
    if state is None:  # nothing to keep: any state of the right shapes
      state = jax.tree_util.tree_map(lambda v: np.zeros(v.shape, v.dtype), self._state_shapes())
    table = self.params["embed"] if self.gcfg.smoothing else None
    self.state = self._regroup_program()(state, src, fresh, table)
    self.rows = rows
    if self.store is not None:
      for j in range(len(keep), len(rows)):
        self._prefill(j, rows[j])
    self._waiting, self._leaving = [], set()

  def _prefill(self, slot: int, r: Row) -> None:
    """The row's prompt prefill against the prefix store (prefill_slot), before the step call."""
    L, C = self.grid1.block_len, self.grid1.first_block
    first = r.pad // L
    blocks = [tuple(int(t) for t in r.canvas[r.pad + i * L:r.pad + (i + 1) * L]) for i in range(C // L - first)]
    plan = self.store.plan(blocks, first, C)
    self.state, kv = prefill_jit()(self.mcfg, L, plan.width, self.params, self.state, slot,
                                   KVCache(*self.store.read(plan)))
    self.store.write(plan, kv.k, kv.v)
    self._prefills += plan.width > 0

  def step(self, B: int | None = None) -> tuple[list[Finished], list[tuple[Any, list[int]]], dict[str, int]]:
    """Takes leaving rows out and waiting rows in, then decodes one block of every row, at batch bucket B
    (default: the bucket of the active rows). Returns (the rows that finished, each running row's (owner,
    tokens committed so far), the call's forward counts {"nfe", "n_full", "n_cached"})."""
    B = self.bucket() if B is None else B
    if B < self.active or B > self.capacity:
      raise ValueError(f"SlotPool.step: batch bucket {B} cannot hold the {self.active} rows (capacity "
                       f"{self.capacity})")
    self._prefills = 0
    self._regroup()
    self.state, counts = self._step_program(B)(self.params, self.state, self.knobs)
    # Small: all slots.
    canvas, n, done, block = (np.asarray(a) for a in (self.state.canvas, self.state.n, self.state.done,
                                                      self.state.block))
    C, L = self.grid1.first_block, self.grid1.block_len
    finished, progress = [], []
    for i, r in enumerate(self.rows):
      if done[i]:
        finished.append(Finished(r.owner, r.tokens(canvas[i], r.end, self.stop_ids), r.end - r.pad - r.prompt_len,
                                 int(n[i])))
        self._leaving.add(i)
      elif i not in self._leaving:
        progress.append((r.owner, r.tokens(canvas[i], C + int(block[i]) * L, self.stop_ids)))
    # Prefills before the call are forwards of their own (one per row that computed any block), counted as
    # the step's own prefill is: in nfe alone.
    return finished, progress, {"nfe": int(counts.nfe) + self._prefills, "n_full": int(counts.n_full),
                                "n_cached": int(counts.n_cached)}

  def drain(self) -> None:
    """Frees the device state once no row is running or waiting (the next step would drop the finished ones)."""
    if not self._waiting and all(i in self._leaving for i in range(len(self.rows))):
      self.rows, self.state, self._leaving = [], None, set()
