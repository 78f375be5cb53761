"""Collect golden trajectories: the jitted engine over training prompts, verifier-filtered, to Parquet shards.

  python -m train_td collect --model default --task arithmetic --n 20000 --out DIR [--batch 256] [--seed 0]
      [GenerationConfig flags]

Prompts are the first n distinct *training* problems of `iter_problems(task, "train", seed)` (held-out
problems can never occur: the split is a property of the problem). They are cut into batches of `batch`;
batch k is generated in one engine call (greedy, so a pure function of (model, prompts, settings)) and
its accepted rows are written to `part-<process>-<k>.parquet` in one atomic rename, with the attempted and
kept counts in the file's metadata. So:
- resuming after a kill skips every batch whose shard exists and redoes at most the batch in flight: no
  duplicates, nothing half-written;
- the same seed gives the same shards; a different seed other prompts;
- under jax.distributed each process takes the batches k with k % process_count == process_index and
  writes its own shards (the shard names carry both, a resume finds a batch done whoever wrote it).
`collect_config.json` records the settings; collecting into a directory made with other settings fails.
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import os
import pathlib
from typing import Any

import jax
from tqdm.auto import tqdm

import dinfer_jax
from dinfer_jax import tasks as tasks_lib
from dinfer_jax.engine.config import GenerationConfig
from train_td import evaluate, prompting, td_data
from train_td.trainer import check_own_dir

CONFIG = "collect_config.json"


@dataclasses.dataclass(frozen=True)
class CollectConfig:
  model: str
  task: str
  n: int
  seed: int = 0
  batch: int = 128
  generation: tuple[tuple[str, Any], ...] = ()  # GenerationConfig knobs, sorted

  def __post_init__(self):
    tasks_lib.get_task(self.task)  # unknown task: the registry's one-line error
    for f in ("n", "batch"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"CollectConfig.{f} must be a positive int, got {v!r}")
    if self.gcfg().temperature != 0:
      raise ValueError("collect: temperature must be 0 (greedy trajectories are reproducible; sampled ones "
                       "would need the seed per batch)")

  def gcfg(self) -> GenerationConfig:
    return GenerationConfig(**dict(self.generation))

  def n_batches(self) -> int:
    return -(-self.n // self.batch)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["generation"] = dict(self.generation)
    return d


def shard_name(process: int, k: int) -> str:
  return f"part-{process:03d}-{k:06d}.parquet"


def done_batches(out: pathlib.Path) -> dict[int, dict[str, int]]:
  """Batch index -> {"attempted", "kept"} of every shard already in `out`."""
  import pyarrow.parquet as pq
  done = {}
  for p in glob.glob(str(out / td_data.SHARD_GLOB)):
    meta = pq.read_schema(p).metadata or {}
    info = json.loads(meta.get(b"collect", b"{}"))
    if "batch" not in info:
      raise ValueError(f"{p}: shard without collect metadata (not written by train_td.collect)")
    done[int(info["batch"])] = {"attempted": int(info["attempted"]), "kept": int(info["kept"])}
  return done


def _write_shard(path: pathlib.Path, records: dict[str, list], meta: dict[str, Any]) -> None:
  import pyarrow as pa
  import pyarrow.parquet as pq
  ints = pa.list_(pa.int32())  # token ids: a 157k vocabulary (LLaDA-MoE) does not fit int16
  schema = pa.schema([("index", pa.int64()), ("task", pa.string()), ("prompt", pa.string()),
                      ("prompt_ids", ints), ("tokens", ints), ("commit_step", ints), ("n_steps", pa.int32()),
                      ("answer", pa.string())],
                     metadata={"collect": json.dumps(meta, sort_keys=True),
                               td_data.DIGEST_KEY: td_data.content_digest(records)})
  table = pa.Table.from_pydict({c: records[c] for c in td_data.COLUMNS}, schema=schema)
  tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
  pq.write_table(table, tmp)
  os.replace(tmp, path)  # atomic: a killed collect leaves either the whole shard or none


def _differences(saved: dict, now: dict, prefix: str = "") -> str:
  """The keys whose values differ, nested ones dotted: "generation.threshold: saved 0.9, now 0.5"."""
  out = []
  for k in sorted(set(saved) | set(now), key=str):
    a, b = saved.get(k, "(absent)"), now.get(k, "(absent)")
    if isinstance(a, dict) and isinstance(b, dict):
      out.append(_differences(a, b, f"{prefix}{k}."))
    elif a != b:
      out.append(f"{prefix}{k}: saved {a!r}, now {b!r}")
  return "; ".join(x for x in out if x)


def _prepare_dir(cc: CollectConfig, out: pathlib.Path) -> None:
  check_own_dir(out, (CONFIG,), "collect directory")
  out.mkdir(parents=True, exist_ok=True)
  f = out / CONFIG
  if f.exists():
    saved, now = json.loads(f.read_text()), cc.to_json()
    if saved != now:
      raise ValueError(f"{f} was written with other settings: {_differences(saved, now)}; collect into a new "
                       "directory (or give the saved settings)")
    return
  tmp = f.with_name(f".{CONFIG}.tmp{os.getpid()}")
  tmp.write_text(json.dumps(cc.to_json(), indent=2, sort_keys=True) + "\n")
  os.replace(tmp, f)


def training_problems(task_name: str, n: int, seed: int) -> list:
  """The first `n` distinct training problems of the task; a ValueError, before anything is written or loaded,
  when the task holds fewer (a JSONL file of 5 training rows asked for 10, or one of test rows only)."""
  task = tasks_lib.get_task(task_name)
  size = task.split_size("train")
  if size is not None and n > size:
    held = task.split_size("test")
    raise ValueError(f"{task.name}: --n {n} asks for {n} distinct training problems; the task has {size} "
                     f"(and {held} held-out ones, never collected)")
  try:
    return list(itertools.islice(tasks_lib.iter_problems(task, "train", seed, unique=True), n))
  except RuntimeError as e:  # a generated task with fewer distinct problems than asked
    raise ValueError(f"--n {n}: {e}") from None


def collect(model, cc: CollectConfig, out: os.PathLike, *, progress: bool = True, stop_after: int | None = None,
            process_index: int = 0, process_count: int = 1) -> dict[str, int]:
  """Runs (or resumes) a collection; returns {"attempted", "kept", "rejected", "batches"} over all shards.

  Args:
    model: a dinfer_jax Model.
    cc: the settings.
    out: output directory.
    stop_after: stop after generating this many batches in this call (tests of resuming).
    process_index, process_count: this process's share of the batches (jax.distributed).
  """
  out = pathlib.Path(out)
  # All n prompts up front: cheap, and a request for more distinct problems than the split holds fails
  # here, before the directory is made or anything generated.
  problems = training_problems(cc.task, cc.n, cc.seed)
  task = tasks_lib.get_task(cc.task)
  _prepare_dir(cc, out)
  gcfg = cc.gcfg()
  done = done_batches(out)
  mine = [k for k in range(cc.n_batches()) if k % process_count == process_index]
  todo = [k for k in mine if k not in done]
  kept = sum(done[k]["kept"] for k in mine if k in done)
  attempted = sum(done[k]["attempted"] for k in mine if k in done)
  bar = tqdm(total=len(mine), initial=len(mine) - len(todo), disable=not progress, dynamic_ncols=True,
             desc=f"collect {cc.task}", mininterval=1.0)
  bar.set_postfix(kept=kept, rejected=attempted - kept)
  generated = 0
  try:
    for k in todo:
      if stop_after is not None and generated >= stop_after:
        break
      chunk = problems[k * cc.batch:(k + 1) * cc.batch]
      prompts = prompting.prompt_ids(model, task, chunk)
      # Pad the last batch with copies of its last prompt: one batch shape, one compiled program.
      res = dinfer_jax.generate(model, prompts + [prompts[-1]] * (cc.batch - len(prompts)), gcfg)
      rec: dict[str, list] = {c: [] for c in td_data.COLUMNS}
      for r, p in enumerate(chunk):
        text = evaluate.decode(res.tokens[r], model.tokenizer)
        if not task.check(p, text):
          continue
        P = res.prompt_lengths[r]
        rec["index"].append(k * cc.batch + r)
        rec["task"].append(cc.task)
        rec["prompt"].append(p.prompt)
        rec["prompt_ids"].append(res.canvas[r][:P])
        rec["tokens"].append(res.canvas[r][P:])
        rec["commit_step"].append(res.commit_step[r])
        rec["n_steps"].append(res.row_nfe[r])
        rec["answer"].append(text)
      meta = {"batch": k, "attempted": len(chunk), "kept": len(rec["index"]), "process": process_index}
      _write_shard(out / shard_name(process_index, k), rec, meta)
      kept += meta["kept"]
      attempted += meta["attempted"]
      generated += 1
      bar.update(1)
      bar.set_postfix(kept=kept, rejected=attempted - kept)
  finally:
    bar.close()
  return {"attempted": attempted, "kept": kept, "rejected": attempted - kept, "batches": len(mine) - len(todo)
          + generated}


def main(args) -> int:
  # Refusals come before the model is loaded (seconds).
  training_problems(args.task, args.n, args.seed)
  check_own_dir(pathlib.Path(args.out), (CONFIG,), "collect directory")
  model = dinfer_jax.load(args.model, dtype=args.dtype)
  gcfg = evaluate.task_generation_config(args, model.path, args.task, model.tokenizer, split="train",
                                         seed=args.seed)
  cc = CollectConfig(model=args.model, task=args.task, n=args.n, seed=args.seed, batch=args.batch,
                     generation=tuple(sorted(dataclasses.asdict(gcfg).items())))
  out = collect(model, cc, args.out, progress=not args.no_progress, process_index=jax.process_index(),
                process_count=jax.process_count())
  print(json.dumps({"out": str(args.out), "task": args.task, **out}))
  return 0
