"""Trajectory-distillation runs: the same trainer, the TD loss, golden-trajectory batches, base-model init.

  python -m train_td train RUN_DIR --td DATA[,DATA...] [--base default] [--mdm-weight W] [--cf-weight W]
      [--steps N --batch-size B --lr LR ...]

The model's architecture is the base model's (its config.json, any family dinfer_jax loads: TrainConfig
.arch_from); the run starts from the base weights with a fresh optimizer, and `export` writes the base's
format with its tokenizer and generation defaults. `td_config.json` in the run directory records the TD settings next to train_config.json,
and a resumed run must match both; batches are a pure function of (seed, step) over the loaded shards
(td_data.TDData) and the step rng is the trainer's, so an interrupted run resumed from a checkpoint ends
with the same bytes as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import dinfer_jax
from dinfer_jax.model import params as params_lib
from train_td import objective, td_data, trainer

TD_CONFIG = "td_config.json"
ARCH_FIELDS = trainer.ARCH_FIELDS


@dataclasses.dataclass(frozen=True)
class TDConfig:
  """data: collect directories (comma-separated); base: the model distilled (directory or "default");
  mdm_weight: weight of the masked-diffusion loss mixed in; cf_weight: weight of certainty forcing;
  task_weights: ((task, weight), ...) for the batches' task draw (td_data.TDData; empty: by trajectories)."""
  data: str
  base: str = "default"
  mdm_weight: float = 0.0
  cf_weight: float = 0.0
  task_weights: tuple[tuple[str, float], ...] = ()

  def __post_init__(self):
    if not self.data:
      raise ValueError("TDConfig.data: give at least one collect directory")
    for f in ("mdm_weight", "cf_weight"):
      v = getattr(self, f)
      if not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"TDConfig.{f} must be a number >= 0, got {v!r}")
    for item in self.task_weights:
      if len(item) != 2 or not isinstance(item[0], str) or not isinstance(item[1], (int, float)) or item[1] < 0:
        raise ValueError(f"TDConfig.task_weights: expected (task, weight >= 0) pairs, got {item!r}")


def _check_td_config(run_dir: pathlib.Path, tdc: TDConfig, fingerprint: str, allow_data_change: bool) -> None:
  """A new run records its TD settings and its data's fingerprint (td_data.data_fingerprint: the shards'
  contents, not their path); a resumed one must match both (other data: allow_data_change)."""
  f = run_dir / TD_CONFIG
  want = json.loads(json.dumps(dataclasses.asdict(tdc)))  # tuples as JSON gives them back
  if f.exists():
    saved = json.loads(f.read_text())
    saved.setdefault("task_weights", [])  # runs from before the field drew tasks by trajectories
    had = saved.pop("data_fingerprint", None)  # runs from before fingerprints have none
    if saved != want:
      raise ValueError(f"{f} differs from this run's TD settings ({saved}); use a new run directory")
    if had is not None and had != fingerprint and not allow_data_change:
      raise ValueError(f"{f}: the trajectory data changed since this run began (fingerprint {fingerprint[:12]}..., "
                       f"recorded {had[:12]}...); resume with --allow-data-change to train on it anyway")
  else:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = f.with_name(f".{TD_CONFIG}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(dataclasses.asdict(tdc), data_fingerprint=fingerprint), indent=2) + "\n")
    os.replace(tmp, f)


def train(tdc: TDConfig, run_dir: os.PathLike, *, resume: bool | None = None, progress: bool = True,
          stop_at: int | None = None, mesh=None, allow_data_change: bool = False, **train_overrides) -> dict[str, Any]:
  """Runs (or resumes) a TD run; `train_overrides` are TrainConfig fields (steps, lr, batch_size, ...);
  `mesh`: the sharded step of trainer.train (data parallel + the model's tensor/expert sharding);
  allow_data_change: resume on data other than the run began with."""
  base = dinfer_jax.load(tdc.base)
  tc = trainer.TrainConfig(**train_overrides, arch_from=tdc.base)
  # Bad data or weights fail before anything is written.
  data = td_data.TDData.load(tdc.data, tc.batch_size, tc.seed, task_weights=tdc.task_weights,
                             vocab_size=base.config.vocab_size)
  for task, rows in data.rows.items():
    if rows.tokens.shape[1] > base.config.max_position:
      raise ValueError(f"trajectories of {task} need {rows.tokens.shape[1]} positions, more than the base "
                       f"model's max_position={base.config.max_position}")
  run_dir = pathlib.Path(run_dir)
  trainer.check_own_dir(run_dir, trainer.RUN_MARKERS, "train_td run directory")
  _check_td_config(run_dir, tdc, data.fingerprint, allow_data_change)
  loss_fn = objective.make_td_loss_fn(tc.model_config(), mdm_weight=tdc.mdm_weight, cf_weight=tdc.cf_weight,
                                      eps=tc.eps_t, moe_impl=tc.moe_impl, remat=tc.remat,
                                      compute_dtype=tc.compute_dtype)
  return trainer.train(tc, run_dir, resume=resume, loss_fn=loss_fn, get_batch=data.get_batch, progress=progress,
                       stop_at=stop_at, init_params=params_lib.stack_layers(base.params), mesh=mesh)
