"""Minimal safetensors reader and writer on plain numpy, one tensor at a time.

Why not `safetensors.safe_open`: we want exact control over memory (one tensor mapped at a time, unmapped
right after use, so the process's resident set never grows with the model) and one-line errors that name
the file and the key for truncated or corrupt files, instead of a Rust panic message.

File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of
UTF-8 JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the raw
little-endian tensor bytes; offsets are relative to the end of the header.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import struct
from typing import Any, Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from dinfer_jax.checkpoint.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype code -> numpy dtype (explicitly little-endian).
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"),
}
# Dtypes a weight may have; the converter casts from any of them.
FLOAT_CODES = ("BF16", "F16", "F32", "F64")
_CODE_OF = {v: k for k, v in DTYPES.items()}

# A real header is a few MB at most (10k tensors); anything larger is a corrupt length field.
_MAX_HEADER = 200 * 2**20


def dtype_code(dtype) -> str:
  """numpy dtype -> safetensors code ('BF16', 'F32', ...)."""
  dt = np.dtype(dtype)
  if dt not in _CODE_OF:
    raise CheckpointError(f"dtype {dt} has no safetensors code")
  return _CODE_OF[dt]


def dtype_name(code: str) -> str:
  """safetensors code -> numpy-style name ('bfloat16', 'float32', 'int32', ...)."""
  return DTYPES[code].name


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lives: file, dtype code, shape and absolute byte range in the file."""
  name: str
  file: pathlib.Path
  dtype: str
  shape: tuple[int, ...]
  start: int
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.start


def _no_duplicates(path):
  def hook(pairs):
    seen = set()
    for k, _ in pairs:
      if k in seen:
        raise CheckpointError(f"{path}: corrupt header: key {k!r} appears twice")
      seen.add(k)
    return dict(pairs)
  return hook


def read_header(path: os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
  """Parses and validates one file's header without reading any tensor data.

  Checks the header length against the file size, the JSON, each entry's dtype/shape/offsets, that byte
  ranges match shape x itemsize and do not overlap, and that the file holds all the bytes the header
  promises (a truncated download fails here, not with SIGBUS later).

  Returns:
    ({name: TensorInfo}, metadata dict).
  """
  path = pathlib.Path(path)
  try:
    size = path.stat().st_size
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header length field")
      (n,) = struct.unpack("<Q", head)
      if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{path}: corrupt or truncated: header length field says {n} bytes "
                              f"but the file has {size} bytes")
      raw = f.read(n)
  except OSError as e:
    raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
  try:
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: corrupt header: not valid JSON ({e})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: corrupt header: expected a JSON object, got {type(header).__name__}")
  meta = header.pop("__metadata__", None) or {}
  if not isinstance(meta, dict):
    raise CheckpointError(f"{path}: corrupt header: __metadata__ must be an object")
  data_start, data_len = 8 + n, size - 8 - n
  out: dict[str, TensorInfo] = {}
  for name, e in header.items():
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
      raise CheckpointError(f"{path}: corrupt header: entry {name!r} lacks dtype/shape/data_offsets")
    code, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if code not in DTYPES:
      raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {code!r}")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
      raise CheckpointError(f"{path}: corrupt header: tensor {name!r} has invalid shape {shape!r}")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)
        or not 0 <= offs[0] <= offs[1]):
      raise CheckpointError(f"{path}: corrupt header: tensor {name!r} has invalid data_offsets {offs!r}")
    want = math.prod(shape) * DTYPES[code].itemsize
    if offs[1] - offs[0] != want:
      raise CheckpointError(f"{path}: corrupt header: tensor {name!r} ({code} {tuple(shape)}) needs {want} bytes "
                            f"but data_offsets span {offs[1] - offs[0]}")
    if offs[1] > data_len:
      raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at data byte {offs[1]} "
                            f"but the file holds only {data_len} data bytes")
    out[name] = TensorInfo(name, path, code, tuple(shape), data_start + offs[0], data_start + offs[1])
  spans = sorted((t.start, t.end, t.name) for t in out.values() if t.end > t.start)
  for (_, e0, a), (s1, _, b) in zip(spans, spans[1:]):
    if s1 < e0:
      raise CheckpointError(f"{path}: corrupt header: tensors {a!r} and {b!r} overlap")
  return out, {str(k): str(v) for k, v in meta.items()}


def read_tensor(info: TensorInfo) -> np.ndarray:
  """A read-only memory map of one tensor.

  Mapping (instead of reading into a buffer) lets a transform touch only the pages it needs (half of a
  fused w13 tensor, say). Callers drop the array as soon as they have copied what they need: the mapped
  pages then leave the resident set, so reading never accumulates the model.
  """
  dt = DTYPES[info.dtype]
  if info.nbytes == 0:
    return np.zeros(info.shape, dt)
  try:
    return np.memmap(info.file, dtype=dt, mode="r", offset=info.start, shape=info.shape)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{info.file}: cannot map tensor {info.name!r}: {e}") from None


class WeightSet:
  """All tensors of an HF checkpoint directory: `model.safetensors`, or the shards named by the index.

  Construction reads every header and checks the index against them: a shard the index names must exist,
  every key the index names must be in the shard it names, a key present in two shards is an error, and so
  is a key in a shard that the index does not list.
  """

  def __init__(self, directory: os.PathLike):
    self.dir = pathlib.Path(directory)
    self.index_file: pathlib.Path | None = None
    self.metadata: dict[str, str] = {}
    index = self.dir / INDEX_NAME
    if index.is_file():
      self.index_file = index
      weight_map = _read_index(index)
      files = sorted(set(weight_map.values()))
    elif (self.dir / SINGLE_NAME).is_file():
      weight_map = None
      files = [SINGLE_NAME]
    else:
      other = sorted(p.name for p in self.dir.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
      hint = f" (found {', '.join(other[:3])}; only safetensors with an index, or a single {SINGLE_NAME}, are read)" \
          if other else ""
      raise CheckpointError(f"{self.dir}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")
    self.tensors: dict[str, TensorInfo] = {}
    for fname in files:
      path = self.dir / fname
      if not path.is_file():
        some = next(k for k, v in weight_map.items() if v == fname)
        raise CheckpointError(f"{index}: shard {fname!r} (holding e.g. {some!r}) does not exist")
      infos, meta = read_header(path)
      self.metadata.update(meta)
      for k, t in infos.items():
        if k in self.tensors:
          raise CheckpointError(f"duplicated tensor {k!r}: in {self.tensors[k].file.name} and in {fname}")
        self.tensors[k] = t
    if weight_map is not None:
      for k, fname in weight_map.items():
        if k not in self.tensors:
          raise CheckpointError(f"{index}: tensor {k!r} is listed in shard {fname!r} but is not in any shard")
        if self.tensors[k].file.name != fname:
          raise CheckpointError(f"{index}: tensor {k!r} is listed in shard {fname!r} but is in "
                                f"{self.tensors[k].file.name}")
      for k, t in self.tensors.items():
        if k not in weight_map:
          raise CheckpointError(f"{t.file}: tensor {k!r} is not listed in {INDEX_NAME}")

  def keys(self) -> list[str]:
    return list(self.tensors)

  def __contains__(self, key: str) -> bool:
    return key in self.tensors

  def __getitem__(self, key: str) -> TensorInfo:
    return self.tensors[key]

  def read(self, key: str) -> np.ndarray:
    return read_tensor(self.tensors[key])


def _read_index(index: pathlib.Path) -> dict[str, str]:
  try:
    data = json.loads(index.read_text(), object_pairs_hook=_no_duplicates(index))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{index}: cannot parse: {e}") from None
  wm = data.get("weight_map") if isinstance(data, dict) else None
  if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
    raise CheckpointError(f"{index}: no 'weight_map' object of key -> shard file name")
  for k, v in wm.items():
    if "/" in v or "\\" in v or v in ("", ".", ".."):
      raise CheckpointError(f"{index}: tensor {k!r} points at {v!r}, not a file name in the same directory")
  return wm


# --------------------------------------------------------------------------------------------- writing
@dataclasses.dataclass(frozen=True)
class OutTensor:
  """One tensor to write: its name, numpy dtype and shape (data comes later, from a callback)."""
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def write_file(path: os.PathLike, tensors: Sequence[OutTensor], produce: Callable[[OutTensor], np.ndarray],
               metadata: Mapping[str, str] | None = None) -> int:
  """Writes one safetensors file, asking `produce` for each tensor's data in order.

  The header is written first from the declared shapes, so only one tensor's data is in memory at a time.
  Returns the number of data bytes written.
  """
  header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
  off = 0
  for t in tensors:
    header[t.name] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
    off += t.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-aligned, as the reference writer does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for t in tensors:
      arr = produce(t)
      if arr.shape != tuple(t.shape) or arr.dtype != np.dtype(t.dtype):
        raise CheckpointError(f"internal: tensor {t.name!r} produced {arr.dtype}{arr.shape}, declared {t.dtype}{t.shape}")
      arr = np.ascontiguousarray(arr)
      if arr.nbytes:
        f.write(arr.reshape(-1).view(np.uint8).data)
      del arr
  return off


def plan_shards(tensors: Sequence[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
  """Greedy split in the given order: a new shard starts when the next tensor would overflow the limit."""
  shards: list[list[OutTensor]] = [[]]
  size = 0
  for t in tensors:
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += t.nbytes
  return shards


def shard_names(n: int) -> list[str]:
  if n == 1:
    return [SINGLE_NAME]
  return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_checkpoint(directory: os.PathLike, tensors: Sequence[OutTensor],
                     produce: Callable[[OutTensor], np.ndarray], *, max_shard_bytes: int = 5 * 2**30) -> dict[str, str]:
  """Writes tensors as `model.safetensors` (or `model-0000i-of-0000n.safetensors`) plus the index.

  The index is always written: dInfer's loader needs it even for a single file.
  Returns the weight map {key: file name}.
  """
  directory = pathlib.Path(directory)
  shards = plan_shards(tensors, max_shard_bytes)
  names = shard_names(len(shards))
  weight_map: dict[str, str] = {}
  total = 0
  for shard, fname in zip(shards, names):
    total += write_file(directory / fname, shard, produce)
    weight_map.update({t.name: fname for t in shard})
  index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
  (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
  return weight_map

