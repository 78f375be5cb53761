"""The request queue and engine threads every batcher shares (Batcher), and window batching (DynamicBatcher,
`serve --batching window`): requests that arrive within a short window are decoded together in one engine
call. Continuous batching, the server's default, is serve.continuous.

One worker thread owns the engine. It takes the oldest waiting request, gathers every request that arrives
until `window_s` after the oldest one's arrival (or until `max_batch` rows), and runs those that share its
GenerationConfig in one `dinfer_jax.generate` call; the others wait for the next call. The engine lays
ragged prompts out per row (left padding masked out of attention, per-row positions and counters), so a
row's answer equals running that prompt alone; the batch is padded with invalid rows up to a power-of-two
bucket so that a handful of compiled programs serve every batch size.

Requests that sample (temperature > 0) run alone, their `n` choices as rows 0..n-1 of one call with the
request's seed, so a seeded request gives the same choices every time whatever else is in flight.
Greedy requests (temperature 0) ignore the seed and need only one row however many choices they ask for.

A call that holds a streaming job runs the engine's streaming program (`generate(..., on_block=...)`): as
each block is committed inside the running program, the worker hands each streaming job its rows' tokens
so far. Streaming and plain requests share batches; a call without streaming jobs runs the plain program
(the one JAX's disk cache can keep: it never stores programs with host callbacks).

Programs live in a bounded ProgramCache (engine.programs). A batch whose program is not compiled yet goes
to a second thread that compiles and runs it, so the batches whose programs are ready go on meanwhile;
`start_warmup` compiles the likely programs in the background after the server starts listening.
"""
from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from typing import Any, Callable, Sequence

from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.generate import GenerationResult, bucket_rows, compile_program, generate, prepare, program_ready
from dinfer_jax.engine.programs import ProgramCache


class QueueFull(Exception):
  """The bounded request queue is full (the server answers 429)."""


@dataclasses.dataclass
class Choice:
  tokens: list[int]  # generated tokens before the first EOS
  gen_length: int  # generated positions of the canvas (tokens shorter than this: the model ended with EOS)
  row_nfe: int  # forwards this row took part in


@dataclasses.dataclass(eq=False)
class Job:
  """One request: a prompt, its config and how many choices; `on_done` gets a list of Choice or an
  exception, from the worker thread."""
  prompt: list[int]
  gcfg: GenerationConfig
  on_done: Callable[[Any], None]
  n: int = 1
  seed: int = 0
  enqueued: float = dataclasses.field(default_factory=time.monotonic)
  cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
  on_tokens: Callable[[list[list[int]]], None] | None = None  # per block: each row's tokens so far

  @property
  def rows(self) -> int:
    return self.n if self.gcfg.temperature > 0 else 1

  def batch_key(self):
    # Sampled jobs get a key of their own: their seed must see their rows at 0..n-1.
    return (self.gcfg,) if self.gcfg.temperature == 0 else (self.gcfg, id(self))

  def cancel(self) -> None:
    self.cancelled.set()


def bucket_for(rows: int, max_batch: int) -> int:
  """The engine's own batch bucket for this many rows (generate.bucket_rows), capped at max_batch."""
  return min(bucket_rows(rows), max_batch)


def batch_buckets(max_batch: int) -> list[int]:
  """The row counts compiled programs are built for: every bucket a batch of 1..max_batch rows runs at."""
  return sorted({bucket_for(n, max_batch) for n in range(1, max_batch + 1)})


@dataclasses.dataclass
class BatchStats:
  """What the worker reports per engine call (for metrics)."""
  rows: int
  bucket: int
  seconds: float
  nfe: int
  tokens: int
  row_forwards: int
  jobs: int


class Batcher:
  """Bounded queue + engine worker threads; the scheduling is the subclass's (DynamicBatcher: windows of
  whole calls; serve.continuous.ContinuousBatcher: slots refilled at block boundaries).

  Args:
    model: a dinfer_jax Model.
    max_batch: most rows decoded at once.
    max_queue: most requests waiting (queued, not yet running); `submit` raises QueueFull beyond it.
    on_batch: called with BatchStats after every engine call; on_drop with each cancelled job dropped.
    programs: the compiled programs (default: a ProgramCache of 64).
  """

  def __init__(self, model, *, max_batch: int = 16, max_queue: int = 256,
               on_batch: Callable[[BatchStats], None] | None = None,
               on_drop: Callable[[Job], None] | None = None, programs: ProgramCache | None = None):
    if max_batch < 1 or max_queue < 1:
      raise ValueError(f"{type(self).__name__}: max_batch={max_batch} and max_queue={max_queue} must be >= 1")
    self.model = model
    self.max_batch = max_batch
    self.max_queue = max_queue
    self._on_batch = on_batch or (lambda s: None)
    self._on_drop = on_drop or (lambda j: None)
    self._q: queue.Queue[Job] = queue.Queue()
    self._pending: list[Job] = []  # taken off the queue, not yet run (another config, or no room)
    self._depth = 0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.programs = programs if programs is not None else ProgramCache(64)  # an empty one is falsy
    self._threads: list[threading.Thread] = []
    self.warm: threading.Event = threading.Event()  # set when start_warmup has compiled everything

  # ------------------------------------------------------------------ client side (any thread)

  @property
  def depth(self) -> int:
    """Requests waiting to run."""
    return self._depth

  def validate(self, prompt: Sequence[int], gcfg: GenerationConfig, n: int = 1) -> None:
    """Raises ValueError (the engine's own message) for a request the engine would refuse."""
    rows = n if gcfg.temperature > 0 else 1
    if rows > self.max_batch:
      raise ValueError(f"n={n}: a sampled request's choices run in one batch of at most max_batch="
                       f"{self.max_batch} rows")
    prepare(self.model.config, [list(prompt)], gcfg)

  def submit(self, job: Job) -> Job:
    with self._lock:
      if self._depth >= self.max_queue:
        raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
      self._depth += 1
    self._q.put(job)
    return job

  # ------------------------------------------------------------------ worker

  def _workers(self) -> list[tuple[str, Callable[[], None]]]:
    """(thread name, body) of the engine threads."""
    raise NotImplementedError

  def start(self) -> "Batcher":
    if self._thread is None:
      self._threads = [threading.Thread(target=f, name=name, daemon=True) for name, f in self._workers()]
      self._thread = self._threads[0]
      for t in self._threads:
        t.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    for t in self._threads:
      t.join(timeout=10)

  def warmup_specs(self, gcfg: GenerationConfig, prompt_lengths: Sequence[int], *,
                   token_id: int) -> list[tuple[GenerationConfig, list[int], int]]:
    """(config, prompt, batch bucket) of every plain program for each batch bucket x prompt length (one
    prompt per length bucket), batch 1 first; lengths the model cannot fit with gcfg.gen_length are left out."""
    prompts = []
    for P in prompt_lengths:
      try:
        prepare(self.model.config, [[token_id] * P], gcfg)
      except ValueError:
        continue
      prompts.append([token_id] * P)
    return [(gcfg, p, b) for b in batch_buckets(self.max_batch) for p in prompts]

  def start_warmup(self, specs: Sequence[tuple[GenerationConfig, list[int], int]],
                   progress: Callable[[str], None] | None = None) -> threading.Thread:
    """Compiles the programs of `specs` (warmup_specs) on a background thread; `warm` is set when done."""
    def work():
      try:
        self._compile_all(specs, progress)
      finally:
        self.warm.set()
    t = threading.Thread(target=work, name="dinfer-warmup", daemon=True)
    t.start()
    return t

  def _compile_all(self, specs, progress) -> int:
    done = 0
    for i, (g, prompt, b) in enumerate(specs):
      if self._stop.is_set():
        break
      t = time.perf_counter()
      built = self._compile_spec(g, prompt, b)
      done += built
      if progress:
        how = f"{time.perf_counter() - t:.1f}s" if built else "ready"
        progress(f"compiled {i + 1}/{len(specs)} (prompt {len(prompt)} tokens x batch {b}, "
                 f"gen {g.gen_length}): {how}")
    return done

  def _compile_spec(self, gcfg: GenerationConfig, prompt: list[int], bucket: int) -> bool:
    """Compiles the program a warm-up spec stands for; returns whether it had to be built."""
    raise NotImplementedError

  def _take(self, job: Job) -> None:
    with self._lock:
      self._depth -= 1


class DynamicBatcher(Batcher):
  """Window batching: one engine call per batch of requests that arrived within `window_s` of the oldest
  (see the module docstring). window_s: how long after the oldest waiting request's arrival the worker
  keeps gathering; the other arguments are Batcher's."""
  kind = "window"

  def __init__(self, model, *, window_s: float = 0.005, **kw):
    if window_s < 0:
      raise ValueError(f"DynamicBatcher: window_s={window_s} must be >= 0")
    super().__init__(model, **kw)
    self.window_s = window_s
    self._cold: queue.Queue[list[Job]] = queue.Queue()  # batches whose program must be compiled first

  def _workers(self):
    return [("dinfer-batcher", self._loop), ("dinfer-compile-run", self._cold_loop)]

  def _compile_spec(self, gcfg, prompt, bucket) -> bool:
    return compile_program(self.programs, self.model, [prompt], gcfg, batch_bucket=bucket)

  def _loop(self) -> None:
    while not self._stop.is_set():
      batch = self._next_batch()
      if not batch:
        continue
      if self._ready(batch):
        self._run(batch)
      else:  # its program compiles on the other thread while the ready batches go on here
        self._cold.put(batch)

  def _cold_loop(self) -> None:
    while not self._stop.is_set():
      try:
        batch = self._cold.get(timeout=0.1)
      except queue.Empty:
        continue
      self._run(batch)

  def _layout(self, jobs: list[Job]):
    prompts = [j.prompt for j in jobs for _ in range(j.rows)]
    return prompts, bucket_for(len(prompts), self.max_batch), any(j.on_tokens is not None for j in jobs)

  def _ready(self, jobs: list[Job]) -> bool:
    prompts, bucket, stream = self._layout(jobs)
    try:
      return program_ready(self.programs, self.model, prompts, jobs[0].gcfg, batch_bucket=bucket, stream=stream)
    except ValueError:
      return True  # the call fails at once with the engine's message: no need to wait for a compile

  def _next_batch(self) -> list[Job]:
    if not self._pending:
      try:
        self._pending.append(self._q.get(timeout=0.1))
      except queue.Empty:
        return []
    first = self._pending[0]
    key = first.batch_key()
    deadline = first.enqueued + self.window_s

    def rows_ready():
      return sum(j.rows for j in self._pending if j.batch_key() == key and not j.cancelled.is_set())

    while rows_ready() < self.max_batch:
      remaining = deadline - time.monotonic()
      try:
        self._pending.append(self._q.get(timeout=remaining) if remaining > 0 else self._q.get_nowait())
      except queue.Empty:
        break
    chosen, rest, rows = [], [], 0
    for j in self._pending:
      if j.cancelled.is_set():  # the client went away or timed out before its turn
        self._take(j)
        self._on_drop(j)
      elif j.batch_key() == key and rows + j.rows <= self.max_batch:
        chosen.append(j)
        rows += j.rows
        self._take(j)
      else:
        rest.append(j)
    self._pending = rest
    return chosen

  def _run(self, jobs: list[Job]) -> None:
    gcfg = jobs[0].gcfg
    prompts, bucket, stream = self._layout(jobs)
    first_row = list(itertools.accumulate([0] + [j.rows for j in jobs]))

    def on_block(_k, rows):
      for j, r0 in zip(jobs, first_row):
        if j.on_tokens is not None and not j.cancelled.is_set():
          j.on_tokens(rows[r0:r0 + j.rows])

    t = time.perf_counter()
    try:
      res: GenerationResult = generate(self.model, prompts, gcfg, seed=jobs[0].seed, batch_bucket=bucket,
                                       on_block=on_block if stream else None, programs=self.programs)
    except Exception as e:  # a failed call fails its jobs, never the worker
      for j in jobs:
        j.on_done(e)
      return
    dt = time.perf_counter() - t
    self._on_batch(BatchStats(rows=len(prompts), bucket=bucket, seconds=dt, nfe=res.nfe,
                              tokens=sum(res.num_tokens), row_forwards=sum(res.row_nfe), jobs=len(jobs)))
    r = itertools.count()
    for j in jobs:
      choices = []
      for _ in range(j.rows):
        i = next(r)
        choices.append(Choice(tokens=res.tokens[i], gen_length=len(res.canvas[i]) - res.prompt_lengths[i],
                              row_nfe=res.row_nfe[i]))
      j.on_done(choices * j.n if j.rows == 1 else choices)
