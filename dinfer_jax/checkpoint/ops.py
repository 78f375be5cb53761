"""The conversions: hf2jax, jax2hf and inspect."""
from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import numpy as np

from dinfer_jax.checkpoint import keymap
from dinfer_jax.checkpoint.converted import (PARAMS_DIR, copy_aux_files, is_converted_checkpoint, norm_dtype,
                                             orbax_metadata, read_config_file, read_meta, restore_leaves_numpy,
                                             save_converted, write_config)
from dinfer_jax.checkpoint.errors import CheckpointError
from dinfer_jax.checkpoint.hf import SCALE_SUFFIX, HFCheckpoint, is_hf_checkpoint
from dinfer_jax.checkpoint.outdir import atomic_dir
from dinfer_jax.checkpoint.safetensors_io import INDEX_NAME, OutTensor, WeightSet, dtype_name, write_checkpoint
from dinfer_jax.model import quant

# HF's usual shard size: small enough for hub uploads, large enough to keep the file count low.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def _du(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def hf2jax(src: os.PathLike, dst: os.PathLike, dtype="bfloat16", *, overwrite: bool = False,
           replace_unmarked: bool = False, allow_nonfinite: bool = False, quantize=None) -> dict[str, Any]:
  """HF checkpoint directory -> converted checkpoint directory (see converted.py for the layout).

  The whole HF checkpoint is validated from its headers first; then each param leaf is built from its HF
  tensors, written by orbax and dropped before the next, so peak host memory is about one stacked leaf plus
  the HF tensor being copied (dinfer_jax/checkpoint/measure_memory.py measures it). DST may not be SRC, contain it or lie
  inside it; an existing DST is replaced only with overwrite, and only if dinfer-jax wrote it unless
  replace_unmarked (outdir.py). A NaN or Inf weight is an error naming the tensor and file, unless
  allow_nonfinite (then a warning). quantize ("int8", "fp8", "int8-block", "fp8-block" or a
  model.quant.QuantConfig): the matmul weights are stored 8-bit with their scales, each quantised as it is
  built (model/quant.py); the rest in `dtype`.

  Returns:
    Summary: tensors, n_params, bytes (param bytes in the target dtype), disk_bytes, layout, dtype,
    source_dtype, family, seconds.
  """
  t0 = time.time()
  dtype = norm_dtype(dtype)
  ck = HFCheckpoint(src, nonfinite="warn" if allow_nonfinite else "error")
  qc = quant.QuantConfig.parse(quantize)
  if qc is not None and qc.runtime_only:
    raise CheckpointError(f"quantize {quantize!r}: 8-bit activations (+a8) and the 8-bit embedding table (+embed) "
                          "are chosen when a model is loaded (dinfer_jax.load(quantize=...)), not stored")
  qc = ck.check_quantize(qc)  # an FP8 source stays as it is
  out = save_converted(dst, ck.lazy_params(dtype, qc), ck.raw_config, src_dir_for_tokenizer=src, layout=ck.layout,
                       overwrite=overwrite, source_dtype=ck.source_dtype, sources=[src],
                       replace_unmarked=replace_unmarked, quantization=qc.to_dict() if qc else None)
  return {"tensors": len(ck.entries), "n_params": out["n_params"], "bytes": out["bytes"],
          "disk_bytes": _du(pathlib.Path(dst)), "layout": ck.layout, "dtype": dtype.name,
          "source_dtype": ck.source_dtype, "family": ck.cfg.family, "seconds": time.time() - t0,
          "quantization": _quant_label(qc.to_dict() if qc else None)}


def _quant_label(q) -> str | None:
  return None if not q else f"{q['weights']} weights, {q['scales']} scales" + (
      f" ({q['block']}x{q['block']})" if q["scales"] == "block" else "") + (", LM head too" if q.get("lm_head") else "")


def jax2hf(src: os.PathLike, dst: os.PathLike, *, dtype=None, layout: str | None = None, overwrite: bool = False,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, replace_unmarked: bool = False) -> dict[str, Any]:
  """Converted checkpoint -> HF safetensors directory (shards + model.safetensors.index.json).

  Args:
    src: converted checkpoint directory.
    dst: output directory; must not exist unless overwrite; never SRC, containing it or inside it.
    dtype: output weight dtype; default the HF source's dtype recorded at conversion (dinfer_jax.json
      source_dtype). expert_bias is always written fp32. bf16 -> bf16 and bf16 -> f32 -> bf16 are bit-exact.
    layout: 'per_expert' or 'fused' expert tensors; default the source's layout. config.json is written back
      verbatim either way (dInfer's fused loader reads the same config).
    overwrite: replace an existing dst (only one dinfer-jax wrote, unless replace_unmarked).
    max_shard_bytes: start a new shard file past this size.
    replace_unmarked: with overwrite, also replace a directory dinfer-jax did not write.

  Leaves are restored from orbax a few at a time (those one group of HF tensors needs), so peak memory is
  about the largest such group (one leaf; gate+up for fused w13) plus one HF tensor.
  """
  t0 = time.time()
  src = pathlib.Path(src)
  meta = read_meta(src)
  q = meta.get("quantization")
  if q and (q["weights"], q["scales"]) != ("fp8", "block"):
    raise CheckpointError(f"{src}: holds {_quant_label(q)}; HF checkpoints have an 8-bit layout for FP8 with "
                          "block scales only (weight_scale_inv): convert the HF source with --quantize fp8 "
                          "--scales block, or without --quantize")
  cfg, raw = read_config_file(src)
  layout = layout or meta.get("source_layout", "per_expert")
  default = meta["dtype"] if q else (meta.get("source_dtype") or meta["dtype"])
  out_dtype = norm_dtype(dtype if dtype is not None else default)
  entries = keymap.plan(cfg, layout)
  stored = orbax_metadata(src)
  quantised = {path[:-1] for path in stored if path[-1] == "qvalue"}

  # Group HF tensors by the set of leaves they read, in first-use order, so each leaf is restored once.
  groups: dict[tuple[tuple[str, ...], ...], list[keymap.Entry]] = {}
  for e in entries:
    groups.setdefault(tuple(sorted({p.path for p in e.pieces})), []).append(e)
  ordered = [e for g in groups.values() for e in g]
  by_key = {e.key: e for e in ordered}
  tensors = []
  for e in ordered:
    if e.pieces[0].path in quantised:
      # FP8 with block scales: the values as stored and one fp32 multiplier per block of [out, in]
      # (DeepSeek-style weight_scale_inv), both through the weight's own transform.
      grid = e.transform.hf_shape([stored[p.path + ("scale",)].shape[len(p.index):] for p in e.pieces])
      tensors += [OutTensor(e.key, np.dtype(quant.SCHEMES["fp8"]), e.hf_shape),
                  OutTensor(e.key + SCALE_SUFFIX, np.dtype(np.float32), tuple(grid))]
    else:
      tensors.append(OutTensor(e.key, keymap.hf_dtype(e.key, out_dtype), e.hf_shape))
  cache: dict[str, Any] = {"need": None, "leaves": {}}

  def produce(t: OutTensor) -> np.ndarray:
    is_scale = t.name.endswith(SCALE_SUFFIX) and t.name[:-len(SCALE_SUFFIX)] in by_key
    e = by_key[t.name[:-len(SCALE_SUFFIX)] if is_scale else t.name]
    paths = sorted({p.path for p in e.pieces})
    need = tuple(pp for p in paths for pp in ([p + ("qvalue",), p + ("scale",)] if p in quantised else [p]))
    if cache["need"] != need:
      cache["leaves"] = {}  # drop the previous group before reading the next
      cache["leaves"] = restore_leaves_numpy(src, list(need))
      cache["need"] = need
    part = () if e.pieces[0].path not in quantised else (("scale",) if is_scale else ("qvalue",))
    pieces = [cache["leaves"][p.path + part][p.index] for p in e.pieces]
    return np.ascontiguousarray(e.to_hf(pieces), dtype=t.dtype)

  if q and "quantization_config" not in raw:
    raw = dict(raw, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [q["block"], q["block"]]})
  with atomic_dir(dst, overwrite, sources=[src], replace_unmarked=replace_unmarked, kind="hf") as tmp:
    write_config(tmp, raw, src)
    copy_aux_files(src, tmp)
    weight_map = write_checkpoint(tmp, tensors, produce, max_shard_bytes=max_shard_bytes)
    cache["leaves"] = {}
  return {"tensors": len(tensors), "files": len(set(weight_map.values())),
          "n_params": sum(int(np.prod(t.shape)) for t in tensors if not t.name.endswith(SCALE_SUFFIX)),
          "bytes": sum(t.nbytes for t in tensors),
          "layout": layout, "dtype": out_dtype.name, "family": cfg.family, "seconds": time.time() - t0}


def describe(path: os.PathLike) -> str | None:
  """The weight format of a converted checkpoint in words (dtype, and the quantisation if any)."""
  p = pathlib.Path(path)
  if not is_converted_checkpoint(p):
    return None
  meta = read_meta(p)
  q = _quant_label(meta.get("quantization"))
  return f"format: {meta['dtype']}" + (f", matmul weights {q}" if q else "")


def inspect(path: os.PathLike) -> list[tuple[str, tuple[int, ...], str]]:
  """[(name, shape, dtype name)] of either format: HF keys (sorted) or param leaf paths (dotted)."""
  p = pathlib.Path(path)
  if is_converted_checkpoint(p):
    read_meta(p)
    return [(".".join(k), tuple(m.shape), np.dtype(m.dtype).name) for k, m in orbax_metadata(p).items()]
  if (p / INDEX_NAME).is_file() or (p / "model.safetensors").is_file():
    ws = WeightSet(p)
    return [(k, ws[k].shape, dtype_name(ws[k].dtype)) for k in sorted(ws.keys())]
  raise CheckpointError(f"{p}: neither an HF checkpoint (model.safetensors or {INDEX_NAME}) "
                        f"nor a converted one (dinfer_jax.json + {PARAMS_DIR}/)")


__all__ = ["hf2jax", "jax2hf", "inspect", "describe", "is_hf_checkpoint"]
