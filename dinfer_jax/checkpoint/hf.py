"""Reading HF checkpoints into the param tree, leaf by leaf."""
from __future__ import annotations

import collections
import os
import pathlib
import warnings
from typing import Any

import jax
import numpy as np

from dinfer_jax.checkpoint import keymap
from dinfer_jax.checkpoint.converted import CONFIG_NAME, LazyArray, leaf_dtype, norm_dtype, read_config_file
from dinfer_jax.checkpoint.errors import CheckpointError
from dinfer_jax.checkpoint.safetensors_io import FLOAT_CODES, INDEX_NAME, SINGLE_NAME, WeightSet, dtype_name
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import quant
from dinfer_jax.model.params import abstract_params

FP8_CODE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"


def _count_nonfinite(x: np.ndarray, chunk: int = 1 << 22) -> int:
  """NaN/Inf entries of a float tensor, counted a chunk at a time (no full-size fp32 copy)."""
  flat = x.reshape(-1)
  return sum(int((~np.isfinite(flat[i:i + chunk].astype(np.float32))).sum()) for i in range(0, flat.size, chunk))


def is_hf_checkpoint(path: os.PathLike) -> bool:
  """A directory with config.json and model.safetensors or a safetensors index (contents not checked)."""
  p = pathlib.Path(path)
  return (p / CONFIG_NAME).is_file() and ((p / INDEX_NAME).is_file() or (p / SINGLE_NAME).is_file())


def read_hf_config(path: os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
  """(ModelConfig, raw config.json dict). Raises CheckpointError (missing/bad file) or ConfigError."""
  p = pathlib.Path(path)
  if not p.is_dir():
    raise CheckpointError(f"{p}: not a directory")
  return read_config_file(p)


class HFCheckpoint:
  """An opened and fully validated HF checkpoint: config, tensor headers, layout and key plan.

  Opening reads only headers; it fails (CheckpointError naming key/file/shapes) on any unmapped, missing,
  mis-shaped or non-float tensor before a single weight byte is read.
  """

  def __init__(self, path: os.PathLike, cfg: ModelConfig | None = None, *, nonfinite: str = "error"):
    self.dir = pathlib.Path(path)
    # A NaN or Inf weight makes every forward that touches it NaN. "error" / "warn" while converting;
    # "ignore" when loading, which checks the loaded params (dinfer_jax.load, allow_nonfinite).
    if nonfinite not in ("error", "warn", "ignore"):
      raise ValueError(f"nonfinite must be 'error', 'warn' or 'ignore', got {nonfinite!r}")
    self.nonfinite = nonfinite
    self.cfg, self.raw_config = read_hf_config(self.dir)
    if cfg is not None:
      self.cfg = cfg
    self.weights = WeightSet(self.dir)
    keys = [k for k in self.weights.keys() if not keymap.is_ignored(k)]
    # FP8 checkpoints (DeepSeek-style, LLaDA2.x FP8): float8_e4m3fn weights, each with a
    # `<key>_scale_inv` grid of one fp32 multiplier per block x block tile of [out, in].
    self.scales = {k[:-len(SCALE_SUFFIX)]: k for k in keys if k.endswith(SCALE_SUFFIX)}
    keys = [k for k in keys if not k.endswith(SCALE_SUFFIX)]
    self.quantization = self._fp8_config() if self.scales else None
    self.layout = keymap.detect_layout(self.cfg.family, keys)
    keymap.check_counts(self.cfg, self.layout, keys, str(self.dir))
    self.entries = keymap.plan(self.cfg, self.layout)
    self._validate(keys)
    self.by_leaf = keymap.group_by_leaf(self.entries)

  def _validate(self, keys: list[str]) -> None:
    expected = {e.key: e for e in self.entries}
    extra = [k for k in keys if k not in expected]
    if extra:
      t = self.weights[extra[0]]
      more = f" ({len(extra)} unmapped tensors in all)" if len(extra) > 1 else ""
      raise CheckpointError(f"unmapped tensor {t.name!r} {t.shape} in {t.file.name}: "
                            f"{keymap.explain_unmapped(self.cfg, self.layout, t.name)}{more}")
    missing = [k for k in expected if k not in self.weights]
    if missing:
      more = f" ({len(missing)} missing tensors in all)" if len(missing) > 1 else ""
      raise CheckpointError(f"missing tensor {missing[0]!r} (expected shape {expected[missing[0]].hf_shape}) "
                            f"in {self.dir}{more}")
    stray = [k for k in self.scales if k not in expected]
    if stray:
      raise CheckpointError(f"scale {self.scales[stray[0]]!r} in {self.weights[self.scales[stray[0]]].file.name} "
                            f"has no weight {stray[0]!r} to scale")
    for k, e in expected.items():
      t = self.weights[k]
      if t.shape != e.hf_shape:
        raise CheckpointError(f"tensor {k!r} in {t.file.name} has shape {t.shape}, expected {e.hf_shape}")
      if t.dtype == FP8_CODE:
        self._validate_fp8(k, e)
      elif t.dtype not in FLOAT_CODES:
        raise CheckpointError(f"tensor {k!r} in {t.file.name} has dtype {t.dtype} ({dtype_name(t.dtype)}); "
                              f"weights must be one of {', '.join(FLOAT_CODES + (FP8_CODE,))}")
      elif k in self.scales:
        raise CheckpointError(f"tensor {k!r} in {t.file.name} is {dtype_name(t.dtype)} but has a scale "
                              f"{self.scales[k]!r}; only {dtype_name(FP8_CODE)} weights are scaled")

  def _fp8_config(self):
    qcfg = self.raw_config.get("quantization_config") or {}
    block = qcfg.get("weight_block_size", [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2 or block[0] != block[1]
        or not isinstance(block[0], int) or block[0] < 1):
      raise CheckpointError(f"{self.dir / CONFIG_NAME}: quantization_config.weight_block_size {block!r} is not "
                            "supported (square blocks only, e.g. [128, 128])")
    return quant.QuantConfig("fp8", "block", block[0])

  def _validate_fp8(self, k: str, e) -> None:
    """An FP8 weight: its scale exists, is float, has the block grid's shape, and maps onto a quantised leaf
    tile for tile."""
    t = self.weights[k]
    if k not in self.scales:
      raise CheckpointError(f"tensor {k!r} in {t.file.name} is {dtype_name(FP8_CODE)} but {k + SCALE_SUFFIX!r} "
                            "is missing")
    s = self.weights[self.scales[k]]
    b = self.quantization.block
    want = tuple(t.shape[:-2]) + tuple(-(-d // b) for d in t.shape[-2:])
    if s.shape != want:
      raise CheckpointError(f"scale {s.name!r} in {s.file.name} has shape {s.shape}, expected {want} for weight "
                            f"{k!r} {t.shape} in {b}x{b} blocks")
    if s.dtype not in FLOAT_CODES:
      raise CheckpointError(f"scale {s.name!r} in {s.file.name} has dtype {dtype_name(s.dtype)}; expected a float")
    for p, ps in zip(e.pieces, e.piece_shapes):
      leaf = self._shapes()[p.path]
      if quant.leaf_axes(p.path, len(leaf)) is None:
        continue  # an FP8 tensor of a leaf we keep in the model dtype (router, LM head): dequantised on load
      try:
        quant.tile_shape(p.path, leaf, self.quantization)
      except ValueError as err:
        raise CheckpointError(f"tensor {k!r} in {t.file.name}: its {b}x{b} blocks do not tile "
                              f"{'.'.join(p.path)} {tuple(leaf)}: {err}") from None

  @property
  def source_dtype(self) -> str:
    """The dtype holding most weight bytes (the fp32 router bias does not count)."""
    by = collections.Counter()
    for e in self.entries:
      t = self.weights[e.key]
      if not keymap.is_fp32_key(e.key):
        by[t.dtype] += t.nbytes
    return dtype_name(by.most_common(1)[0][0]) if by else "float32"

  def _read_float(self, key: str) -> np.ndarray:
    """An HF weight as stored, or, for an FP8 one, dequantised (fp32) with its block scales."""
    x = self.weights.read(key)
    if self.weights[key].dtype != FP8_CODE:
      return x
    s = np.asarray(self.weights.read(self.scales[key]), np.float32)
    b = self.quantization.block
    for ax in (-2, -1):
      s = np.repeat(s, b, axis=ax)
    return x.astype(np.float32) * s[tuple(slice(0, n) for n in x.shape)]

  def is_quantised_leaf(self, path: tuple[str, ...]) -> bool:
    """Whether this FP8 checkpoint's leaf comes back as a QArray (fp8 values + block scales as stored)."""
    return self.quantization is not None and quant.leaf_axes(path, len(self._shapes()[path])) is not None

  def build_quantised_leaf(self, path: tuple[str, ...], dtype) -> dict[str, np.ndarray]:
    """{"qvalue", "scale"} of one leaf of an FP8 checkpoint: the FP8 values and their block scales copied
    through the same transforms as the weights (the block grid is the weight's, `block` times smaller), no
    bf16 round trip. A piece stored in a float dtype instead is quantised in the same blocks."""
    qc = self.quantization
    shape = tuple(self._shapes()[path])
    qvalue = np.empty(shape, quant.SCHEMES["fp8"])
    scale = np.empty(quant.scale_shape(path, shape, qc), np.float32)
    for entry, j in self.by_leaf[path]:
      piece = entry.pieces[j]
      if self.weights[entry.key].dtype == FP8_CODE:
        qvalue[piece.index] = entry.to_jax(self.weights.read(entry.key))[j]
        grids = [quant.scale_shape(p.path, tuple(self._shapes()[p.path]), qc)[len(p.index):] for p in entry.pieces]
        s = np.asarray(self.weights.read(self.scales[entry.key]), np.float32)
        scale[piece.index] = entry.transform.to_jax(s, grids)[j]
      else:
        x = np.asarray(entry.to_jax(self.weights.read(entry.key))[j], np.float32)
        q = quant.quantize_leaf(path, x, qc)
        qvalue[piece.index], scale[piece.index] = np.asarray(q.qvalue), np.asarray(q.scale)
    return {"qvalue": qvalue, "scale": scale}

  def build_leaf(self, path: tuple[str, ...], dtype) -> np.ndarray:
    """Allocates one param leaf and fills it HF tensor by HF tensor, casting on the copy."""
    shape = tuple(self._shapes()[path])
    out = np.empty(shape, leaf_dtype(path, dtype))
    for entry, j in self.by_leaf[path]:
      x = self._read_float(entry.key)
      bad = 0 if self.nonfinite == "ignore" else _count_nonfinite(x)
      if bad:
        msg = (f"tensor {entry.key!r} in {self.weights[entry.key].file.name} has {bad} NaN/Inf value(s) "
               f"of {x.size}")
        if self.nonfinite == "error":
          raise CheckpointError(f"{msg} (--allow-nonfinite / allow_nonfinite=True converts it anyway)")
        warnings.warn(msg)
      out[entry.pieces[j].index] = entry.to_jax(x)[j]
      del x  # unmaps the tensor: its pages leave the resident set
    return out

  def _shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
    if not hasattr(self, "_shape_cache"):
      flat = jax.tree_util.tree_flatten_with_path(abstract_params(self.cfg))[0]
      self._shape_cache = {tuple(k.key for k in p): tuple(x.shape) for p, x in flat}
    return self._shape_cache

  def check_quantize(self, quantize):
    """The quantisation to write or load with: an FP8 checkpoint keeps its own (asking for another would
    requantise already-rounded values: load it, then requantise explicitly)."""
    qc = quant.QuantConfig.parse(quantize)
    if self.quantization is None:
      return qc
    if qc is not None and qc != self.quantization:
      raise CheckpointError(f"{self.dir}: already FP8 with {self.quantization.block}x{self.quantization.block} block "
                            f"scales; it cannot be converted to {qc.weights}-{qc.scales} (leave --quantize out)")
    return self.quantization

  def lazy_params(self, dtype, quantize=None) -> dict[str, Any]:
    """The param tree with LazyArray leaves: nothing is read until a leaf is materialised. quantize (a
    model.quant.QuantConfig): the matmul weights in quant.to_storage's form, {"qvalue", "scale"} LazyArrays
    that build the leaf and quantise it once, when the first of the two is written (orbax writes them one
    after the other)."""
    dtype = norm_dtype(dtype)
    quantize = self.check_quantize(quantize)

    def make(path, x):
      p = tuple(k.key for k in path)
      build = lambda: self.build_leaf(p, dtype)  # noqa: E731
      if quantize is None or quant.leaf_axes(p, len(x.shape), quantize) is None:
        return LazyArray(x.shape, x.dtype, build, ".".join(p))
      parts = _QuantisedLeaf(p, build, quantize,
                             (lambda: self.build_quantised_leaf(p, dtype)) if self.is_quantised_leaf(p) else None)
      shapes = {"qvalue": (x.shape, quantize.qtype), "scale": (quant.scale_shape(p, x.shape, quantize), np.float32)}
      return {name: LazyArray(*shapes[name], (lambda n=name: parts.take(n)), ".".join(p + (name,)))
              for name in quant.STORED_PARTS}

    return jax.tree_util.tree_map_with_path(make, abstract_params(self.cfg, dtype))


class _QuantisedLeaf:
  """One weight built and quantised once (or read as stored: `stored` builds both parts), handed out part by
  part; dropped after both parts are taken."""

  def __init__(self, path, build, qc, stored=None):
    self.path, self.build, self.qc, self.stored = path, build, qc, stored
    self.parts: dict[str, np.ndarray] = {}

  def take(self, name: str) -> np.ndarray:
    if not self.parts:
      if self.stored is not None:
        self.parts = self.stored()
      else:
        q = quant.quantize_leaf(self.path, self.build(), self.qc)
        self.parts = {"qvalue": np.asarray(q.qvalue), "scale": np.asarray(q.scale)}
    return self.parts.pop(name)


def load_hf_params(path: os.PathLike, cfg: ModelConfig | None = None, dtype="bfloat16", *,
                   shardings=None) -> dict[str, Any]:
  """Reads an HF checkpoint (either expert layout) into the param tree.

  Args:
    path: HF checkpoint directory (config.json + model.safetensors or a sharded index).
    cfg: the config to map for; default: parsed from config.json.
    dtype: weight dtype of the result ('bfloat16' or 'float32'; expert_bias stays fp32).
    shardings: optional tree of jax.sharding.Sharding (or one Sharding) parallel to the params: each leaf
      is placed with jax.device_put as soon as it is built and the host copy dropped. Ignored for an FP8
      checkpoint (its weights come back as QArrays on one device; dinfer_jax.load places them).

  Returns:
    The tree of abstract_params(cfg, dtype): numpy arrays, or jax arrays when shardings are given.
  """
  ck = HFCheckpoint(path, cfg, nonfinite="ignore")  # dinfer_jax.load refuses them, naming the leaves
  dtype = norm_dtype(dtype)
  abstract = abstract_params(ck.cfg, dtype)
  if shardings is not None and isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree_util.tree_map(lambda _: shardings, abstract)
  if ck.quantization is not None:
    shardings = None  # FP8 leaves come back as QArrays on one device; dinfer_jax.load places them on its mesh

  def one(path, x, *s):
    p = tuple(k.key for k in path)
    if ck.is_quantised_leaf(p):
      parts = ck.build_quantised_leaf(p, dtype)
      return quant.make_qarray(jax.numpy.asarray(parts["qvalue"]), jax.numpy.asarray(parts["scale"]))
    arr = ck.build_leaf(p, dtype)
    return jax.device_put(arr, s[0]) if s else arr

  if shardings is None:
    return jax.tree_util.tree_map_with_path(one, abstract)
  return jax.tree_util.tree_map_with_path(one, abstract, shardings)
