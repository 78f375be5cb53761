"""Helpers for the checkpoint tests: golden model paths, raw tensor reads, writing (bad) HF dirs."""
from __future__ import annotations

import json
import math
import pathlib
import shutil
import struct

import numpy as np

from dinfer_jax.checkpoint.safetensors_io import INDEX_NAME, OutTensor, WeightSet, dtype_code, write_file

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden" / "forward"
MODELS = {
    "llada_moe": GOLDEN / "tiny_llada_moe",
    "llada_moe_fused": GOLDEN / "tiny_llada_moe" / "fused",
    "llada": GOLDEN / "tiny_llada",
    "llada2_moe": GOLDEN / "tiny_llada2_moe",
}


def raw_tensors(directory) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
  """{key: (dtype code, shape, raw bytes)} of every tensor of an HF dir."""
  ws = WeightSet(directory)
  return {k: (ws[k].dtype, ws[k].shape, np.asarray(ws.read(k)).tobytes()) for k in ws.keys()}


def arrays(directory) -> dict[str, np.ndarray]:
  ws = WeightSet(directory)
  return {k: np.array(ws.read(k)) for k in ws.keys()}


def write_hf(directory, tensors: dict[str, np.ndarray], config: dict | None, *, shards=None, index=True,
             extra_index: dict[str, str] | None = None) -> pathlib.Path:
  """Writes an HF dir. shards: list of key lists, one per file (a key may repeat: duplicate test)."""
  d = pathlib.Path(directory)
  d.mkdir(parents=True, exist_ok=True)
  if config is not None:
    (d / "config.json").write_text(json.dumps(config, indent=2))
  shards = shards or [list(tensors)]
  names = ["model.safetensors"] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                          for i in range(len(shards))]
  weight_map = {}
  for keys, name in zip(shards, names):
    outs = [OutTensor(k, tensors[k].dtype, tensors[k].shape) for k in keys]
    write_file(d / name, outs, lambda t: tensors[t.name])
    for k in keys:
      weight_map.setdefault(k, name)
  if index:
    weight_map.update(extra_index or {})
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  return d


def copy_model(name: str, dst) -> pathlib.Path:
  dst = pathlib.Path(dst)
  shutil.copytree(MODELS[name], dst, ignore=shutil.ignore_patterns("fused", "*.npy"))
  for f in dst.iterdir():
    f.chmod(0o644)  # golden files are read-only; tests edit their copies
  return dst


def load_config(name: str) -> dict:
  return json.loads((MODELS[name] / "config.json").read_text())


def write_sparse(directory, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], config: dict) -> pathlib.Path:
  """A full-size HF checkpoint whose data is a hole: headers are real, no disk or RAM is used.

  Lets the whole validation path run on the real 7B-class presets without weights.
  """
  d = pathlib.Path(directory)
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text(json.dumps(config))
  header, off = {"__metadata__": {"format": "pt"}}, 0
  for k, shape in shapes.items():
    n = math.prod(shape) * (4 if dtypes.get(k) == "F32" else 2)
    header[k] = {"dtype": dtypes.get(k, "BF16"), "shape": list(shape), "data_offsets": [off, off + n]}
    off += n
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(d / "model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    f.truncate(8 + len(raw) + off)
  return d


def leftovers(parent, name: str) -> list[str]:
  """Anything the converter may have left next to DST: DST itself or its temp dirs."""
  return [p.name for p in pathlib.Path(parent).iterdir() if p.name == name or p.name.startswith(f".{name}.")]


__all__ = ["GOLDEN", "MODELS", "arrays", "copy_model", "dtype_code", "leftovers", "load_config", "raw_tensors",
           "write_hf", "write_sparse"]
