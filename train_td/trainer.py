"""Trainer: AdamW (linear warm-up + cosine decay, global-norm clipping), a jitted step with donated
(params, opt_state), orbax checkpoints with resume, tqdm progress and JSON-lines metrics.

Any loss plugs in: `loss_fn(params, batch, rng) -> (loss, metrics)` (see train_td.objective). The run is
deterministic for a seed: batch s is a pure function of (seed, s) (train_td.data) and the step's rng is
fold_in(PRNGKey(seed), s), so an interrupted run resumed from a checkpoint follows the same trajectory.

Run directory layout:
  train_config.json   the TrainConfig (a resumed run must match it, except `steps`: see resumed_config)
  metrics.jsonl       one JSON object per logged step (on resume, lines past the checkpoint are dropped)
  checkpoints/<step>/ orbax checkpoints of {"params", "opt_state"}
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

import dinfer_jax
from dinfer_jax import api, sharding
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import params as params_lib
from train_td import data as data_lib, objective, parallel, tokenizer as tok_lib

TRAIN_CONFIG = "train_config.json"
# The TrainConfig fields that shape train_td's own model; a run with `arch_from` has its model's instead.
ARCH_FIELDS = ("d_model", "n_layers", "n_heads", "n_experts", "n_experts_per_tok", "expert_ffn_dim",
               "max_position", "rope_theta")
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  # model (family llada_moe: MoE every layer, qk-norm, softmax top-k router without renormalisation)
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_experts: int = 8
  n_experts_per_tok: int = 2
  expert_ffn_dim: int = 128
  max_position: int = 64
  rope_theta: float = 10000.0
  # MoE kernel of the training forward: "ragged" computes only the routed experts (1.5x faster steps
  # than "dense" at 8 experts top-2 on CPU); the exported model is the same either way.
  moe_impl: str = "ragged"
  # Memory options for big models (the shipped tiny one needs neither): gradient checkpointing per layer
  # (activations of one layer live at a time; ~1/3 more FLOPs), and the forward/backward in bfloat16 on
  # fp32 master weights and Adam moments (objective.mixed_precision).
  remat: bool = False
  compute_dtype: str = "float32"
  # optimisation
  steps: int = 3000
  # Length of the LR schedule (0: `steps`). A run extended on resume (a larger --steps) keeps the schedule
  # it started with and continues at its final learning rate.
  schedule_steps: int = 0
  batch_size: int = 64
  lr: float = 3e-3
  min_lr_ratio: float = 0.05
  warmup_steps: int = 100
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.98
  clip_norm: float = 1.0
  eps_t: float = 1e-3
  # data
  mix: tuple[tuple[str, float], ...] = data_lib.DEFAULT_MIX
  arithmetic_op_weights: tuple[float, ...] = data_lib.DEFAULT_ARITHMETIC_OP_WEIGHTS  # "+", "-", "*"
  answer_len: int = 8
  # Canvas lengths of the answer region with weights, e.g. ((8, 0.4), (16, 0.2), (32, 0.2), (64, 0.2))
  # (empty: each task's fixed region; train_td.data.DataConfig.canvases), and the share of rows whose
  # answer is also masked from a random cut onwards, as block-wise decoding leaves it
  # (train_td.objective.sample_block_cut). Together they make the answer independent of the canvas.
  canvases: tuple[tuple[int, float], ...] = ()
  block_mask_prob: float = 0.0
  # "canvas": the cut anywhere in the answer region; "task": within the task's own region (the block an
  # 8-token answer is decoded in), however long the canvas
  block_cut_span: str = "canvas"
  seed: int = 0
  # start from another run's latest checkpoint, or from a model ("default" or an HF directory) of this
  # architecture: params only, fresh optimizer and schedule (fine-tuning)
  init_from: str = ""
  # the architecture of this model (a directory or "default"; TD runs: the base): any family dinfer_jax
  # loads (LLaDA-MoE-7B-A1B, dense LLaDA, LLaDA2), its config.json in place of the ARCH_FIELDS above
  # (train_config.json then omits them), and export writes its format and tokenizer
  arch_from: str = ""
  # bookkeeping
  log_every: int = 10
  ckpt_every: int = 250
  keep_checkpoints: int = 2

  def __post_init__(self):
    positive = ("d_model", "n_layers", "n_heads", "n_experts", "n_experts_per_tok", "expert_ffn_dim",
                "max_position", "steps", "batch_size", "answer_len", "log_every", "ckpt_every",
                "keep_checkpoints")
    for name in positive:
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    for name in ("warmup_steps", "schedule_steps"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
        raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
    for name in ("lr", "clip_norm", "eps_t", "rope_theta"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a number > 0, got {v!r}")
    for name, hi in (("min_lr_ratio", 1.0), ("b1", 1.0), ("b2", 1.0), ("weight_decay", math.inf)):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and 0 <= v <= hi and not math.isnan(v)):
        raise ValueError(f"{name} must be a number in [0, {hi}], got {v!r}")
    if not (isinstance(self.block_mask_prob, (int, float)) and 0 <= self.block_mask_prob <= 1):
      raise ValueError(f"block_mask_prob must be a number in [0, 1], got {self.block_mask_prob!r}")
    if self.block_cut_span not in objective.BLOCK_CUT_SPANS:
      raise ValueError(f"block_cut_span must be one of {objective.BLOCK_CUT_SPANS}, got {self.block_cut_span!r}")
    if not isinstance(self.remat, bool):
      raise ValueError(f"remat must be a bool, got {self.remat!r}")
    if self.compute_dtype not in objective.COMPUTE_DTYPES:
      raise ValueError(f"compute_dtype must be one of {objective.COMPUTE_DTYPES}, got {self.compute_dtype!r}")
    if self.n_experts_per_tok > self.n_experts:
      raise ValueError(f"n_experts_per_tok={self.n_experts_per_tok} exceeds n_experts={self.n_experts}")

  @property
  def total_schedule_steps(self) -> int:
    return self.schedule_steps or self.steps

  def model_config(self) -> ModelConfig:
    return model_config_from(self)

  def data_config(self) -> data_lib.DataConfig:
    return data_lib.DataConfig(mix=tuple(tuple(m) for m in self.mix), batch_size=self.batch_size,
                               answer_len=self.answer_len, seed=self.seed,
                               canvases=tuple((int(c), float(w)) for c, w in self.canvases),
                               arithmetic_op_weights=tuple(self.arithmetic_op_weights))

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    return {k: v for k, v in d.items() if not (self.arch_from and k in ARCH_FIELDS)}

  @classmethod
  def from_json(cls, d: dict) -> "TrainConfig":
    d = dict(d)
    if "mix" in d:
      d["mix"] = tuple((str(n), float(w)) for n, w in d["mix"])
    if "canvases" in d:
      d["canvases"] = tuple((int(c), float(w)) for c, w in d["canvases"])
    # Runs written before the field existed drew the operators uniformly.
    d["arithmetic_op_weights"] = tuple(float(w) for w in d.get("arithmetic_op_weights", (1.0, 1.0, 1.0)))
    return cls(**d)


def model_config_from(tc: TrainConfig) -> ModelConfig:
  if tc.moe_impl not in ("dense", "ragged"):
    raise ValueError(f"moe_impl must be 'dense' or 'ragged', got {tc.moe_impl!r}")
  if tc.arch_from:
    # The loss picks its MoE kernel from tc.moe_impl; the config's is the exported model's business.
    return dataclasses.replace(api.load_config(tc.arch_from)[0], moe_impl="dense")
  if tc.d_model % tc.n_heads:
    raise ValueError(f"d_model={tc.d_model} must be divisible by n_heads={tc.n_heads}")
  return ModelConfig(
      family="llada_moe", vocab_size=tok_lib.VOCAB_SIZE, d_model=tc.d_model, n_layers=tc.n_layers,
      n_heads=tc.n_heads, n_kv_heads=tc.n_heads, head_dim=tc.d_model // tc.n_heads, n_experts=tc.n_experts,
      n_experts_per_tok=tc.n_experts_per_tok, expert_ffn_dim=tc.expert_ffn_dim, router="softmax",
      qk_norm=True, rope_theta=tc.rope_theta, rms_eps=1e-5, max_position=tc.max_position,
      mask_token_id=tok_lib.MASK_ID, eos_token_id=tok_lib.EOS_ID, pad_token_id=tok_lib.PAD_ID,
      moe_impl="dense")


def make_schedule(tc: TrainConfig) -> optax.Schedule:
  # Past decay_steps optax holds end_value: an extended run continues at the final learning rate.
  n = tc.total_schedule_steps
  warm = max(1, min(tc.warmup_steps, n))
  return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=tc.lr, warmup_steps=warm,
                                            decay_steps=max(n, warm + 1),
                                            end_value=tc.lr * tc.min_lr_ratio)


def _decay_mask(params):
  # No weight decay on norm weights (1-D per layer) and embeddings.
  def keep(path, x):
    name = path[-1].key if hasattr(path[-1], "key") else str(path[-1])
    return not (name.endswith("norm") or name == "embed")
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(tc.clip_norm),
      optax.adamw(make_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=_decay_mask))


def step_function(loss_fn: objective.LossFn, optimizer: optax.GradientTransformation):
  """The un-jitted (params, opt_state, batch, rng) -> (params, opt_state, metrics) of any loss."""

  def step(params, opt_state, batch, rng):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
    return params, opt_state, metrics

  return step


def make_train_step(loss_fn: objective.LossFn, optimizer: optax.GradientTransformation, *,
                    mesh: jax.sharding.Mesh | None = None, cfg: ModelConfig | None = None):
  """Jitted (params, opt_state, batch, rng) -> (params, opt_state, metrics); params and opt_state donated.
  With a mesh (and the model config, which decides the weights' shardings) it is the data + model
  parallel step of train_td.parallel (its place_state puts fresh or restored state onto the mesh)."""
  step = step_function(loss_fn, optimizer)
  if mesh is None:
    return jax.jit(step, donate_argnums=(0, 1))
  if cfg is None:
    raise ValueError("make_train_step: a mesh needs the model config (cfg=) to shard the params")
  return parallel.ShardedStep(step, cfg, optimizer, mesh)


@functools.lru_cache(maxsize=8)
def _default_step(tc: TrainConfig, mesh: jax.sharding.Mesh | None = None):
  # One compiled step per config: runs of the same config in one process (tests, resume) reuse it.
  return make_train_step(objective.make_loss_fn(tc.model_config(), eps=tc.eps_t, moe_impl=tc.moe_impl,
                                               remat=tc.remat, compute_dtype=tc.compute_dtype,
                                               block_prob=tc.block_mask_prob,
                                               block_cut_span=tc.block_cut_span),
                         make_optimizer(tc), mesh=mesh, cfg=tc.model_config())


def init_state(tc: TrainConfig, optimizer=None):
  cfg = tc.model_config()
  params = params_lib.init_params(cfg, jax.random.PRNGKey(tc.seed), jnp.float32)
  optimizer = optimizer or make_optimizer(tc)
  return params, optimizer.init(params)


def _manager(run_dir: pathlib.Path, tc: TrainConfig, writer: bool = False):
  """writer: the training run's own manager. It removes the temporary step directory a save cut short by Ctrl-C
  or SIGTERM left; a reader (restore, eval of a running run) must not, since the writer may be in that save."""
  return ocp.CheckpointManager(
      (run_dir / CHECKPOINTS).absolute(),
      options=ocp.CheckpointManagerOptions(max_to_keep=tc.keep_checkpoints, create=True,
                                           enable_async_checkpointing=False, cleanup_tmp_directories=writer))


def _init_from_params(tc: TrainConfig) -> Any:
  """The fp32 params `tc.init_from` names: a run directory's latest checkpoint, else a loadable model whose
  architecture is tc's (checked before the run directory is touched)."""
  if latest_step(tc.init_from) is not None:
    return restore(tc.init_from)[0]
  try:
    model = dinfer_jax.load(tc.init_from, dtype="float32")
  except (OSError, ValueError) as e:
    raise FileNotFoundError(f"init_from: {tc.init_from} is neither a run directory with checkpoints nor a "
                            f"model ({e})") from None
  want = tc.model_config()
  if dataclasses.replace(model.config, moe_impl=want.moe_impl) != want:
    raise ValueError(f"init_from: {tc.init_from} is a {model.config} model, but this run builds {want}; "
                     "give the same architecture flags (e.g. --max-position)")
  return jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32), params_lib.stack_layers(model.params))


def latest_step(run_dir: os.PathLike) -> int | None:
  d = pathlib.Path(run_dir) / CHECKPOINTS
  if not d.is_dir():
    return None
  steps = [int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()]
  return max(steps) if steps else None


def restore(run_dir: os.PathLike, tc: TrainConfig | None = None, step: int | None = None,
            optimizer=None, shardings: tuple[Any, Any] | None = None) -> tuple[Any, Any, int]:
  """(params, opt_state, step) from a run directory's checkpoint (latest unless `step`).
  shardings: (params, opt_state) sharding trees to restore onto (a mesh run's, train_td.parallel);
  default: the first local device, whatever topology the checkpoint was saved from."""
  run_dir = pathlib.Path(run_dir)
  tc = tc or load_train_config(run_dir)
  step = latest_step(run_dir) if step is None else step
  if step is None:
    raise FileNotFoundError(f"{run_dir}: no checkpoints")
  cfg = tc.model_config()
  abstract_params = params_lib.abstract_params(cfg, jnp.float32)
  optimizer = optimizer or make_optimizer(tc)
  abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
  if shardings is None:
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = tuple(jax.tree_util.tree_map(lambda _: one, t) for t in (abstract_params, abstract_opt))
  with_sharding = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)  # noqa: E731
  target = {"params": jax.tree_util.tree_map(with_sharding, abstract_params, shardings[0]),
            "opt_state": jax.tree_util.tree_map(with_sharding, abstract_opt, shardings[1])}
  mngr = _manager(run_dir, tc)
  try:
    state = mngr.restore(step, args=ocp.args.StandardRestore(target))
  finally:
    mngr.close()
  return state["params"], state["opt_state"], step


def load_train_config(run_dir: os.PathLike) -> TrainConfig:
  f = pathlib.Path(run_dir) / TRAIN_CONFIG
  if not f.is_file():
    raise FileNotFoundError(f"{run_dir}: not a run directory ({TRAIN_CONFIG} not found)")
  try:
    return TrainConfig.from_json(json.loads(f.read_text()))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{f}: {e}") from None


# Fields a resumed run may change: `steps` extends (or shortens) the run without touching its schedule.
RESUMABLE_CHANGES = ("steps",)


def resumed_config(saved: TrainConfig, tc: TrainConfig, cfg_path: os.PathLike, have: int | None) -> TrainConfig:
  """The config a resumed run continues with; a ValueError names every field that may not change."""
  diff = [f.name for f in dataclasses.fields(TrainConfig) if getattr(saved, f.name) != getattr(tc, f.name)
          and f.name not in RESUMABLE_CHANGES + ("schedule_steps",)]
  if diff:
    what = ", ".join(f"{n} (saved {getattr(saved, n)!r}, given {getattr(tc, n)!r})" for n in diff)
    raise ValueError(f"{cfg_path}: this run was started with different settings: {what}; resume with the saved "
                     "values (omit the flags) or use a new run directory")
  if have is not None and tc.steps < have:
    raise ValueError(f"steps={tc.steps} is below the run's latest checkpoint (step {have})")
  return dataclasses.replace(saved, steps=tc.steps, schedule_steps=saved.total_schedule_steps)


def _write_json_atomic(path: pathlib.Path, obj) -> None:
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  tmp.write_text(json.dumps(obj, indent=2) + "\n")
  os.replace(tmp, path)


def _truncate_metrics(path: pathlib.Path, step: int) -> None:
  """Drops metrics logged after `step` (a killed run logged them, then lost them with its checkpoint),
  so a resumed run does not log those steps twice. A torn line (the run was killed while writing it) goes
  too, with a warning naming the file and line."""
  if not path.exists():
    return
  keep, later = [], 0
  lines = path.read_text().splitlines()
  for no, line in enumerate(lines, 1):
    try:
      logged = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
      where = "last line" if no == len(lines) else "line"
      warnings.warn(f"{path}:{no}: {where} is not a whole metrics record ({line[:60]!r}); dropped")
      continue
    if logged <= step:
      keep.append(line)
    else:
      later += 1
  if later:
    if step == 0:
      warnings.warn(f"{path}: dropped {later} record(s) of an earlier run that saved no checkpoint; this run "
                    "starts at step 0")
    else:
      warnings.warn(f"{path}: dropped {later} record(s) logged after step {step}, the checkpoint this run "
                    "resumes from (they are logged again)")
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  tmp.write_text("".join(x + "\n" for x in keep))
  os.replace(tmp, path)


# What a run directory may hold besides its own files: anything else there is someone else's directory.
RUN_MARKERS = (TRAIN_CONFIG, "td_config.json")


def check_own_dir(path: pathlib.Path, markers: tuple[str, ...], what: str) -> None:
  """Refuses an existing, non-empty directory holding none of `markers` (not one of ours: writing into it
  would mix our files with the user's); a new or empty directory is fine."""
  if path.exists() and not path.is_dir():
    raise FileExistsError(f"{path} exists and is not a directory")
  if path.is_dir() and any(path.iterdir()) and not any((path / m).exists() for m in markers):
    raise FileExistsError(f"{path} exists and is not a {what} (no {' or '.join(markers)}); give a new or "
                          "empty directory")


@jax.jit
def _first_nonfinite(first: jax.Array, loss: jax.Array, grad_norm: jax.Array, step: int) -> jax.Array:
  bad = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
  return jnp.where((first < 0) & bad, jnp.int32(step), first)


class NonFiniteError(FloatingPointError):
  """A step's loss or gradient norm, or the weights about to be saved or resumed from, were NaN/inf: the run
  stopped before saving."""


def _refuse_nonfinite_weights(params: Any, what: str) -> None:
  # A weight can turn NaN/inf while the loss stays finite (a vocabulary row no batch reaches, say). Saving
  # it would let retention delete the last finite checkpoint, so every checkpoint is checked first: a count
  # per leaf at each save, small beside writing all of them.
  bad = params_lib.nonfinite_weights(params)
  if bad:
    raise NonFiniteError(f"{what}: NaN/inf weights in {params_lib.nonfinite_names(bad)}; stopped without saving. "
                         "Check the data (train_td.td_data.check_shard), the learning rate and the starting weights")


def _stop_if_nonfinite(first_bad: int, mngr) -> None:
  # Checked where the loop syncs anyway (a log line or a checkpoint), not every step: the steps after a bad
  # one are not saved either.
  if first_bad >= 0:
    raise NonFiniteError(f"step {first_bad}: the loss or the gradient norm is NaN/inf; stopped without saving "
                         f"(the last checkpoint, step {mngr.latest_step()}, is kept). Check the data "
                         "(train_td.td_data.check_shard) and the learning rate")


def train(tc: TrainConfig, run_dir: os.PathLike, *, resume: bool | None = None,
          loss_fn: objective.LossFn | None = None,
          get_batch: Callable[[int], tuple[str, dict]] | None = None,
          progress: bool = True, stop_at: int | None = None, init_params: Any | None = None,
          mesh: jax.sharding.Mesh | None = None) -> dict[str, Any]:
  """Trains (or resumes) a run.

  Args:
    tc: the run's configuration.
    run_dir: directory for config, metrics and checkpoints.
    resume: True to require a checkpoint, False to refuse an existing one; None resumes if one exists.
    loss_fn: `loss_fn(params, batch, rng) -> (loss, metrics)`; default the masked-diffusion SFT loss.
    get_batch: step -> (tag, batch dict); default the task mix of train_td.data.
    progress: show a tqdm bar.
    stop_at: stop (with a checkpoint) after this step instead of tc.steps (the schedule still spans
      tc.steps; used to test resuming).
    init_params: params to start from when the run has no checkpoint yet (fresh optimizer), e.g. a loaded
      base model for trajectory distillation; a resumed run ignores it.
    mesh: run the step data + model parallel on this (data, tensor, expert) mesh (sharding.make_mesh;
      it may span several processes after jax.distributed.initialize); batch_size must be a multiple of
      its data axis.

  Returns:
    {"params", "step", "last_metrics", "seconds"}.
  """

  # Everything that can be refused is refused before anything is written to the run directory.
  tc.model_config()
  run_dir = pathlib.Path(run_dir)
  check_own_dir(run_dir, RUN_MARKERS, "train_td run directory")
  cfg_path = run_dir / TRAIN_CONFIG
  have = latest_step(run_dir)
  if resume and have is None:
    raise FileNotFoundError(f"--resume: {run_dir} has no checkpoints to resume from")
  if resume is False and have is not None:
    raise FileExistsError(f"{run_dir} already has checkpoints (step {have}); resume or use a new directory")
  if cfg_path.exists():
    tc = resumed_config(load_train_config(run_dir), tc, cfg_path, have)
  elif have is not None:
    raise ValueError(f"{run_dir} has checkpoints but no {TRAIN_CONFIG}; use a new run directory")
  dcfg = tc.data_config()
  start_params = _init_from_params(tc) if tc.init_from and have is None and init_params is None else None
  run_dir.mkdir(parents=True, exist_ok=True)
  if jax.process_index() == 0:  # one writer when several processes share the run directory
    _write_json_atomic(cfg_path, tc.to_json())

  optimizer = make_optimizer(tc)
  if get_batch is None:
    get_batch = lambda s: data_lib.get_batch(dcfg, s)  # noqa: E731
  step_fn = (_default_step(tc, mesh) if loss_fn is None
             else make_train_step(loss_fn, optimizer, mesh=mesh, cfg=tc.model_config()))

  if have is not None:
    state_sh = None if mesh is None else (step_fn.param_shardings, step_fn.opt_shardings)
    params, opt_state, start = restore(run_dir, tc, have, optimizer, shardings=state_sh)
    _refuse_nonfinite_weights(params, f"{run_dir} checkpoint step {start}, the one this run resumes from")
  else:
    params, opt_state = init_state(tc, optimizer)
    if init_params is not None:
      params = jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32), init_params)  # a copy: donated
      opt_state = optimizer.init(params)
    elif start_params is not None:
      params, opt_state = start_params, optimizer.init(start_params)
    start = 0
    if mesh is not None:
      params, opt_state = step_fn.place_state(params, opt_state)
  if jax.process_index() == 0:
    _truncate_metrics(run_dir / METRICS, start)
  end = tc.steps if stop_at is None else min(stop_at, tc.steps)
  base_key = jax.random.PRNGKey(tc.seed)
  schedule = make_schedule(tc)
  mngr = _manager(run_dir, tc, writer=True)
  t_start = time.time()
  last: dict[str, Any] = {}
  bar = tqdm(total=end, initial=start, disable=not progress, dynamic_ncols=True, mininterval=2.0)
  window_tokens, window_t = 0, time.time()
  first_bad = jnp.int32(-1)  # on the device: the first step whose loss or gradient norm was not finite
  try:
    with open(run_dir / METRICS, "a") as mf:
      for s in range(start, end):
        tag, batch = get_batch(s)
        window_tokens += data_lib.n_tokens(batch)
        params, opt_state, metrics = step_fn(params, opt_state, batch, jax.random.fold_in(base_key, s))
        done = s + 1
        first_bad = _first_nonfinite(first_bad, metrics["loss"], metrics.get("grad_norm", metrics["loss"]), done)
        if done % tc.log_every == 0 or done % tc.ckpt_every == 0 or done == end:
          _stop_if_nonfinite(int(first_bad), mngr)  # before the step is logged or saved
        if done % tc.log_every == 0 or done == end:
          m = {k: float(sharding.to_host(v)) for k, v in metrics.items()}
          now = time.time()
          tps = window_tokens / max(now - window_t, 1e-9)
          window_tokens, window_t = 0, now
          last = dict(step=done, task=tag, lr=float(schedule(s)), tokens_per_s=tps,
                      elapsed_s=now - t_start, **m)
          if jax.process_index() == 0:
            mf.write(json.dumps(last) + "\n")
            mf.flush()
          bar.set_postfix(loss=f"{m['loss']:.4f}", acc=f"{m.get('masked_acc', float('nan')):.3f}",
                          tok_s=f"{tps:.0f}")
        bar.update(1)
        if done % tc.ckpt_every == 0 or done == end:
          _refuse_nonfinite_weights(params, f"step {done} (the last checkpoint, step {mngr.latest_step()}, "
                                    "is kept)")
          mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), force=True)
    mngr.wait_until_finished()
  finally:
    bar.close()
    mngr.close()
  return {"params": params, "step": end, "last_metrics": last, "seconds": time.time() - t_start}
