"""Output directories that are written atomically and never destroy what the user did not ask to replace.

Rules, enforced by `atomic_dir` before anything is written:
  * DST must not be a source, contain a source, or lie inside one (`hf2jax SRC SRC --overwrite` would
    otherwise convert in place and delete the checkpoint; `hf2jax SRC PARENT --overwrite` the parent).
  * An existing DST is replaced only with overwrite=True, and only when it is a directory this code
    wrote (it holds the MARKER file), unless the caller also passes replace_unmarked=True (the CLI's
    `--overwrite-unmarked DST`, where the user names the directory a second time).
  * Everything is written to a staging sibling `.DST.tmp-<pid>-<hex>` that is renamed to DST at the very
    end; any failure, SIGINT or SIGTERM removes it. At that swap DST is checked again, under a lock on its
    parent that every writer takes (a DST another process made meanwhile, or a concurrent run's output, is
    refused by the same rules, not replaced), and what is renamed aside is checked once more before it is
    deleted. Staging directories left by processes that no longer
    exist (SIGKILL, power loss) are removed by the next write to the same DST.
Nothing outside DST and the staging siblings is ever deleted.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pathlib
import re
import secrets
import shutil
import signal
import sys
import threading
import time
from typing import Iterator, Sequence

from dinfer_jax.checkpoint.errors import CheckpointError

MARKER = ".dinfer-jax-output"


class Interrupted(BaseException):
  """SIGINT or SIGTERM arrived while an output directory was being written (its staging dir is gone)."""

  def __init__(self, signum: int, dst: os.PathLike):
    self.signum = signum
    self.dst = pathlib.Path(dst)
    self.staging: pathlib.Path | None = None  # set by atomic_dir: removed, but writers may still be busy
    super().__init__(f"interrupted by {signal.Signals(signum).name}: {self.dst} was not written "
                     "(the partial output was removed)")


def is_within(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_destination(dst: os.PathLike, *, sources: Sequence[os.PathLike] = (), overwrite: bool = False,
                      replace_unmarked: bool = False) -> pathlib.Path:
  """Raises CheckpointError when writing `dst` could destroy a source or a directory we did not write.

  Returns the absolute DST path.
  """
  dst_abs = pathlib.Path(dst).absolute()
  d = os.path.realpath(dst_abs)
  for src in sources:
    s = os.path.realpath(src)
    if d == s:
      raise CheckpointError(f"{dst_abs}: the output directory is the source {src}; choose another DST")
    if is_within(s, d):
      raise CheckpointError(f"{dst_abs}: the output directory contains the source {src}; choose another DST")
    if is_within(d, s):
      raise CheckpointError(f"{dst_abs}: the output directory is inside the source {src}; choose another DST")
  if dst_abs.is_symlink():
    raise CheckpointError(f"{dst_abs} is a symbolic link; refusing to replace it (give the real directory)")
  if dst_abs.exists():
    if not dst_abs.is_dir():
      raise CheckpointError(f"{dst_abs} exists and is not a directory; refusing to replace it")
    if not overwrite:
      raise CheckpointError(f"{dst_abs} already exists (--overwrite replaces it)")
    if not (dst_abs / MARKER).is_file() and not replace_unmarked:
      raise CheckpointError(
          f"{dst_abs} was not written by dinfer-jax (no {MARKER} file); refusing to replace it. To replace it "
          f"anyway, name it again: --overwrite-unmarked {dst}")
  return dst_abs


@contextlib.contextmanager
def _parent_lock(parent: pathlib.Path) -> Iterator[None]:
  """An exclusive lock on DST's parent directory for the check and the renames of a swap: two writers of one
  DST swap one after the other, the second seeing the first's output. Held for milliseconds."""
  fd = os.open(parent, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the lock


def _swap(tmp: pathlib.Path, dst: pathlib.Path, check) -> None:
  """Renames the finished staging dir `tmp` to `dst`. `check(path)` (check_destination's rules) runs on DST
  at this moment, and again on what is renamed aside before it is deleted: a DST made after the start by
  someone else is refused like one that was there, and nothing the rules protect is removed."""
  with _parent_lock(dst.parent):
    check(dst)
    if not os.path.lexists(dst):
      try:
        tmp.rename(dst)  # rename(2) replaces an empty directory at most, never files or a non-empty one
      except OSError as e:
        raise CheckpointError(f"{dst} appeared while this run was writing it and was left as it is: "
                              f"{e.strerror or e}") from None
      return
    old = dst.parent / f".{dst.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    dst.rename(old)
    try:
      check(old)  # what was renamed is what gets deleted: check it, not the name
    except CheckpointError:
      old.rename(dst)
      raise CheckpointError(f"{dst} changed while this run was writing it and was left as it is") from None
    try:
      tmp.rename(dst)
    except BaseException:
      old.rename(dst)
      raise
    shutil.rmtree(old, ignore_errors=True)


_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_stale_staging(dst: os.PathLike) -> list[pathlib.Path]:
  """Removes `.DST.tmp-<pid>-*` / `.DST.old-<pid>-*` siblings of `dst` whose process is gone.

  A stale `.old-` directory while DST itself is missing means the writer died between its two renames:
  the old DST is put back instead of being removed. Returns the paths removed or restored.
  """
  dst = pathlib.Path(dst).absolute()
  done = []
  try:
    siblings = list(dst.parent.iterdir())
  except OSError:
    return done
  for p in siblings:
    m = _STAGING.match(p.name)
    if not m or m["name"] != dst.name or int(m["pid"]) == os.getpid() or _pid_alive(int(m["pid"])):
      continue
    if not p.is_dir() or p.is_symlink():
      continue
    if m["kind"] == "old" and not dst.exists():
      p.rename(dst)
    else:
      shutil.rmtree(p, ignore_errors=True)
    done.append(p)
  return done


@contextlib.contextmanager
def _on_signals(handler) -> Iterator[None]:
  """SIGINT/SIGTERM go to `handler` while the block runs (in the main thread; elsewhere: no change)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for s, h in old.items():
      signal.signal(s, h)


# Set when an interruption arrives: background writers (orbax's) stop before their next leaf instead of
# writing on into a staging directory that is being removed.
_stop_writes = threading.Event()
# The interruption itself, kept because the raise can be swallowed: a signal handler runs between any two
# bytecodes of the main thread, also inside a gc callback or a __del__, where Python prints "Exception
# ignored" and carries on (seen: inside jax's _xla_gc_callback). The writers have stopped by then, so
# carrying on would rename an incomplete output into place; atomic_dir re-raises it before the swap.
_pending: list[BaseException] = []


def writes_stopped() -> bool:
  return _stop_writes.is_set()


def remove_when_quiet(path: os.PathLike, quiet: float = 0.3, timeout: float = 30.0) -> bool:
  """Removes `path` until it stays gone for `quiet` seconds (a writer thread may still recreate files in it
  while it finishes its current write). Returns whether it is gone."""
  path = pathlib.Path(path)
  deadline = time.monotonic() + timeout
  gone_since = None
  while time.monotonic() < deadline:
    if path.exists() or path.is_symlink():
      shutil.rmtree(path, ignore_errors=True)
      gone_since = None
    elif gone_since is None:
      gone_since = time.monotonic()
    elif time.monotonic() - gone_since >= quiet:
      return True
    time.sleep(0.02)
  return not path.exists()


def _is_closed_loop(value: BaseException | None) -> bool:
  return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def _quiet_closed_loop() -> None:
  """After an interruption, for the rest of the process: a write that orbax had in flight completes in a
  native thread, and tensorstore's done-callback calls back into orbax's asyncio loop, which the
  interruption has closed. Its RuntimeError ("Event loop is closed") goes to sys.unraisablehook
  (tensorstore's PyErr_WriteUnraisable with no object: a bare traceback, seen in CI while the CLI was
  removing the staging directory, after the write block had exited) or, from Python threads, to
  sys.excepthook. The write is abandoned on purpose and its directory removed: not the user's business."""
  previous_except, previous_unraisable = sys.excepthook, sys.unraisablehook

  def excepthook(kind, value, tb):
    if not _is_closed_loop(value):
      previous_except(kind, value, tb)

  def unraisablehook(u):
    if not _is_closed_loop(u.exc_value):
      previous_unraisable(u)
  sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


class _DropInterrupted(logging.Filter):
  """asyncio runs callbacks under `except BaseException` and logs what they raise ("Exception in callback
  ..._read_from_self()", seen in CI: the handler's raise landed in orbax's event loop). That raise is in
  _pending and comes back as the one-line message before the swap."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], Interrupted))


@contextlib.contextmanager
def _signals_raise(dst: pathlib.Path):
  """SIGINT/SIGTERM raise Interrupted while the output is being written. A raise that Python swallows (in
  a gc callback or a __del__) is not printed as "Exception ignored ...": it is in _pending, and atomic_dir
  raises it again before the swap, so the user still sees one line."""
  def handler(signum, _frame):
    _stop_writes.set()
    e = Interrupted(signum, dst)
    _pending.append(e)
    raise e

  previous = sys.unraisablehook

  def unraisable(u):
    if not isinstance(u.exc_value, Interrupted) and not (_pending and _is_closed_loop(u.exc_value)):
      previous(u)
  sys.unraisablehook = unraisable
  drop = _DropInterrupted()
  logging.getLogger("asyncio").addFilter(drop)
  try:
    with _on_signals(handler):
      yield
  finally:
    sys.unraisablehook = previous
    logging.getLogger("asyncio").removeFilter(drop)
    if _pending:  # installed after the restore, so it outlives this block (the CLI's cleanup comes later)
      _quiet_closed_loop()


def _signals_ignored():
  """A second Ctrl-C must not interrupt the cleanup of the first, nor the final two renames."""
  return _on_signals(signal.SIG_IGN)


def _ignore_signals() -> None:
  """Inside an _on_signals block: ignore SIGINT/SIGTERM from here to the block's end (which restores them)."""
  if threading.current_thread() is threading.main_thread():
    for s in (signal.SIGINT, signal.SIGTERM):
      signal.signal(s, signal.SIG_IGN)


@contextlib.contextmanager
def atomic_dir(dst: os.PathLike, overwrite: bool = False, *, sources: Sequence[os.PathLike] = (),
               replace_unmarked: bool = False, kind: str = "") -> Iterator[pathlib.Path]:
  """Yields a fresh staging dir next to `dst` (holding the MARKER file); renames it to `dst` on success,
  removes it on any failure or SIGINT/SIGTERM (raised as Interrupted). See the module docstring."""
  dst = check_destination(dst, sources=sources, overwrite=overwrite, replace_unmarked=replace_unmarked)
  tmp = None
  _stop_writes.clear()
  _pending.clear()
  try:
    # The raising handlers go in before the staging dir exists and stay until the swap has begun: a signal
    # in between would take the default action and leave the staging dir behind (seen: SIGTERM right
    # after the mkdir).
    with _signals_raise(dst):
      try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(dst)
        if dst.exists():  # a dead writer's old DST may just have been put back: check it like any other
          check_destination(dst, sources=sources, overwrite=overwrite, replace_unmarked=replace_unmarked)
        tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        (tmp / MARKER).write_text(json.dumps({"written_by": "dinfer-jax", "kind": kind}) + "\n")
      except OSError as e:
        raise CheckpointError(f"{dst}: cannot create output directory: {e.strerror or e}") from None
      yield tmp
      _ignore_signals()  # the swap is two renames; an interruption between them would lose DST
      if _pending:  # an interruption whose raise was swallowed: the output may be incomplete
        raise _pending[0]
      _swap(tmp, dst, lambda p: check_destination(p, sources=sources, overwrite=overwrite,
                                                   replace_unmarked=replace_unmarked))
  except BaseException as e:
    with _signals_ignored():
      _stop_writes.set()
      if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, Interrupted):
      e.staging = tmp
      raise
    if tmp is None:
      raise
    # Errors name DST, not the staging directory the user never asked for.
    if isinstance(e, CheckpointError):
      raise CheckpointError(str(e).replace(str(tmp), str(dst))) from e.__cause__
    if isinstance(e, OSError):
      where = str(e.filename).replace(str(tmp), str(dst)) if e.filename else str(dst)
      raise CheckpointError(f"{where}: {e.strerror or e} (nothing was written to {dst})") from None
    raise
