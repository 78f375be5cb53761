"""The small public API: load a checkpoint into a Model, run the plain forward."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import stat
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import checkpoint, hf_quiet
from dinfer_jax.checkpoint.errors import read_json_object
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import params as params_lib, quant
from dinfer_jax.model.transformer import forward as _forward
from dinfer_jax.sharding import param_shardings, use_mesh

ASSETS_DIR = pathlib.Path(__file__).parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "default"
# Embedded models, loadable by name: the default model and its trajectory-distilled variant
# (train_td distill; shipped once it has been trained).
EMBEDDED_MODELS = ("default", "default-td")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
  """A loaded model: config, params (a plain pytree in the engine's per-layer layout: model.params.engine_layout;
  params.stack_layers gives the stacked checkpoint/training layout), tokenizer (None if the checkpoint ships
  none)."""
  config: ModelConfig
  params: Any
  tokenizer: Any = None
  mesh: jax.sharding.Mesh | None = None
  path: str | None = None


def resolve_path(path: str | os.PathLike | None) -> pathlib.Path:
  """`None` or "default" is the embedded default model, "default-td" its TD variant; anything else is a
  directory."""
  name = "default" if path is None else str(path)
  if name in EMBEDDED_MODELS:
    d = ASSETS_DIR / name
    if not (d / "config.json").exists():
      hint = " (make it with `python -m train_td distill`, see train_td/README.md)" if name != "default" else ""
      raise FileNotFoundError(f"the embedded model {name!r} is not installed at {d}{hint}")
    return d
  p = pathlib.Path(path)
  if not p.is_dir():
    raise FileNotFoundError(f"model path {p} is not a directory")
  return p


# Tokenizer files are a few MB (LLaDA2's tokenizer.json: 7 MB); anything far larger is not one.
MAX_TOKENIZER_FILE_BYTES = 256 * 2**20


def load_tokenizer(path: pathlib.Path):
  present = [f for f in TOKENIZER_FILES if (path / f).exists()]
  if not present:
    return None
  for f in present:  # a FIFO would block the read for ever, /dev/zero fill the memory: check before reading
    st = os.stat(path / f)
    if not stat.S_ISREG(st.st_mode):
      raise checkpoint.CheckpointError(f"{path / f}: not a regular file; refusing to read it as a tokenizer")
    if st.st_size > MAX_TOKENIZER_FILE_BYTES:
      raise checkpoint.CheckpointError(f"{path / f}: {st.st_size} bytes, more than a tokenizer file holds "
                                       f"(at most {MAX_TOKENIZER_FILE_BYTES})")
  transformers = hf_quiet.import_transformers()  # heavy import: only when a tokenizer is there
  try:
    with hf_quiet.errors_only():
      return transformers.AutoTokenizer.from_pretrained(str(path))
  except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many types; the message names the file
    for f in present:  # a file that is not even JSON is named as such
      if f.endswith(".json"):
        try:
          json.loads((path / f).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as bad:
          raise checkpoint.CheckpointError(f"{path / f}: cannot parse: {bad}") from None
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise checkpoint.CheckpointError(f"{path}: cannot load the tokenizer ({', '.join(present)}): "
                                     f"{type(e).__name__}: {msg}") from None


def load_config(path: str | os.PathLike | None = None) -> tuple[ModelConfig, dict]:
  """(ModelConfig, config.json dict) of a model directory or name, without reading any weights."""
  return checkpoint.converted.read_config_file(resolve_path(path))


def load(path: str | os.PathLike | None = None, *, dtype: str = "float32",
         mesh: jax.sharding.Mesh | None = None, quantize: "str | quant.QuantConfig | None" = None,
         allow_nonfinite: bool = False) -> Model:
  """Loads an HF checkpoint directory or a converted (orbax) one.

  Args:
    path: a directory, or None / "default" for the embedded default model.
    dtype: weight dtype ("float32" or "bfloat16"; the router's expert_bias stays fp32).
    mesh: optional (data, tensor, expert) mesh (sharding.make_mesh); weights are placed straight into
      their tensor/expert-parallel shardings as they are read.
    quantize: None (as stored), "int8" or "fp8" (per-channel scales), "int8-block" / "fp8-block" (128x128
      blocks) or a model.quant.QuantConfig: the attention and FFN/expert weights are quantised on load
      (model/quant.py). An 8-bit checkpoint (converted with --quantize, or an HF FP8 one with
      weight_scale_inv blocks) loads as stored when this is None, and is requantised otherwise.
    allow_nonfinite: load weights holding NaN or Inf (refused by default, naming them: such a model answers
      pad tokens, or nothing, without another sign).
  """
  qc = quant.QuantConfig.parse(quantize)
  p = resolve_path(path)
  if checkpoint.is_converted_checkpoint(p):
    cfg, _ = load_config(p)
    # 8-bit leaves are read onto one device and placed below, once their QArrays exist.
    shardings = None if checkpoint.converted.read_meta(p).get("quantization") else _shardings(cfg, dtype, mesh)
    params, cfg, _ = checkpoint.load_converted(p, dtype=dtype, shardings=shardings)
  elif checkpoint.is_hf_checkpoint(p):
    cfg, _ = checkpoint.read_hf_config(p)
    shardings = _shardings(cfg, dtype, mesh)
    params = checkpoint.load_hf_params(p, cfg, dtype, shardings=shardings)
    if shardings is None:
      params = jax.tree_util.tree_map(jnp.asarray, params)
  else:
    raise checkpoint.CheckpointError(f"{p}: neither an HF checkpoint (config.json + *.safetensors) nor a "
                                     "converted dinfer-jax checkpoint")
  bad = [] if allow_nonfinite else params_lib.nonfinite_weights(params)
  if bad:
    raise checkpoint.CheckpointError(f"{p}: the model {params_lib.describe_nonfinite(bad)} "
                                     "(allow_nonfinite=True loads it anyway)")
  if qc is not None:
    # An 8-bit checkpoint asked for another format (e.g. FP8 block scales -> per channel, the fast GEMM path)
    # is requantised leaf by leaf; one already in that format is kept as stored.
    params = quant.quantize_params(params, qc)
  cfg = with_generation_stops(cfg, p)
  # The engine's layout, once (per-layer buffers on their shardings): every generate call runs on it as it
  # is. Training wants the stacked layers back: params.stack_layers.
  params = params_lib.engine_layout(params, cfg, mesh)
  return Model(config=cfg, params=params, tokenizer=load_tokenizer(p), mesh=mesh, path=str(p))


def with_generation_stops(cfg: ModelConfig, path: pathlib.Path) -> ModelConfig:
  """The model's stop tokens with those its HF generation_config.json lists as eos_token_id (LLaDA2.2 ends a
  turn with <|role_end|> besides <|endoftext|>)."""
  f = path / "generation_config.json"
  if not f.is_file():
    return cfg
  eos = read_json_object(f, checkpoint.CheckpointError).get("eos_token_id")
  extra = [eos] if isinstance(eos, int) else [t for t in eos if isinstance(t, int)] if isinstance(eos, list) else []
  if not extra or set(extra) <= set(cfg.stop_token_ids):
    return cfg
  return cfg.replace(stop_token_ids=cfg.stop_token_ids + tuple(extra))


def _shardings(cfg: ModelConfig, dtype, mesh):
  if mesh is None:
    return None
  return param_shardings(params_lib.abstract_params(cfg, dtype), params_lib.logical_axes(cfg), mesh)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _jit_forward(params, tokens, cfg):
  return _forward(params, cfg, tokens).logits


def forward(model: Model, token_ids) -> jax.Array:
  """fp32 logits [B, T, V] of the full bidirectional forward (no cache, no mask, positions 0..T-1)."""
  tokens = jnp.asarray(np.asarray(token_ids, dtype=np.int32))
  if tokens.ndim == 1:
    tokens = tokens[None]
  if tokens.ndim != 2:
    raise ValueError(f"forward: token_ids must be [T] or [B, T], got shape {tuple(tokens.shape)}")
  if tokens.shape[1] > model.config.max_position:
    raise ValueError(f"forward: {tokens.shape[1]} tokens exceed the model's max_position={model.config.max_position}")
  with use_mesh(model.mesh):
    return _jit_forward(model.params, tokens, model.config)
