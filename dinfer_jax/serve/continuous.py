"""Continuous batching at block boundaries (`serve --batching continuous`, the default).

The running batch is a set of slots (engine.slots.SlotPool, one pool per generation config and canvas
geometry): the engine thread decodes one block of every row of a pool per program call, and between calls
a finished row leaves at once (its answer goes out) and a waiting request takes a free slot, starting at its
own first block while the others go on with theirs. The batch state stays on the device between blocks;
only each row's canvas, counters and done flag are read back per call (one host sync per block, which is
also how streaming requests get each block as it settles).

Each call goes to the pool that holds the oldest request in flight (first come, first served at block
granularity), each pool with at most max_batch rows (one call never decodes more). A pool
runs at the smallest compiled batch bucket that holds its rows (rows cost compute on every forward, so 1
request alone runs at batch 1); a bucket that is not compiled yet compiles on a second thread while the pool
goes on at a bigger one, or waits if it has none. Requests are admitted in arrival order; a request that
does not fit its pool waits, and no later request of that pool passes it.

Block diffusion (LLaDA2) reuses prompt K/V across requests when given a byte budget (`serve
--prefix-cache-mb`): one engine.prefix_cache.PrefixStore per block length, shared by the pools of that
length; a joining row's whole prompt blocks that another request already had are copied into its slot and
only the blocks after them are prefilled.

Sampled requests (temperature > 0) put their n choices into n rows with the PRNG keys rows 0..n-1 of a
call seeded with the request's seed would get, so each choice equals the request run alone.
"""
from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any

from dinfer_jax.engine import cache_policy
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.prefix_cache import PrefixStats, PrefixStore
from dinfer_jax.engine.slots import SlotPool
from dinfer_jax.serve.batcher import Batcher, BatchStats, Choice, Job, batch_buckets


@dataclasses.dataclass(eq=False)
class _Run:
  """A job whose rows are in slots."""
  job: Job
  pool: Any
  key: tuple  # the pool's
  choices: list[Choice | None]
  progress: list[list[int]]

  @property
  def left(self) -> int:
    return sum(c is None for c in self.choices)


class ContinuousBatcher(Batcher):
  """Slots refilled at block boundaries (see the module docstring); the arguments are Batcher's, and
  prefix_cache_mb: block diffusion's prefix cache budget per block length in MiB (0: off)."""
  kind = "continuous"

  def __init__(self, model, *, prefix_cache_mb: float = 0.0, **kw):
    super().__init__(model, **kw)
    if not prefix_cache_mb >= 0:
      raise ValueError(f"ContinuousBatcher: prefix_cache_mb={prefix_cache_mb} must be >= 0")
    self.prefix_cache_bytes = int(prefix_cache_mb * 2**20)
    self._stores: dict[int, PrefixStore] = {}  # block length -> its store (made by the engine thread's first pool)
    self._pools: dict[tuple, SlotPool] = {}
    self._runs: dict[Job, _Run] = {}
    self._keys: dict[Job, Any] = {}  # waiting job -> its layout alone (engine.slots.SlotPool.layout)
    self._compile_q: queue.Queue[tuple[SlotPool, int]] = queue.Queue()
    self._compiling: set[tuple] = set()
    self._failed: dict[tuple, BaseException] = {}  # program key -> why it did not compile
    self.buckets = batch_buckets(self.max_batch)

  def _workers(self):
    return [("dinfer-batcher", self._loop), ("dinfer-compile", self._compile_loop)]

  def _new_pool(self, gcfg: GenerationConfig, prompt, *, store: bool = True) -> SlotPool:
    """A pool for gcfg's prompts like `prompt`; store=False (compile-only pools of other threads) never
    makes a prefix store."""
    mcfg = self.model.config
    ps = None
    if store and self.prefix_cache_bytes and cache_policy.for_config(mcfg, gcfg).name == "block_diffusion":
      L = gcfg.block_length
      ps = self._stores.get(L)
      if ps is None:
        ps = self._stores[L] = PrefixStore(mcfg, L, self.model.params["embed"].dtype, self.prefix_cache_bytes)
    return SlotPool(self.model.params, mcfg, gcfg, prompt, capacity=self.max_batch, programs=self.programs,
                    prefix_store=ps)

  def _compile_spec(self, gcfg, prompt, bucket) -> bool:
    return self._new_pool(gcfg, prompt, store=False).compile(bucket)

  def prefix_stats(self) -> tuple[PrefixStats, int] | None:
    """The prefix stores' counts summed and their bytes in use (None without a prefix cache)."""
    if not self.prefix_cache_bytes or not self.model.config.block_diffusion:
      return None
    total = PrefixStats()
    for st in list(self._stores.values()):
      for f in dataclasses.fields(PrefixStats):
        setattr(total, f.name, getattr(total, f.name) + getattr(st.stats, f.name))
    return total, sum(s.used_bytes for s in list(self._stores.values()))

  # ------------------------------------------------------------------ compile thread

  def _request_compile(self, pool: SlotPool, B: int) -> None:
    k = pool.program_key(B)
    if k not in self._compiling and k not in self._failed:
      self._compiling.add(k)
      self._compile_q.put((pool, B))

  def _compile_loop(self) -> None:
    while not self._stop.is_set():
      try:
        pool, B = self._compile_q.get(timeout=0.1)
      except queue.Empty:
        continue
      k = pool.program_key(B)
      try:
        pool.compile(B)
      except Exception as e:  # the jobs waiting for it fail with this; the worker goes on
        self._failed[k] = e
      finally:
        self._compiling.discard(k)

  def _bucket(self, pool: SlotPool, rows: int) -> int | None:
    """The batch bucket to run `rows` rows at: the smallest that holds them, else (while that one compiles)
    the smallest compiled one that does; None while none is ready."""
    fits = [b for b in self.buckets if b >= rows]
    if not fits:
      return None
    if not pool.ready(fits[0]):
      self._request_compile(pool, fits[0])
    return next((b for b in fits if pool.ready(b)), None)

  # ------------------------------------------------------------------ engine thread

  def _loop(self) -> None:
    while not self._stop.is_set():
      busy = any(p.active for p in self._pools.values())
      self._pull(timeout=0.0 if busy else (0.02 if self._pending else 0.1))
      self._cancel_running()
      self._admit()
      key = self._next_pool()
      if key is not None:
        self._step(key)

  def _pull(self, timeout: float) -> None:
    try:
      self._pending.append(self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait())
    except queue.Empty:
      return
    while True:
      try:
        self._pending.append(self._q.get_nowait())
      except queue.Empty:
        return

  def _cancel_running(self) -> None:
    for job, run in list(self._runs.items()):
      if job.cancelled.is_set():  # the client went away: its rows leave at the next block boundary
        run.pool.remove(lambda owner, job=job: owner[0] is job)
        del self._runs[job]
        self._on_drop(job)

  def _admit(self) -> None:
    held: set[tuple] = set()  # pools whose oldest waiting job could not start: none of theirs passes it
    rest = []
    for job in self._pending:
      if job.cancelled.is_set():
        self._keys.pop(job, None)
        self._take(job)
        self._on_drop(job)
        continue
      try:
        if job not in self._keys:  # a job that waits is looked at again at every block boundary
          self._keys[job] = SlotPool.layout(self.model.config, job.gcfg, job.prompt)
        lay = self._keys[job]
        key = (job.gcfg, lay.grid)
        pool = self._pools.get(key)
        if pool is None:  # kept while its first job waits for a compile: built once, not per boundary
          pool = self._pools[key] = self._new_pool(job.gcfg, job.prompt)
      except ValueError as e:  # the engine refuses it: fail it now, not after a compile
        self._keys.pop(job, None)
        self._take(job)
        job.on_done(e)
        continue
      if key in held or pool.active + job.rows > self.max_batch:
        held.add(key)
        rest.append(job)
        continue
      want = pool.active + job.rows
      failed = self._failed.get(pool.program_key(next(b for b in self.buckets if b >= want)))
      B = self._bucket(pool, want) if failed is None else None
      if failed is not None:
        self._keys.pop(job, None)
        self._take(job)
        job.on_done(failed)
        continue
      if B is None:  # its program compiles on the other thread
        held.add(key)
        rest.append(job)
        continue
      for r in range(job.rows):
        pool.add((job, r), job.prompt, job.seed, r, layout=lay)
      del self._keys[job]
      self._runs[job] = _Run(job, pool, key, [None] * job.rows, [[] for _ in range(job.rows)])
      self._take(job)
    self._pending = rest

  def _next_pool(self) -> tuple | None:
    """The pool holding the oldest request in flight (first come, first served at block granularity: the
    tail latency is that of the requests that waited longest), among those with a program ready."""
    oldest: dict[tuple, float] = {}
    for run in self._runs.values():
      k = run.key
      oldest[k] = min(oldest.get(k, run.job.enqueued), run.job.enqueued)
    for key in sorted(oldest, key=oldest.get):
      pool = self._pools.get(key)
      if pool is not None and pool.active and self._bucket(pool, pool.active) is not None:
        return key
    return None

  def _step(self, key: tuple) -> None:
    pool = self._pools[key]
    rows = pool.active
    B = self._bucket(pool, rows)
    t = time.perf_counter()
    try:
      finished, progress, counts = pool.step(B)
    except Exception as e:  # a failed call fails its pool's jobs, never the worker
      for job, run in list(self._runs.items()):
        if run.pool is pool:
          del self._runs[job]
          job.on_done(e)
      self._drop_pool(key)
      return
    dt = time.perf_counter() - t
    touched: dict[Job, _Run] = {}
    for (job, r), toks in progress:
      run = self._runs.get(job)
      if run is not None:
        run.progress[r] = toks
        touched[job] = run
    done_jobs, tokens, row_forwards = 0, 0, 0
    for f in finished:
      job, r = f.owner
      run = self._runs.get(job)
      tokens += len(f.tokens)
      row_forwards += f.row_nfe
      if run is None:  # cancelled meanwhile
        continue
      run.choices[r] = Choice(tokens=f.tokens, gen_length=f.gen_length, row_nfe=f.row_nfe)
      run.progress[r] = f.tokens
      touched[job] = run
    for job, run in touched.items():
      if job.on_tokens is not None and not job.cancelled.is_set():
        job.on_tokens([list(p) for p in run.progress])
      if run.left == 0:
        del self._runs[job]
        done_jobs += 1
        job.on_done(run.choices * job.n if job.rows == 1 else run.choices)
    self._on_batch(BatchStats(rows=rows, bucket=B, seconds=dt, nfe=counts["nfe"], tokens=tokens,
                              row_forwards=row_forwards, jobs=done_jobs))
    pool.drain()
    if not pool.active:
      self._drop_pool(key)

  def _drop_pool(self, key: tuple) -> None:
    self._pools.pop(key, None)
