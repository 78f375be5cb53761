"""Compiled generation programs: a bounded cache of ahead-of-time executables, and JAX's on-disk cache.

`jax.jit` keeps every program it ever compiled, and a server meets many shapes (batch buckets x prompt
buckets x the model's prompt rules x streaming or not). A ProgramCache holds the executables of
`loop.run` itself, least recently used first out, so memory stays bounded; it compiles each program once
even when several threads ask for it at the same time, and says whether a program is ready without
compiling it (the server runs requests whose program is ready while another one compiles).

The persistent compilation cache (`enable_disk_cache`) makes a restart load programs from disk instead of
compiling them again. JAX never writes programs with host callbacks to it: the streaming programs
(engine.loop's io_callback) compile anew after every start.
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import pathlib
import threading
from typing import Any, Callable, Hashable

import jax


class ProgramCache:
  """Thread-safe LRU of compiled programs, by key (see engine.generate.program_key).

  Args:
    max_programs: most executables kept; the least recently used is dropped beyond it (a later call
      compiles it again, from the disk cache when one is enabled).
  """

  def __init__(self, max_programs: int = 64):
    if not isinstance(max_programs, int) or max_programs < 1:
      raise ValueError(f"ProgramCache: max_programs={max_programs!r} must be an int >= 1")
    self.max_programs = max_programs
    self._lock = threading.Lock()
    self._ready: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    self._building: dict[Hashable, concurrent.futures.Future] = {}
    self.compiles = 0  # programs built (a rebuild after an eviction counts again)
    self.evictions = 0

  def __len__(self) -> int:
    with self._lock:
      return len(self._ready)

  def ready(self, key: Hashable) -> bool:
    with self._lock:
      return key in self._ready

  def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
    """The executable for `key`, built with `build()` if absent; a second caller of a key being built waits
    for the first one's result (or its exception)."""
    with self._lock:
      if key in self._ready:
        self._ready.move_to_end(key)
        return self._ready[key]
      fut = self._building.get(key)
      owner = fut is None
      if owner:
        fut = self._building[key] = concurrent.futures.Future()
    if not owner:
      return fut.result()
    try:
      exe = build()
    except BaseException as e:
      with self._lock:
        del self._building[key]
      fut.set_exception(e)
      raise
    with self._lock:
      del self._building[key]
      self.compiles += 1
      self._ready[key] = exe
      while len(self._ready) > self.max_programs:
        self._ready.popitem(last=False)
        self.evictions += 1
    fut.set_result(exe)
    return exe


def default_disk_cache_dir() -> pathlib.Path:
  """$XDG_CACHE_HOME/dinfer-jax/xla (default ~/.cache/dinfer-jax/xla): per user, outside the checkout."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "dinfer-jax" / "xla"


def enable_disk_cache(where: str | os.PathLike | None) -> pathlib.Path | None:
  """Points JAX's persistent compilation cache at `where` (None: default_disk_cache_dir(); "off": no
  cache) for every program, however fast it compiled. Returns the directory, or None when off or when the
  directory cannot be created (then a warning is the caller's business: compiling still works)."""
  if where is not None and str(where) == "off":
    return None
  path = pathlib.Path(where).expanduser().absolute() if where is not None else default_disk_cache_dir()
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError:
    return None
  jax.config.update("jax_compilation_cache_dir", str(path))
  # Every program: the engine's compile in seconds on CPU, and JAX's defaults (1 s, any size) would skip
  # the small ones that still cost a start-up its latency.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
