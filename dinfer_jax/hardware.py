"""The chips the engine tunes its kernels for and the benches predict: one table keyed by chip.

Each entry holds the spec sheet (the ideal roofline and the deviceless compile target) and what was measured
or derived on such a chip (the realistic model's rates and the grouped GEMM's tile choice). Sources:
NVIDIA's H100/H200 SXM data sheets for the specs; the achievable rates are the measured ones of
docs/design.md, "GPU charges" (a device-to-device copy, a large bf16 cuBLAS GEMM).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Chip:
  """One GPU.

  Attributes:
    key: the table's key ("h200").
    name: the device kind as jax reports it (jax.Device.device_kind).
    hbm_bytes_per_s, bf16_flops: spec peaks (HBM bandwidth; dense bf16 tensor-core FLOP/s).
    l2_bytes, memory_bytes, sms: the compile target's L2, HBM size and streaming multiprocessors.
    copy_bytes_per_s: achievable HBM bandwidth (a device-to-device copy).
    gemm_flops: achievable bf16 FLOP/s of a large GEMM.
    eight_bit_flops: 8-bit x 8-bit operands: twice gemm_flops, as the spec's ratio (not measured).
    blocks_per_sm: small thread blocks resident per SM (a grid's wave is sms * blocks_per_sm blocks).
    empty_wave_s: one wave of grid blocks that find no rows and exit.
    nvlink_bytes_per_s: per direction per GPU (the mesh bench's collectives).
  """

  key: str
  name: str
  hbm_bytes_per_s: float
  bf16_flops: float
  l2_bytes: int
  memory_bytes: int
  sms: int
  copy_bytes_per_s: float
  gemm_flops: float
  eight_bit_flops: float
  blocks_per_sm: int = 8
  empty_wave_s: float = 1e-6
  nvlink_bytes_per_s: float = 450e9

  @property
  def resident_blocks(self) -> int:
    return self.sms * self.blocks_per_sm


CHIPS = {
    "h200": Chip("h200", "NVIDIA H200", hbm_bytes_per_s=4.8e12, bf16_flops=990e12, l2_bytes=52428800,
                 memory_bytes=150754820096, sms=132, copy_bytes_per_s=4.3e12, gemm_flops=790e12,
                 eight_bit_flops=1580e12),
    # ~90% of the spec bandwidth and ~76% of the spec FLOPs, as measured on the H200.
    "h100": Chip("h100", "NVIDIA H100 80GB HBM3", hbm_bytes_per_s=3.35e12, bf16_flops=990e12, l2_bytes=52428800,
                 memory_bytes=85520809984, sms=132, copy_bytes_per_s=3.0e12, gemm_flops=750e12,
                 eight_bit_flops=1500e12),
}
DEFAULT = "h200"


@dataclasses.dataclass(frozen=True)
class Tpu:
  """One TPU chip, as the deviceless TPU compile and the roofline bench see it (Google Cloud's TPU v5e, v5p
  and v6e system-architecture pages: peak bf16 and int8 compute, HBM capacity and bandwidth, bidirectional
  inter-chip interconnect bandwidth per chip).

  Attributes:
    key: the table's key ("v6e"), also the topology's name prefix (topologies.get_topology_desc "v6e:1x1").
    name: as reported.
    hbm_bytes_per_s, bf16_flops, int8_flops: spec peaks.
    memory_bytes: HBM per chip that a program may use: what XLA TPU (libtpu 0.0.42.1) accepts, found by
      compiling ever larger donated arguments deviceless (64 MiB resolution). The spec's 16, 32 and 95 "GB"
      are GiB, less a reserve: v5e 15.73 GiB (16.89e9 bytes), v6e 31.20 GiB, v5p 95.71 GiB.
    ici_bytes_per_s: inter-chip interconnect, both directions together, per chip.
    hbm_fraction, mxu_fraction: the realistic model's assumed achievable shares of the peaks (no TPU has run
      this code: bench/realistic.py, charges_for_tpu).
  """

  key: str
  name: str
  hbm_bytes_per_s: float
  bf16_flops: float
  int8_flops: float
  memory_bytes: int
  ici_bytes_per_s: float
  hbm_fraction: float = 0.85
  mxu_fraction: float = 0.80


TPUS = {
    "v5e": Tpu("v5e", "TPU v5 lite", hbm_bytes_per_s=819e9, bf16_flops=197e12, int8_flops=394e12,
               memory_bytes=16_894_656_512, ici_bytes_per_s=400e9),
    "v5p": Tpu("v5p", "TPU v5p", hbm_bytes_per_s=2765e9, bf16_flops=459e12, int8_flops=918e12,
               memory_bytes=102_773_030_912, ici_bytes_per_s=1200e9),
    "v6e": Tpu("v6e", "TPU v6 lite", hbm_bytes_per_s=1638e9, bf16_flops=918e12, int8_flops=1836e12,
               memory_bytes=33_504_100_352, ici_bytes_per_s=800e9),
}

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("dinfer_jax_target_chip", default=None)


@contextlib.contextmanager
def target(key: str):
  """Tune kernels for chip `key` while tracing (a deviceless compile for it: the roofline bench)."""
  if key not in CHIPS:
    raise ValueError(f"unknown chip {key!r}; choose from {', '.join(CHIPS)}")
  tok = _TARGET.set(key)
  try:
    yield CHIPS[key]
  finally:
    _TARGET.reset(tok)


def current() -> Chip:
  """The chip kernels are tuned for: target()'s, else the first GPU's by its device kind, else the default
  (the deviceless compiles and CPU runs, whose choices only matter for the GPU the program is made for)."""
  key = _TARGET.get()
  if key is not None:
    return CHIPS[key]
  devices = jax.devices()
  if devices and devices[0].platform == "gpu":
    chip = for_device_kind(devices[0].device_kind)
    if chip is not None:
      return chip
  return CHIPS[DEFAULT]


def for_device_kind(kind: str) -> Chip | None:
  """The table's chip for a device kind as jax reports it ("NVIDIA H100 80GB HBM3"); None for one not in it."""
  for chip in CHIPS.values():
    if kind == chip.name or kind.startswith(chip.name):
      return chip
  return None
