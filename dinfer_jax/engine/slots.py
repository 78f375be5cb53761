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
equals the request run alone. The KV cache is not carried between calls: every block starts with a refresh
forward that rewrites the row's whole cache (no, prefix and dual cache), so the program makes it afresh.
Block diffusion (LLaDA2), whose cache persists across blocks, is not served here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.config import ModelConfig
from dinfer_jax.engine import loop
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import (bucket_rows, count_generated, inference_params, prepare, program)
from dinfer_jax.engine.layout import Layout



def step(params: dict, st: dict[str, jax.Array], knobs: dict[str, jax.Array], *, mcfg: ModelConfig,
         gcfg: GenerationConfig, grid, decoder, mode: str, block_causal: bool, mask_id: int,
         eos_id: int) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """One block of every active row: (new state, {"nfe", "n_full", "n_cached"} of this call). A row is done
  after its last block or at an EOS (early stop); done rows take part in nothing."""
  done = st["done"] | (st["block"] >= grid.num_blocks)
  inner = loop.init_state(params, st["canvas"], st["valid"], mcfg=mcfg, gcfg=gcfg, grid=grid, mode=mode,
                          block=st["block"])
  inner.update(commit=st["commit"], n=st["n"], done=done)
  if gcfg.smoothing:
    inner["emb"] = st["emb"]
  body = loop.block_body(params, st["valid"], st["positions"], st["keys"], knobs, mcfg=mcfg, gcfg=gcfg,
                         grid=grid, decoder=decoder, mode=mode, block_causal=block_causal, mask_id=mask_id,
                         eos_id=eos_id)
  out = body(inner)
  new = dict(st, canvas=out["canvas"], commit=out["commit"], n=out["n"], block=out["block"],
             done=out["done"] | (out["block"] >= grid.num_blocks))
  if gcfg.smoothing:
    new["emb"] = out["emb"]
  return new, {k: out[k] for k in ("nfe", "n_full", "n_cached")}


STEP_STATIC = ("mcfg", "gcfg", "grid", "decoder", "mode", "block_causal", "mask_id", "eos_id")


@functools.cache
def step_jit():
  """The step program. The state is donated on accelerators (each call replaces it); CPU ignores donation."""
  donate = (1,) if jax.default_backend() != "cpu" else ()
  return jax.jit(step, static_argnames=STEP_STATIC, donate_argnums=donate)


def regroup(st: dict[str, jax.Array] | None, src: jax.Array, fresh: dict[str, jax.Array],
            table: jax.Array | None) -> dict[str, jax.Array]:
  """The next call's state: row i is the old state's row src[i], or (src[i] < 0) the fresh row i
  (fresh: canvas, valid, positions [B', Tc], keys [B', 2]; an all-invalid row is an empty slot).
  table: the input embedding, for smoothing's initial embeddings (None without smoothing)."""
  valid = fresh["valid"]
  new = {"canvas": fresh["canvas"], "valid": valid, "positions": fresh["positions"], "keys": fresh["keys"],
         "commit": jnp.full(valid.shape, -1, jnp.int32), "n": jnp.zeros(valid.shape[:1], jnp.int32),
         "done": ~valid.any(axis=1), "block": jnp.zeros(valid.shape[:1], jnp.int32)}
  if table is not None:
    new["emb"] = jnp.take(table, fresh["canvas"], axis=0)
  if st is None:
    return new
  keep = src >= 0
  old = jax.tree_util.tree_map(lambda a: jnp.take(a, jnp.maximum(src, 0), axis=0), st)
  return {k: jnp.where(keep.reshape((-1,) + (1,) * (v.ndim - 1)), old[k], v) for k, v in new.items()}


regroup_jit = jax.jit(regroup)


@dataclasses.dataclass
class Row:
  """Host bookkeeping of one slot's row: where its prompt and generation sit on the canvas, and whose it is."""
  owner: Any
  pad: int  # canvas index of the first prompt token
  prompt_len: int
  end: int  # one past the last generated position
  canvas: np.ndarray  # [Tc] int32, valid [Tc], positions [Tc]: the row's own layout (alone)
  valid: np.ndarray
  positions: np.ndarray
  key: np.ndarray  # [2] uint32

  def tokens(self, canvas_row: np.ndarray, upto: int, eos_id: int) -> list[int]:
    """The row's generated tokens committed before canvas index `upto`, cut at the first EOS."""
    start, end = self.pad + self.prompt_len, min(self.end, upto)
    gen = canvas_row[start:end].tolist() if end > start else []
    return gen[:count_generated(gen, eos_id)]


@dataclasses.dataclass
class Finished:
  owner: Any
  tokens: list[int]  # before the first EOS
  gen_length: int  # generated positions of the canvas
  row_nfe: int


def row_key(seed: int, r: int) -> np.ndarray:
  """The PRNG key row r of a seeded batch gets in loop.run: what the row must get here to sample the same."""
  return np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), r))


class SlotPool:
  """The running rows of one (GenerationConfig, canvas geometry): add rows, call `step` for one block of
  each, collect the finished ones. Not thread-safe: one engine thread owns it.

  Args:
    params, mcfg: the model (params stacked or per layer).
    gcfg: the generation config every row of the pool shares (its knobs are the program's runtime values).
    prompt: any prompt of the pool's geometry (see `key`).
    programs: an engine.programs.ProgramCache for the step programs (default: jit's own cache).
  """

  def __init__(self, params: dict, mcfg: ModelConfig, gcfg: GenerationConfig, prompt: Sequence[int], *,
               programs=None):
    lay, static = prepare(mcfg, [list(prompt)], gcfg, batch_bucket=1)
    if static["mode"] == "block_diffusion":
      raise ValueError("continuous batching: block diffusion (LLaDA2 with a cache) keeps its cache across "
                       "blocks and is not supported; serve it with --batching window")
    self.mcfg, self.gcfg = mcfg, gcfg
    self.params = inference_params(params, mcfg)
    self.prog, knobs = program(static, mcfg.vocab_size)
    self.knobs = {k: jnp.asarray(v) for k, v in knobs.items()}
    self.grid1 = lay.grid
    self.eos_id = static["eos_id"]
    self.programs = programs
    self.rows: list[Row | None] = []
    self.state: dict[str, jax.Array] | None = None
    self._waiting: list[Row] = []
    self._leaving: set[int] = set()

  @staticmethod
  def key(mcfg: ModelConfig, gcfg: GenerationConfig, prompt: Sequence[int]) -> tuple:
    """Prompts with equal keys share a pool (raises the engine's ValueError for a prompt it refuses)."""
    lay, _ = prepare(mcfg, [list(prompt)], gcfg, batch_bucket=1)
    return gcfg, lay.grid

  # ------------------------------------------------------------------ membership

  @property
  def active(self) -> int:
    """Rows running or waiting to start at the next call."""
    return sum(r is not None for i, r in enumerate(self.rows) if i not in self._leaving) + len(self._waiting)

  def add(self, owner: Any, prompt: Sequence[int], key: np.ndarray) -> None:
    """Queues a row: it starts at the next `step`."""
    lay: Layout = prepare(self.mcfg, [list(prompt)], self.gcfg, batch_bucket=1)[0]
    if lay.grid != self.grid1:
      raise ValueError(f"SlotPool.add: prompt of {len(prompt)} tokens has another canvas geometry than the pool's")
    self._waiting.append(Row(owner, int(lay.pad[0]), int(lay.prompt_len[0]), int(lay.end[0]), lay.canvas[0],
                             lay.valid[0], lay.positions[0], np.asarray(key, np.uint32)))

  def remove(self, which) -> None:
    """Takes the rows whose owner `which(owner)` holds out at the next call (a cancelled request)."""
    self._waiting = [r for r in self._waiting if not which(r.owner)]
    self._leaving |= {i for i, r in enumerate(self.rows) if r is not None and which(r.owner)}

  def bucket(self, rows: int | None = None) -> int:
    return bucket_rows(max(self.active if rows is None else rows, 1))

  # ------------------------------------------------------------------ programs

  def _state_shapes(self, B: int) -> dict[str, jax.ShapeDtypeStruct]:
    Tc = self.grid1.canvas_len
    sds = jax.ShapeDtypeStruct
    shapes = {"canvas": sds((B, Tc), jnp.int32), "commit": sds((B, Tc), jnp.int32), "valid": sds((B, Tc), bool),
              "positions": sds((B, Tc), jnp.int32), "keys": sds((B, 2), jnp.uint32), "n": sds((B,), jnp.int32),
              "done": sds((B,), bool), "block": sds((B,), jnp.int32)}
    if self.gcfg.smoothing:
      shapes["emb"] = sds((B, Tc, self.mcfg.d_model), self.params["embed"].dtype)
    return shapes

  def program_key(self, B: int) -> tuple:
    return ("slots", tuple(sorted(self.prog.items())), B, self.grid1.canvas_len)

  def _static(self, B: int) -> dict[str, Any]:
    return dict(self.prog, grid=dataclasses.replace(self.prog["grid"], batch=B))

  def _compile(self, B: int):
    return step_jit().lower(self.params, self._state_shapes(B), self.knobs, **self._static(B)).compile()

  def ready(self, B: int) -> bool:
    return self.programs is None or self.programs.ready(self.program_key(B))

  def compile(self, B: int) -> bool:
    """Builds the step program for B slots (into `programs`); returns whether it had to be built."""
    if self.programs is None or self.programs.ready(self.program_key(B)):
      return False
    self.programs.get(self.program_key(B), lambda: self._compile(B))
    return True

  def _program(self, B: int):
    if self.programs is None:
      return functools.partial(step_jit(), **self._static(B))
    return self.programs.get(self.program_key(B), lambda: self._compile(B))

  # ------------------------------------------------------------------ running

  def _regroup(self, B: int) -> None:
    """Leaving rows out, waiting rows in, the state at B slots (running rows first, in their order)."""
    keep = [i for i, r in enumerate(self.rows) if r is not None and i not in self._leaving]
    if len(keep) + len(self._waiting) > B:
      raise ValueError(f"SlotPool: {len(keep) + len(self._waiting)} rows do not fit {B} slots")
    if not self._waiting and not self._leaving and B == len(self.rows):
      return
    Tc = self.grid1.canvas_len
    fresh = {"canvas": np.full((B, Tc), self.eos_id, np.int32), "valid": np.zeros((B, Tc), bool),
             "positions": np.zeros((B, Tc), np.int32), "keys": np.zeros((B, 2), np.uint32)}
    src = np.full(B, -1, np.int32)
    src[:len(keep)] = keep
    rows: list[Row | None] = [self.rows[i] for i in keep]
    for j, r in enumerate(self._waiting, start=len(keep)):
      fresh["canvas"][j], fresh["valid"][j], fresh["positions"][j], fresh["keys"][j] = \
          r.canvas, r.valid, r.positions, r.key
      rows.append(r)
    table = self.params["embed"] if self.gcfg.smoothing else None
    self.state = regroup_jit(self.state, jnp.asarray(src), {k: jnp.asarray(v) for k, v in fresh.items()}, table)
    self.rows = rows + [None] * (B - len(rows))
    self._waiting, self._leaving = [], set()

  def step(self, B: int | None = None) -> tuple[list[Finished], list[tuple[Any, list[int]]], dict[str, int]]:
    """Regroups to B slots (default: the bucket of the active rows) and decodes one block of every row.
    Returns (the rows that finished, each running row's (owner, tokens committed so far), the call's
    forward counts {"nfe", "n_full", "n_cached"})."""
    B = self.bucket() if B is None else B
    self._regroup(B)
    self.state, counts = self._program(B)(self.params, self.state, self.knobs)
    host = {k: np.asarray(self.state[k]) for k in ("canvas", "n", "done", "block")}
    C, L = self.grid1.first_block, self.grid1.block_len
    finished, progress = [], []
    for i, r in enumerate(self.rows):
      if r is None:
        continue
      row = host["canvas"][i]
      if host["done"][i]:
        finished.append(Finished(r.owner, r.tokens(row, r.end, self.eos_id), r.end - r.pad - r.prompt_len,
                                 int(host["n"][i])))
        self._leaving.add(i)
      else:
        progress.append((r.owner, r.tokens(row, C + int(host["block"][i]) * L, self.eos_id)))
    return finished, progress, {k: int(v) for k, v in counts.items()}

  def drain(self) -> None:
    """Drops the finished rows' slots now (the next step would); an empty pool frees its state."""
    if self._leaving and all(r is None or i in self._leaving for i, r in enumerate(self.rows)) and not self._waiting:
      self.rows, self.state, self._leaving = [], None, set()
