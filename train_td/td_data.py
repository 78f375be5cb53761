"""Golden trajectories on disk and as training batches for the trajectory-distillation loss.

A trajectory is stored compactly (train_td.collect writes it): the prompt ids, the final generated region
(gen_length tokens, early-stop EOS fill included), the engine's commit step of every generated position
(1-based forward index, -1 = filled by early stop) and n_steps (the forwards the row took). From these,
`state_at(k)` rebuilds the canvas after any k forwards: a position holds its final token iff its reveal
step (commit step, or n_steps for the early-stop fill, which happens after the row's last forward) is <= k.

Files: Parquet (pyarrow), one file per collected batch. Parquet because the records are columnar and small
(list<int16> columns compress to a few bytes per position), every file streams on its own (row groups),
and pandas / HF datasets / Spark / DuckDB read it without a schema of ours; array_record would need a
serialisation layer of our own on top and has no reader outside the TF/Grain stack.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import pathlib
from typing import Sequence

import numpy as np

from train_td import tokenizer as tok_lib

SHARD_GLOB = "part-*.parquet"
COLUMNS = ("index", "task", "prompt", "prompt_ids", "tokens", "commit_step", "n_steps", "answer")
# A shard's schema metadata key holding content_digest of its records (train_td.collect writes it).
DIGEST_KEY = "dinfer_td_sha256"


def content_digest(cols: dict[str, list]) -> str:
  """SHA-256 of a shard's records (its COLUMNS as read back, in order): what a flipped bit in a data page
  changes, where Parquet itself read back 303 of 967 such flips without a word."""
  h = hashlib.sha256()
  for c in COLUMNS:
    h.update(json.dumps(cols[c], separators=(",", ":")).encode())
  return h.hexdigest()


def reveal_steps(commit_step: Sequence[int], n_steps: int) -> np.ndarray:
  """Per generated position, the number of forwards after which it holds its final token."""
  c = np.asarray(commit_step, np.int32)
  return np.where(c > 0, c, np.int32(n_steps))


def state_at(prompt_ids: Sequence[int], tokens: Sequence[int], commit_step: Sequence[int], n_steps: int, k: int,
             mask_id: int = tok_lib.MASK_ID) -> list[int]:
  """The canvas (prompt + generated region) after k forwards of the recorded generation."""
  r = reveal_steps(commit_step, n_steps)
  gen = np.where(r <= k, np.asarray(tokens, np.int32), np.int32(mask_id))
  return list(prompt_ids) + gen.tolist()


def shard_paths(data: str | os.PathLike | Sequence[str | os.PathLike]) -> list[pathlib.Path]:
  """Shard files of one or more collect directories (comma-separated in a string), sorted by name."""
  dirs = [p for p in data.split(",") if p] if isinstance(data, str) else [data] if isinstance(
      data, os.PathLike) else list(data)
  out = []
  for d in dirs:
    d = pathlib.Path(d)
    if not d.is_dir():
      raise FileNotFoundError(f"trajectory data {d} is not a directory")
    out += sorted(pathlib.Path(p) for p in glob.glob(str(d / SHARD_GLOB)))
  if not out:
    raise FileNotFoundError(f"no trajectory shards ({SHARD_GLOB}) in {', '.join(map(str, dirs))}")
  return out


def check_shard(p: os.PathLike, cols: dict[str, list], vocab_size: int | None = None) -> None:
  """Raises ValueError naming the shard, the record and what is wrong when a record cannot be a trajectory:
  a missing value, token ids outside the vocabulary, a generated region and its commit steps of different
  lengths, n_steps < 1, or a commit step that is neither -1 (early-stop fill) nor in [1, n_steps]. A shard
  that passes cannot put an out-of-range id into an embedding lookup (a NaN model, silently)."""
  n = len(cols["task"])
  for c in COLUMNS:
    bad = next((i for i, v in enumerate(cols[c]) if v is None), None)
    if bad is not None:
      raise ValueError(f"{p}: record {bad}: column {c!r} is null")
  for i in range(n):
    where = f"{p}: record {i} (index {cols['index'][i]})"
    ids, toks, commit, steps = cols["prompt_ids"][i], cols["tokens"][i], cols["commit_step"][i], cols["n_steps"][i]
    if vocab_size is not None:
      for name, seq in (("prompt_ids", ids), ("tokens", toks)):
        out = next((t for t in seq if not 0 <= t < vocab_size), None)
        if out is not None:
          raise ValueError(f"{where}: {name} holds token id {out}, outside the vocabulary [0, {vocab_size})")
    if len(commit) != len(toks):
      raise ValueError(f"{where}: {len(toks)} tokens but {len(commit)} commit steps")
    if not (isinstance(steps, int) and steps >= 1):
      raise ValueError(f"{where}: n_steps={steps!r} must be an int >= 1")
    bad = next((c for c in commit if c != -1 and not 1 <= c <= steps), None)
    if bad is not None:
      raise ValueError(f"{where}: commit step {bad} is neither -1 nor in [1, n_steps={steps}]")


def read_records(data, vocab_size: int | None = None, digests: list[str] | None = None) -> dict[str, list]:
  """All records of the shards as columns (lists), in shard order; each shard checked as it is read: its
  content against the digest it was written with (shards written before digests have none), its records by
  check_shard (token ids against vocab_size when given). `digests`, when given, gets each shard's content
  digest (data_fingerprint)."""
  import pyarrow.parquet as pq
  cols: dict[str, list] = {c: [] for c in COLUMNS}
  for p in shard_paths(data):
    t = pq.read_table(p)
    missing = set(COLUMNS) - set(t.column_names)
    if missing:
      raise ValueError(f"{p}: not a trajectory shard (missing columns {sorted(missing)})")
    shard = {c: t.column(c).to_pylist() for c in COLUMNS}
    digest = content_digest(shard)
    stored = (t.schema.metadata or {}).get(DIGEST_KEY.encode())
    if stored is not None and stored.decode() != digest:
      raise ValueError(f"{p}: its records changed since it was written (content digest {digest[:12]}..., "
                       f"written {stored.decode()[:12]}...): the file is damaged")
    check_shard(p, shard, vocab_size)
    if digests is not None:
      digests.append(digest)
    for c in COLUMNS:
      cols[c] += shard[c]
  return cols


def data_fingerprint(digests: Sequence[str]) -> str:
  """One digest of a run's data: its shards' content digests in shard order."""
  return hashlib.sha256("\n".join(digests).encode()).hexdigest()


@dataclasses.dataclass
class TaskRows:
  """One task's trajectories laid out like train_td.data rows (left-padded prompt, answer region)."""
  tokens: np.ndarray  # [N, W + G] int32
  valid: np.ndarray  # [N, W + G] bool
  positions: np.ndarray  # [N, W + G] int32
  answer: np.ndarray  # [N, W + G] bool
  reveal: np.ndarray  # [N, W + G] int32, 0 on the prompt
  n_steps: np.ndarray  # [N] int32


def layout(prompt_ids: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]],
           commit_step: Sequence[Sequence[int]], n_steps: Sequence[int], width: int | None = None) -> TaskRows:
  """Rows of one task (every generated region must have the same length)."""
  G = len(tokens[0])
  if any(len(t) != G or len(c) != G for t, c in zip(tokens, commit_step)):
    raise ValueError("trajectories of one task must share gen_length (collect them with one config)")
  W = width or max(len(p) for p in prompt_ids)
  N, T = len(tokens), W + G
  out = TaskRows(np.full((N, T), tok_lib.PAD_ID, np.int32), np.zeros((N, T), bool), np.zeros((N, T), np.int32),
                 np.zeros((N, T), bool), np.zeros((N, T), np.int32), np.asarray(n_steps, np.int32))
  out.answer[:, W:] = True
  for r, (p, t, c, n) in enumerate(zip(prompt_ids, tokens, commit_step, n_steps)):
    if len(p) > W:
      raise ValueError(f"prompt of {len(p)} tokens exceeds width={W}")
    pad = W - len(p)
    out.tokens[r, pad:W] = p
    out.tokens[r, W:] = t
    out.valid[r, pad:] = True
    out.positions[r] = np.maximum(np.arange(T) - pad, 0)
    out.reveal[r, W:] = reveal_steps(c, n)
  return out


@dataclasses.dataclass
class TDData:
  """Deterministic TD batches: batch s is a pure function of (seed, s) (so a resumed run replays nothing).

  Each batch holds one task and batch_size of its trajectories drawn uniformly with replacement. The task is
  drawn with probability proportional to `task_weights` when given (every task of the data named, weights
  >= 0, at least one > 0), else to its number of trajectories: weights let a large cheap set (arithmetic)
  keep the base's accuracy without crowding out the task with the most forwards to remove (split).
  """
  rows: dict[str, TaskRows]
  batch_size: int
  seed: int = 0
  task_weights: tuple[tuple[str, float], ...] = ()

  def __post_init__(self):
    if self.task_weights:
      named = dict(self.task_weights)
      missing, extra = sorted(set(self.rows) - set(named)), sorted(set(named) - set(self.rows))
      if missing or extra:
        raise ValueError(f"task weights {named} must name exactly the data's tasks {sorted(self.rows)} "
                         f"(missing {missing}, not in the data {extra})")
      if any(w < 0 for w in named.values()) or not any(w > 0 for w in named.values()):
        raise ValueError(f"task weights must be >= 0 with one > 0, got {named}")

  fingerprint: str = ""  # data_fingerprint of the shards loaded

  @classmethod
  def load(cls, data, batch_size: int, seed: int = 0, task_weights=(), vocab_size: int | None = None) -> "TDData":
    digests: list[str] = []
    rec = read_records(data, vocab_size, digests)
    rows = {}
    for task in sorted(set(rec["task"])):
      idx = [i for i, t in enumerate(rec["task"]) if t == task]
      rows[task] = layout([rec["prompt_ids"][i] for i in idx], [rec["tokens"][i] for i in idx],
                          [rec["commit_step"][i] for i in idx], [rec["n_steps"][i] for i in idx])
    return cls(rows, batch_size, seed, tuple((str(n), float(w)) for n, w in task_weights),
               data_fingerprint(digests))

  def get_batch(self, step: int) -> tuple[str, dict[str, np.ndarray]]:
    names = sorted(self.rows)
    named = dict(self.task_weights)
    w = np.asarray([named[n] if named else len(self.rows[n].n_steps) for n in names], np.float64)
    rng = np.random.default_rng([self.seed, step, 13])
    task = names[int(rng.choice(len(names), p=w / w.sum()))]
    r = self.rows[task]
    idx = rng.integers(0, len(r.n_steps), size=self.batch_size)
    return task, {"tokens": r.tokens[idx], "valid": r.valid[idx], "positions": r.positions[idx],
                  "answer": r.answer[idx], "reveal": r.reveal[idx], "n_steps": r.n_steps[idx]}
