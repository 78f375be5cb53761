"""What a real GPU charges beyond the ideal roofline, read from a compiled (optimised) HLO module.

The ideal roofline (bench.roofline) divides a forward's bytes and FLOPs by the chip's spec peaks. A real H200
also charges (docs/design.md, "GPU charges", and hardware.py for the rates):
- achievable peaks: about 4.3 TB/s for a device-to-device copy and 790 TFLOP/s for a large bf16 GEMM, and
  each kernel reaches its class's fraction of them (Efficiency: XLA's fusions, GEMMs, the grouped GEMMs,
  cuDNN attention). Each kernel is charged max(bytes / bandwidth, FLOPs / rate) and the kernels are summed
  (kernel_costs): a program's memory-bound and compute-bound kernels do not hide each other;
- a floor per kernel: XLA runs a module as a sequence of kernels (fusions, custom calls, copies). Each costs
  its launch and ramp/tail, 2-3 us on its own, less inside a CUDA graph (XLA captures runs of at least
  `xla_gpu_graph_min_graph_size` = 5 consecutive kernels into one graph; copies and control flow break a
  run). Most of a batch-1 forward's ~400 kernels would take under 3 us at roofline speed, so the floors add
  up to about a millisecond;
- host syncs: a `while` with no known trip count and every `conditional` are driven from the host. Each
  iteration copies the predicate (or branch index) to the host and waits for the device to drain: about
  10-20 us per read;
- routing skew: experts get uneven rows (a lognormal popularity, ROUTER_SKEW); a group with more row tiles
  than blocks walking it reads its weights again per pass (grouped_gemm.expected_tiles);
- the grouped GEMM's tiles: tokamax's Pallas-Triton ragged_dot tiles each expert's rows from the group's own
  start (ceil(rows / tile) row tiles per expert: at the batch-1 refresh ~160 rows per expert take 2 tiles of
  128, 1.6x the routed work) and launches ceil(M / tile) x ceil(N / tile) x G blocks, most of which find no
  rows and exit (their launch is not free: ~1 us per resident wave); this project's kernel
  (model/grouped_gemm.py) launches only the blocks balanced routing fills, and is charged its own tiles;
- 8-bit products (W8A8: both operands int8 or FP8) run on the 8-bit tensor cores at twice the bf16 rate (the
  H200's spec: 1979 vs 989 TFLOP/s dense); charged at twice the measured bf16 rate, 1580 TFLOP/s (not measured
  on the box: the GPU check's GEMM probe would tell);
- the embedding gather: XLA's cost analysis charges a gather the whole operand (the 644 MB table for 64 rows);
  a gather reads the rows it looks up. Likewise an in-place scatter (the cached forward's K/V write) would be
  charged its whole buffer read and written; it touches the slots it writes. A fusion parameter that is only
  sliced is charged the slices (overcharges);
- the generate program as it runs: each kind of iteration costed where it lives in the compiled loop
  (loop_parts, subprogram: the block entry with its refresh, one cached step, the block body's own kernels),
  not as separately compiled forwards plus the decoder's work. The loop adds work a forward alone does not
  show (a select over a forward the step never runs keeps its consumers alive) and fuses across the
  forward's edge.

Everything here is a pure function of the module text and the charges, so a test can check it on a
hand-written module.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from dinfer_jax import hardware
from dinfer_jax.model import grouped_gemm, grouped_gemm_tpu, moe


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """What fraction of the chip's achievable rates (a device-to-device copy's bandwidth, a large cuBLAS GEMM's
  bf16 FLOP/s) each class of kernel reaches; a kernel is charged max(bytes / bandwidth, FLOPs / rate) at its
  class's fraction (docs/design.md, "GPU charges", gives the reasons and sources). Central figures; the
  range's ends are EFFICIENCY_SLOW and EFFICIENCY_FAST."""
  memory_bw: float = 0.90  # XLA's loop/reduction fusions, copies, the small Pallas kernels (routing, combine)
  gemm_bw: float = 0.85  # XLA's GEMM fusions (Triton) and cuBLAS calls
  gemm_rate: float = 0.85
  grouped_bw: float = 0.75  # the grouped GEMMs (Pallas-Triton: 32-wide K steps, plain loads, no TMA)
  grouped_rate: float = 0.60
  attention_bw: float = 0.75  # cuDNN's fused attention
  attention_rate: float = 0.70

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if not 0 < v <= 1:
        raise ValueError(f"Efficiency.{f.name}={v!r}: must be in (0, 1]")

  def of(self, cls: str) -> tuple[float, float]:
    """(bandwidth, rate) fractions of a kernel class: memory, gemm, grouped or attention."""
    return {"memory": (self.memory_bw, self.gemm_rate), "gemm": (self.gemm_bw, self.gemm_rate),
            "grouped": (self.grouped_bw, self.grouped_rate),
            "attention": (self.attention_bw, self.attention_rate)}[cls]


EFFICIENCY_SLOW = Efficiency(memory_bw=0.80, gemm_bw=0.75, gemm_rate=0.75, grouped_bw=0.65, grouped_rate=0.50,
                             attention_bw=0.65, attention_rate=0.60)
EFFICIENCY_FAST = Efficiency(memory_bw=1.0, gemm_bw=0.95, gemm_rate=0.95, grouped_bw=0.85, grouped_rate=0.70,
                             attention_bw=0.85, attention_rate=0.80)
# The coefficient of variation of expert popularity (model/grouped_gemm.popularity) of the embedded default
# model's trained router, as measured: 0.60-0.84 across its 4 MoE layers, 0.75 on the mean (64 prompts of its
# trained tasks, 8 experts, top-2: `python -m dinfer_jax.bench.router_skew`). It was trained without a
# balancing loss; LLaDA-MoE was trained with one, so the central charge takes less (0.5, the engine's own
# tile choice: grouped_gemm.PLAN_SKEW), this is the slow end, and a uniform router the fast end.
ROUTER_SKEW = 0.75


@dataclasses.dataclass(frozen=True)
class Charges:
  """Per-chip costs of the realistic model (charges_for: from the hardware table). Defaults: the H200's,
  central."""
  hbm_bytes_per_s: float = 4.3e12
  bf16_flops: float = 790e12
  eight_bit_flops: float = 1580e12  # FP8 / int8 x 8-bit operands (2x bf16, as the spec; not measured)
  kernel_us: float = 2.5  # a kernel (or a CUDA graph) launched on its own
  graph_kernel_us: float = 2.25  # each kernel inside a CUDA graph (2-2.5 us: the range's ends)
  graph_min_kernels: int = 5  # XLA's xla_gpu_graph_min_graph_size
  sync_us: float = 15.0  # one device-to-host predicate read (drain + copy + relaunch)
  # TPU ops the chip runs without an HBM pipeline (None on a GPU: every op there is a kernel launch):
  # dma_us, an async copy's start (its bytes are charged; issuing it is a descriptor); on_chip_us, an op whose
  # operands and results all sit in VMEM or SMEM (no HBM tile to fetch before it starts or drain after).
  dma_us: float | None = None
  on_chip_us: float | None = None
  # A program partitioned over several chips: its collectives at link_bytes_per_s (per direction per chip) by
  # the ring model (ring_link_bytes) plus collective_us each. None: a one-chip program (no collectives).
  link_bytes_per_s: float | None = None
  collective_us: float = 8.0
  tile_rows: int = 0  # grouped GEMM row tile: 0 = the engine's choice per shape (moe.grouped_block_m)
  tile_cols: int = 128
  empty_wave_us: float = 1.0  # one wave of grid blocks that find no rows and exit
  resident_blocks: int = 132 * 8  # blocks in flight at once (132 SMs, 8 small blocks each)
  skew: float = grouped_gemm.PLAN_SKEW  # the router's expert popularity spread (ROUTER_SKEW)
  efficiency: Efficiency = Efficiency()

  def __post_init__(self):
    for name in ("hbm_bytes_per_s", "bf16_flops", "eight_bit_flops", "tile_cols", "resident_blocks",
                 "graph_min_kernels"):
      if getattr(self, name) <= 0:
        raise ValueError(f"Charges.{name}={getattr(self, name)!r}: must be positive")
    for name in ("kernel_us", "graph_kernel_us", "sync_us", "empty_wave_us", "tile_rows", "skew", "dma_us",
                 "on_chip_us", "collective_us"):
      if getattr(self, name) is not None and getattr(self, name) < 0:
        raise ValueError(f"Charges.{name}={getattr(self, name)!r}: must be >= 0")
    if self.link_bytes_per_s is not None and self.link_bytes_per_s <= 0:
      raise ValueError(f"Charges.link_bytes_per_s={self.link_bytes_per_s!r}: must be positive (or None)")


def charges_for(chip: hardware.Chip, case: str = "central", **kw) -> Charges:
  """The realistic model's charges on a chip of the hardware table (its achievable rates and wave size):
  the central case, or an end of the range ("slow": every charge at its pessimistic end, the measured
  router skew; "fast": the optimistic ends, a uniform router)."""
  ends = {"central": {},
          "slow": dict(graph_kernel_us=2.5, skew=ROUTER_SKEW, efficiency=EFFICIENCY_SLOW),
          "fast": dict(graph_kernel_us=2.0, skew=0.0, efficiency=EFFICIENCY_FAST)}
  if case not in ends:
    raise ValueError(f"charges_for: case {case!r}; choose from {', '.join(ends)}")
  return Charges(hbm_bytes_per_s=chip.copy_bytes_per_s, bf16_flops=chip.gemm_flops,
                 eight_bit_flops=chip.eight_bit_flops, empty_wave_us=1e6 * chip.empty_wave_s,
                 resident_blocks=chip.resident_blocks, **{**ends[case], **kw})


def charges_for_tpu(tpu: hardware.Tpu, case: str = "central") -> Charges:
  """A TPU's charges, all assumed (no TPU has run this code): HBM at hbm_fraction of the spec and the MXU at
  mxu_fraction (0.85 and 0.80; slow end 10% below, fast end 0.95 and 0.90), loops and conditionals on the
  chip (no host read). Every kernel class at the same fractions: XLA emits all of them.

  Per-op floors. A TPU runs a program's ops back to back from its own instruction stream: there is no launch
  and no graph to save one. What an op pays beyond its bytes is the fill and drain of its HBM pipeline (the
  first tile's DMA before compute starts, the last one's write after): 1 us central (0.5 - 1.5 us). An op
  whose operands and results are all on the chip (VMEM, SMEM: memory spaces S(1), S(2), where XLA TPU places
  small activations and the tiles its DMAs bring) has no such pipeline: 0.25 us (0.1 - 0.5) for its vector
  work's latency and the sync with the next op. An async copy's start issues a DMA descriptor and returns:
  no floor (its bytes are charged, serially, as if nothing overlapped them)."""
  frac = {"central": (tpu.hbm_fraction, tpu.mxu_fraction, 1.0, 0.25),
          "slow": (0.9 * tpu.hbm_fraction, 0.9 * tpu.mxu_fraction, 1.5, 0.5), "fast": (0.95, 0.90, 0.5, 0.1)}
  if case not in frac:
    raise ValueError(f"charges_for_tpu: case {case!r}; choose from {', '.join(frac)}")
  hbm, mxu, op_us, chip_us = frac[case]
  return Charges(hbm_bytes_per_s=hbm * tpu.hbm_bytes_per_s, bf16_flops=mxu * tpu.bf16_flops,
                 eight_bit_flops=mxu * tpu.int8_flops, kernel_us=op_us, graph_kernel_us=op_us,
                 dma_us=0.0, on_chip_us=chip_us,
                 graph_min_kernels=1 << 30, sync_us=0.0, empty_wave_us=0.0, skew=0.0 if case == "fast" else
                 (ROUTER_SKEW if case == "slow" else grouped_gemm.PLAN_SKEW),
                 efficiency=Efficiency(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0))


CHARGES = {key: charges_for(chip) for key, chip in hardware.CHIPS.items()}
CHARGES.update({key: charges_for_tpu(tpu) for key, tpu in hardware.TPUS.items()})
# The range's ends per chip: (slow, fast).
RANGES = {key: (charges_for(chip, "slow"), charges_for(chip, "fast")) for key, chip in hardware.CHIPS.items()}
RANGES.update({key: (charges_for_tpu(tpu, "slow"), charges_for_tpu(tpu, "fast")) for key, tpu in hardware.TPUS.items()})
H200, H100 = CHARGES["h200"], CHARGES["h100"]
# A collective's fixed cost (launch + sync; typical NCCL small-message latency within a node), assumed for
# TPU slices' inter-chip collectives too.
COLLECTIVE_US = 8.0


def link_bytes_per_s(key: str) -> float:
  """Per direction per chip: NVLink for a GPU, half the TPU's bidirectional inter-chip interconnect."""
  return hardware.TPUS[key].ici_bytes_per_s / 2 if key in hardware.TPUS else hardware.CHIPS[key].nvlink_bytes_per_s


def with_links(ch: Charges, key: str) -> Charges:
  """A chip's charges for a program partitioned over several of them: collectives over its links."""
  return dataclasses.replace(ch, link_bytes_per_s=link_bytes_per_s(key), collective_us=COLLECTIVE_US)

# Instructions that launch nothing (views, tuples, constants) or that are control flow (counted apart).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "iota"}
_CONTROL = {"while", "conditional", "call"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_BODY = re.compile(r"body=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TO_APPLY = re.compile(r"to_apply=%([\w.\-]+)")
_TRUE_FALSE = re.compile(r"true_computation=%([\w.\-]+), false_computation=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_ARRAY = re.compile(r"\b(pred|s8|u8|f8e4m3fn|f8e5m2|bf16|f16|s16|f32|s32|u32|f64|s64)\[([\d,]*)\]")
_DT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8}
_TRITON = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"')


def arrays(s: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(s)]


_ARRAY_LAYOUT = re.compile(_ARRAY.pattern + r"(\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")


def hbm_arrays(s: str) -> list[tuple[str, tuple[int, ...]]]:
  """The arrays of a type that live in HBM: a TPU layout's memory space S(1) (VMEM) or S(2) (on-chip
  scalars) is on the chip; GPU layouts name none."""
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims, layout in _ARRAY_LAYOUT.findall(s)
          if not _ON_CHIP.search(layout)]


_VMEM = "S(1)"


def _layouts(s: str) -> list[str]:
  """Each array's layout text in a type, in the order arrays() lists them ("" where none is printed)."""
  return [layout for _, _, layout in _ARRAY_LAYOUT.findall(s)]


def nbytes(arrs) -> int:
  return sum(_DT_BYTES[dt] * int(np.prod(shape)) for dt, shape in arrs)


class Module:
  """The computations of an optimised HLO module's text, and their instructions in schedule order."""

  def __init__(self, text: str):
    self.comps: dict[str, list[tuple[str, str, str, str]]] = {}  # name -> [(name, result, op, rest)]
    self.shapes: dict[str, str] = {}  # instruction name -> its result type (names are unique in a module)
    self.entry = None
    cur = None
    for line in text.splitlines():
      h = _HEADER.match(line)
      if h:
        cur = h.group(2)
        self.comps[cur] = []
        if h.group(1):
          self.entry = cur
        continue
      m = _INSTR.match(line)
      if m and cur is not None:
        self.comps[cur].append(m.groups())
        self.shapes[m.group(1)] = m.group(2)
    if self.entry is None:
      raise ValueError("HLO module text has no ENTRY computation")

  def operands(self, rest: str, hbm: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays an instruction reads: its operand list looked up by name (hbm: those in HBM only)."""
    of = hbm_arrays if hbm else arrays
    return [a for name in _operand_names(rest) for a in of(self.shapes.get(name, ""))]

  def ops_in(self, comp: str) -> set[str]:
    return {op for _, _, op, _ in self.comps.get(comp, [])}


@dataclasses.dataclass
class Kernels:
  """Kernel launches of one execution of a computation (loops with a known trip count unrolled in the count).

  graphs: runs of >= graph_min_kernels consecutive kernels (one CUDA graph each); in_graphs: the kernels in
  them; separate: kernels launched on their own (short runs, copies). by_kind: fusion / custom-call / copy /
  other. On a TPU (charges with dma_us / on_chip_us): dma, async copies' starts; on_chip, ops with no HBM
  operand or result (neither is in graphs or separate)."""
  total: int = 0
  graphs: int = 0
  in_graphs: int = 0
  separate: int = 0
  dma: int = 0
  on_chip: int = 0
  by_kind: dict[str, int] = dataclasses.field(default_factory=dict)

  def add(self, other: "Kernels", times: int = 1) -> None:
    self.total += times * other.total
    self.graphs += times * other.graphs
    self.in_graphs += times * other.in_graphs
    self.separate += times * other.separate
    self.dma += times * other.dma
    self.on_chip += times * other.on_chip
    for k, v in other.by_kind.items():
      self.by_kind[k] = self.by_kind.get(k, 0) + times * v

  def overhead_s(self, ch: Charges) -> float:
    """Kernel floors: each graph and each separate kernel pays a launch, each kernel in a graph its own
    (smaller) floor; on a TPU, DMA starts and on-chip ops their own."""
    return 1e-6 * ((self.graphs + self.separate) * ch.kernel_us + self.in_graphs * ch.graph_kernel_us
                   + self.dma * (ch.dma_us or 0.0) + self.on_chip * (ch.on_chip_us or 0.0))


def branches(rest: str) -> list[str]:
  """The branch computations of a conditional (an index's branch_computations or a predicate's pair)."""
  m = _BRANCHES.search(rest)
  if m:
    return [b.strip().lstrip("%") for b in m.group(1).split(",")]
  return list(_TRUE_FALSE.search(rest).groups())


def kernels(mod: Module, ch: Charges, comp: str | None = None, nested: bool = True) -> Kernels:
  """Kernels one execution of `comp` (default: the entry) launches. A loop with a known trip count counts its
  body that many times; a loop without one (or a conditional) counts its body (every branch) once: per
  iteration figures are the caller's business (host_syncs says how many iterations read the host).
  nested=False: `comp`'s own kernels only, not those of the loops, conditionals and calls it runs."""
  comp = comp or mod.entry
  out = Kernels()
  run = 0

  def close():
    nonlocal run
    if run >= ch.graph_min_kernels:
      out.graphs += 1
      out.in_graphs += run
    else:
      out.separate += run
    run = 0

  for _, result, op, rest in mod.comps.get(comp, []):
    if op in _FREE or op.endswith("-done"):  # an async pair launches once (its start)
      continue
    if op in _CONTROL:
      close()
      if not nested:
        continue
      if op == "while":
        t = _TRIP.search(rest)
        out.add(kernels(mod, ch, _BODY.search(rest).group(1)), int(t.group(1)) if t else 1)
      elif op == "conditional":
        for br in branches(rest):
          out.add(kernels(mod, ch, br))
      else:
        m = _TO_APPLY.search(rest)
        if m:
          out.add(kernels(mod, ch, m.group(1)))
      continue
    kind = op if op in ("fusion", "custom-call", "copy") else "other"
    out.by_kind[kind] = out.by_kind.get(kind, 0) + 1
    out.total += 1
    if ch.dma_us is not None and op.endswith("-start"):
      out.dma += 1
      continue
    if ch.on_chip_us is not None and not hbm_arrays(result) and not mod.operands(rest, hbm=True):
      out.on_chip += 1
      continue
    if kind in ("fusion", "custom-call"):
      run += 1
    else:  # copies and unfused ops launch on their own and end a graph
      close()
      out.separate += 1
  close()
  return out


_SLICES = {"dynamic-slice", "slice"}


def _operand_names(rest: str) -> list[str]:
  """The instruction names in an instruction's operand list (up to the first top-level ')')."""
  depth, end = 0, len(rest)
  for i, ch in enumerate(rest):
    if ch in "({":
      depth += 1
    elif ch in ")}":
      if depth == 0:
        end = i
        break
      depth -= 1
  return re.findall(r"%([\w.\-]+)", rest[:end])


def overcharges(mod: Module) -> dict[str, float]:
  """Bytes by which a fusion's operands + results overstate what it moves, by instruction name:
  - a gather reads the rows it looks up: its largest operand (the 644 MB embedding table for 64 rows) is
    charged as the result;
  - an in-place update (a scatter or dynamic-update-slice fusion whose one result is its buffer operand: the
    K/V cache written in place) is charged the buffer read and written; it reads its other operands (the
    updates, or what it computes them from) and writes at most as many bytes into the buffer;
  - a parameter the fusion only slices (directly or through bitcasts: a [B*T, V] logits buffer seen as
    [B, T, V] and sliced to the block's rows) is charged its slices."""
  extra: dict[str, float] = {}
  for comp in list(mod.comps.values()):
    for name, result, op, rest in comp:
      called = _CALLS.search(rest) if op == "fusion" else None
      if not called or called.group(1) not in mod.comps:
        continue
      body = mod.comps[called.group(1)]
      inner = {iop for _, _, iop, _ in body}
      outs, ins = hbm_arrays(result), mod.operands(rest, hbm=True)
      e = 0.0
      if "gather" in inner:
        out_bytes = nbytes(outs)
        operand = max((nbytes([a]) for a in ins), default=0)
        if operand > 4 * out_bytes:
          e += operand - out_bytes
      if inner & {"scatter", "dynamic-update-slice"} and len(outs) == 1 and outs[0] in ins:
        buf = nbytes(outs)
        e += 2 * buf - min(nbytes(ins) - buf, buf)
      users: dict[str, list[tuple[str, str, str]]] = {}
      for iname, iresult, iop, irest in body:
        for o in _operand_names(irest):
          users.setdefault(o, []).append((iname, iresult, iop))
      for pname, presult, iop, _ in body:
        if iop != "parameter":
          continue
        sliced, todo, ok = 0, [pname], True
        while todo and ok:
          for uname, uresult, uop in users.get(todo.pop(), []):
            if uop == "bitcast":
              todo.append(uname)
            elif uop in _SLICES:
              sliced += nbytes(arrays(uresult))
            else:
              ok = False
        if ok and sliced:
          e += max(nbytes(hbm_arrays(presult)) - sliced, 0)
      if e:
        extra[name] = e
  return extra


@dataclasses.dataclass
class GroupedGemm:
  """The grouped GEMM calls of a module: FLOPs their tiles run beyond the routed ones, weight bytes they read
  beyond one read of every group (re-read tiles, less the groups no row reaches: negative when idle groups
  outweigh), and the grid blocks that find no rows."""
  calls: int = 0
  routed_flops: float = 0.0
  padded_flops: float = 0.0
  blocks: int = 0
  working_blocks: float = 0.0
  eight_bit_flops: float = 0.0  # padded FLOPs of the calls whose rows are 8-bit (W8A8)
  weight_bytes_over: float = 0.0

  def add(self, c: dict[str, Any]) -> None:
    t = c["tiles"]
    self.calls += 1
    self.routed_flops += t["routed_flops"]
    self.padded_flops += t["padded_flops"]
    self.eight_bit_flops += t["padded_flops"] if c["eight_bit"] else 0.0
    self.blocks += t["blocks"]
    self.working_blocks += t["working_blocks"]
    self.weight_bytes_over += c["weight_bytes_read"] - c["weight_bytes"]

  def empty_s(self, ch: Charges) -> float:
    return 1e-6 * ch.empty_wave_us * (self.blocks - self.working_blocks) / ch.resident_blocks


def grouped_gemm_tiles(M: int, K: int, N: int, G: int, ch: Charges) -> dict[str, float]:
  """One tokamax ragged_dot x [M, K] by w [G, K, N] with rows spread over the G groups as the charges'
  router spreads them, at the row tile the engine picks for the shape (moe.grouped_block_m) unless the
  charges fix one (tile_rows > 0)."""
  bm = ch.tile_rows if ch.tile_rows > 0 else moe.grouped_block_m(M, K, N, G)
  return dict(moe.grouped_tiles(M, K, N, G, bm, ch.tile_cols, skew=ch.skew), block_m=bm)


_OWN = re.compile(re.escape(grouped_gemm.NAME) + r"_(dot|swiglu)_bm(\d+)_m(\d+)")
_GRID = re.compile(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32")


def own_grouped_call(rest: str, ins, outs) -> dict[str, Any] | None:
  """This project's grouped GEMM kernel (model/grouped_gemm.py), read off its custom call: routed rows M and
  the tile (its name), K, N, groups G (the first [G, K, N] operand: the x rows come first, then the gathered
  variant's row indices), kernels (2: gate and up) and the launched grid."""
  m = _OWN.search(rest)
  w = next((s for _, s in ins if len(s) == 3), None)
  if not m or w is None or not outs:
    return None
  bm, M = int(m.group(2)), int(m.group(3))
  G, K, N = w
  g = _GRID.search(rest)
  return {"M": M, "K": K, "N": N, "G": G, "n_weights": 2 if m.group(1) == "swiglu" else 1, "block_m": bm,
          "slots": int(g.group(1)) if g else grouped_gemm.plan(M, G, K, N).slots}


def grouped_call(mod: Module, result: str, rest: str, ch: Charges) -> dict[str, Any] | None:
  """A grouped GEMM custom call (this project's kernel or tokamax's ragged_dot), costed with rows spread as
  the charges' router spreads them: its tiles (grouped_gemm.tiles), the bytes of its [G, K, N] weight
  operands and the bytes its tiles read of them (each row tile reads its group's weights; a group no row
  reaches is not read), and whether its rows are 8-bit (W8A8: the 8-bit tensor cores)."""
  ins, outs = mod.operands(rest), arrays(result)
  if _TPU_RAGGED.search(rest):  # XLA TPU's ragged dot kernel: x [M, K], w [G, K, N] among its operands
    x = next((a for a in ins if len(a[1]) == 2 and a[0] not in ("s32", "u32")), None)
    w = next((a for a in ins if len(a[1]) == 3), None)
    if x is None or w is None or not outs:
      return None
    (M, K), (G, _, N) = x[1], w[1]
    busy = G - idle_groups(M, G)
    # Its work items (ragged-dot-metadata's tables, sized tiles + G - 1) are (row tile, group) pairs, as in
    # this project's Mosaic kernel: each reads its group's weights. Expected: every tile, plus one per group
    # with rows, less one. Without the tables: each busy group's weights once.
    sized = [s[0] for dt, s in ins if dt in ("s32", "u32") and len(s) == 1 and s[0] not in (1, G + 1)]
    tiles = max(sized) - (G - 1) if sized else 0
    items = tiles + busy - 1.0 if tiles > 0 else busy
    t = {"routed_flops": 2.0 * M * K * N, "padded_flops": 2.0 * M * K * N, "weight_tiles": items,
         "blocks": 0, "working_blocks": 0}
    wb = _DT_BYTES[w[0]] * K * N
    return {"tiles": t, "weight_bytes": G * wb, "weight_bytes_read": items * wb, "eight_bit": x[0] in _EIGHT_BIT}
  if (m := _TPU_OWN.search(rest)):  # this project's Mosaic kernel (model/grouped_gemm_tpu.py): [Mp, K] x [G, K, N]
    x = next((a for a in ins if len(a[1]) == 2 and a[0] not in ("s32", "u32")), None)
    w = next((a for a in ins if len(a[1]) == 3), None)
    if x is None or w is None or not outs:
      return None
    bm, (M, K), (G, _, N) = int(m.group(1)), x[1], w[1]
    # A work item per (row tile, group) sharing rows: every tile once, plus one per group boundary inside a
    # tile (about one per group with rows); each item reads its group's [K, N] weights and multiplies a
    # full tile.
    items = -(-M // bm) + max(G - idle_groups(M, G) - 1.0, 0.0)
    wb = _DT_BYTES[w[0]] * K * N
    t = {"routed_flops": 2.0 * M * K * N, "padded_flops": 2.0 * items * bm * K * N, "weight_tiles": items,
         "blocks": 0, "working_blocks": 0}
    return {"tiles": t, "weight_bytes": G * wb, "weight_bytes_read": items * wb, "eight_bit": x[0] in _EIGHT_BIT}
  if not _TRITON.search(rest):
    return None
  own = own_grouped_call(rest, ins, outs)
  if own is not None:
    G, K, N = own["G"], own["K"], own["N"]
    t = grouped_gemm.tiles(own["M"], K, N, G, own["n_weights"], grouped_gemm.Plan(own["block_m"], own["slots"]),
                           skew=ch.skew)
  else:
    if len(ins) < 2 or len(ins[0][1]) != 2 or len(ins[1][1]) != 3 or not outs or len(outs[0][1]) != 2:
      return None
    (M, K), (G, K2, N) = ins[0][1], ins[1][1]
    if K != K2 or outs[0][1] != (M, N):
      return None
    t = grouped_gemm_tiles(M, K, N, G, ch)
  wb = sum(_DT_BYTES[dt] * K * N for dt, shp in ins if shp == (G, K, N))
  return {"tiles": t, "weight_bytes": G * wb, "weight_bytes_read": t["weight_tiles"] * wb,
          "eight_bit": bool(ins) and ins[0][0] in _EIGHT_BIT}


def grouped_gemms(mod: Module, ch: Charges) -> GroupedGemm:
  """The grouped GEMM calls: tokamax's (grid ceil(M / tile) x N-tiles x G) and this project's (slots x
  N-tiles x G: model/grouped_gemm.py)."""
  out = GroupedGemm()
  for comp in mod.comps.values():
    for _, result, op, rest in comp:
      c = grouped_call(mod, result, rest, ch) if op == "custom-call" else None
      if c is not None:
        out.add(c)
  return out


def idle_groups(M: int, G: int) -> float:
  """Expected groups that M rows routed uniformly at random leave empty: G (1 - 1/G)^M."""
  return G * (1.0 - 1.0 / G) ** M


_TPU_RAGGED = re.compile(r'custom_call_target="tpu_custom_call".*op_name="[^"]*ragged[-_]dot')
_TPU_OWN = re.compile(r'custom_call_target="tpu_custom_call".*' + re.escape(grouped_gemm_tpu.NAME) + r"_bm(\d+)")
_EIGHT_BIT = ("s8", "u8", "f8e4m3fn", "f8e5m2")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=\w+_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{size=([\dx]+)")
_CUBLAS = re.compile(r'custom_call_target="__cublas\$(?:lt\$)?(?:gemm|matmul)')
_CUBLAS_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_CUDNN = re.compile(r'custom_call_target="__cudnn\$fmha')
_TPU_CALL = re.compile(r'custom_call_target="tpu_custom_call"')


def dot_flops(mod: Module, comp: str) -> tuple[float, float]:
  """(FLOPs, of which 8-bit x 8-bit) of the dots in a computation (a GEMM fusion's body), and of the
  convolutions XLA TPU writes them as: 2 x output elements x the kernel's input features, times the window's
  taps where the window is summed whole (a spatial output of size 1: heads or experts contracted); a window
  that slides (a dilated or padded one: heads or experts as a batch) adds one tap per output."""
  total = eight = 0.0
  for _, result, iop, irest in mod.comps.get(comp, []):
    if iop not in ("dot", "convolution"):
      continue
    ins = mod.operands(irest)
    if iop == "convolution":  # XLA TPU's dots: input features (i) and, where the window is summed whole
      lab = _DIM_LABELS.search(irest)  # (an output of spatial size 1), its taps contracted; else it is a batch
      k = 1
      if lab and len(ins) == 2:
        k = np.prod([n for n, c in zip(ins[1][1], lab.group(1)) if c == "i"])
        out_shape = arrays(result)[0][1]
        win = _WINDOW.search(irest)
        if win and all(n == 1 for n, c in zip(out_shape, lab.group(2)) if c.isdigit()):
          k *= np.prod([int(x) for x in win.group(1).split("x")])
    else:
      c = _CONTRACT.search(irest)
      k = np.prod([ins[0][1][int(d)] for d in c.group(1).split(",") if d]) if (c and ins) else 1
    f = 2.0 * float(np.prod(arrays(result)[0][1])) * float(k)
    total += f
    if len(ins) == 2 and all(dt in _EIGHT_BIT for dt, _ in ins):
      eight += f
  return total, eight


def attention_flops(ins) -> float:
  """A fused attention call's FLOPs from q [B, T, N, H] and k [B, S, K, H]: 4 B N T S H."""
  if len(ins) < 2 or len(ins[0][1]) != 4:
    return 0.0
  (B, T, N, H), S = ins[0][1], ins[1][1][1]
  return 4.0 * B * N * T * S * H


def dequantized_copies(mod: Module) -> float:
  """Bytes written by kernels that turn an 8-bit array into a wider one of as many elements outside a GEMM:
  a dequantised weight materialised in HBM (a GEMM that reads 8-bit weights converts them in its operand
  load, inside a kCustom fusion or a custom call, and writes nothing of the kind)."""
  out = 0.0
  for comp in mod.comps.values():
    for _, result, op, rest in comp:
      if op != "fusion" or "kind=kCustom" in rest:
        continue
      res = arrays(result)
      if len(res) != 1 or res[0][0] in _EIGHT_BIT:
        continue
      n = int(np.prod(res[0][1]))
      if any(dt in _EIGHT_BIT and int(np.prod(shape)) == n for dt, shape in mod.operands(rest)):
        out += nbytes(res)
  return out


@dataclasses.dataclass
class Syncs:
  """Host reads of the generate program: per step (the loop that runs one forward per iteration) and per
  block (outside it), on the path a block takes when its forwards are known ahead (the common one: the
  fewest reads per step); per_step_max: the most of any step loop (e.g. the vicinity warm-up's blocks)."""
  per_step: int
  per_block: int
  per_step_max: int
  step_loops: int


def host_syncs(mod: Module) -> Syncs:
  """Counts the predicate reads of the denoising loop as compiled. The block loop is the entry's
  data-dependent `while` (one read per block); step loops are the data-dependent whiles inside its body,
  directly or under conditionals (one read per iteration, plus one per conditional in the step body). A
  block's reads outside its steps: every conditional of each computation on the path from the block body to
  its step loop. Loops with a known trip count are driven without a read."""
  def whiles(comp: str) -> list[str]:
    return [_BODY.search(rest).group(1) for _, _, op, rest in mod.comps.get(comp, [])
            if op == "while" and not _TRIP.search(rest)]

  def conds(comp: str) -> list[list[str]]:
    return [branches(rest) for _, _, op, rest in mod.comps.get(comp, []) if op == "conditional"]

  def in_body(comp: str) -> int:  # reads per step inside a step body (conditionals, through calls)
    n = len(conds(comp))
    for _, _, op, rest in mod.comps.get(comp, []):
      if op == "call" and _TO_APPLY.search(rest):
        n += in_body(_TO_APPLY.search(rest).group(1))
    return n

  def step_loops(comp: str, above: int) -> list[tuple[int, int]]:  # [(per_step, per_block_without_block_cond)]
    # Every loop of a computation reads its condition at least once per block, even one that runs no step.
    here = above + len(conds(comp)) + max(0, len(whiles(comp)) - 1)
    out = [(1 + in_body(body), here) for body in whiles(comp)]
    for branches in conds(comp):
      for br in branches:
        out += step_loops(br, here)
    return out

  blocks = whiles(mod.entry)
  if not blocks:
    return Syncs(per_step=0, per_block=0, per_step_max=0, step_loops=0)
  loops = step_loops(blocks[0], 0)
  if not loops:  # one loop level: every iteration is a step
    n = 1 + in_body(blocks[0])
    return Syncs(per_step=n, per_block=0, per_step_max=n, step_loops=1)
  per_step, per_block = min(loops)
  return Syncs(per_step=per_step, per_block=1 + per_block, per_step_max=max(p for p, _ in loops),
               step_loops=len(loops))


_REFS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_REF_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def reachable(mod: Module, comp: str) -> list[str]:
  """The computations `comp` runs or calls (itself first), through fusions, loops, conditionals and calls."""
  seen, todo = [comp], [comp]
  while todo:
    for _, _, _, rest in mod.comps.get(todo.pop(), []):
      names = _REFS.findall(rest) + [n.strip().lstrip("%") for lst in _REF_LISTS.findall(rest)
                                     for n in lst.split(",") if n.strip()]
      for n in names:
        if n in mod.comps and n not in seen:
          seen.append(n)
          todo.append(n)
  return seen


def subprogram(text: str, comp: str) -> str:
  """The optimised module's text re-rooted at `comp` (a loop body, a conditional branch): `comp` becomes the
  entry and only the computations it reaches are kept, so the cost analysis and every count of this module
  (kernels, gathers, grouped GEMMs) see one execution of that computation and nothing else."""
  keep = set(reachable(Module(text), comp))
  out, cur = ["HloModule subprogram"], None
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h:
      cur = h.group(2) if h.group(2) in keep else None
      if cur is not None:
        out.append(("ENTRY " if cur == comp else "") + line[len(h.group(1) or ""):])
      continue
    if cur is not None:
      out.append(line)
      # A computation ends on a line of its own: an instruction's backend config can run over several lines,
      # one of them starting with "}" (Pallas's splash kernel's xprof metadata).
      if line.rstrip() == "}":
        cur = None
  return "\n".join(out) + "\n"


def conditionals(mod: Module, comp: str) -> list[tuple[str, list[str]]]:
  """The conditionals `comp` itself runs: (instruction name, branch computations in index order; a
  predicate's are true, false)."""
  return [(name, branches(rest)) for name, _, op, rest in mod.comps.get(comp, []) if op == "conditional"]


def specialize(text: str, comp: str, cond: str, index: int) -> str:
  """The module text with conditional `cond` (in computation `comp`) replaced by a call of its branch
  `index` on that branch's operand: the program as it runs when that branch is taken, for costing a
  conditional by how often each branch runs (a cost analysis takes the most expensive branch, and a
  kernel count every branch)."""
  out, cur, done = [], None, False
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h:
      cur = h.group(2)
    m = _INSTR.match(line)
    if cur == comp and m and m.group(1) == cond and m.group(3) == "conditional":
      rest = m.group(4)
      names = _operand_names(rest)
      brs = branches(rest)
      if not 0 <= index < len(brs):
        raise ValueError(f"specialize: conditional {cond} has {len(brs)} branches, no branch {index}")
      head = line[:line.index(" conditional(")]
      line = f"{head} call(%{names[1 + index]}), to_apply=%{brs[index]}"
      done = True
    out.append(line)
  if not done:
    raise ValueError(f"specialize: no conditional named {cond!r} in computation {comp!r}")
  return "\n".join(out) + "\n"


@dataclasses.dataclass(frozen=True)
class LoopParts:
  """Where one iteration of each kind lives in the generate program (engine.loop): the block loop's body;
  in it, the block-entry iteration (the largest branch of its conditionals: the refresh with its decoder and
  smoothing; None without one) and the step loop that runs the rest of the block (its last data-dependent
  while: the cached steps, or the full ones without a cache). step_fixed: that loop's body picks no forward
  at run time (no conditional in it), so one execution of it is one iteration of a known kind."""
  block: str
  entry: str | None
  step: str | None
  step_fixed: bool


def loop_parts(mod: Module) -> LoopParts | None:
  """The generate program's parts (None: the entry has no data-dependent block loop)."""
  def whiles(comp: str) -> list[str]:
    return [_BODY.search(rest).group(1) for _, _, op, rest in mod.comps.get(comp, [])
            if op == "while" and not _TRIP.search(rest)]
  blocks = whiles(mod.entry)
  if not blocks:
    return None
  block = blocks[0]
  brs = [br for _, _, op, rest in mod.comps[block] if op == "conditional" for br in branches(rest)]
  entry = max(brs, key=lambda b: len(mod.comps.get(b, [])), default=None)
  steps = whiles(block)
  step = steps[-1] if steps else None
  fixed = step is not None and not any(op == "conditional" for c in reachable(mod, step)
                                       for _, _, op, _ in mod.comps.get(c, []))
  return LoopParts(block=block, entry=entry, step=step, step_fixed=fixed)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")  # [groups, size]<=[n]
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")


def collective_kind(op: str) -> str | None:
  """The collective an instruction runs (its async start counted, its done not), or None."""
  base = op[:-len("-start")] if op.endswith("-start") else op
  return base if base in COLLECTIVES else None


def collective_result(result: str, op: str) -> list[tuple[str, tuple[int, ...]]]:
  """The arrays a collective produces: an async start's type is (operands..., results...[, context]), of which
  the results are the second half (a collective-permute's: its last array)."""
  arrs = arrays(result)
  if not (op.endswith("-start") and result.startswith("(")):
    return arrs
  return arrs[-1:] if op.startswith("collective-permute") else arrs[len(arrs) // 2:]


def group_size(rest: str, default: int) -> int:
  """Devices per replica group of a collective (its iota form [groups,size]<=[n] or its list {{0,1,..},..})."""
  if (m := _GROUPS_IOTA.search(rest)):
    return int(m.group(2))
  if (m := _GROUPS_LIST.search(rest)):
    return len([d for d in m.group(1).split(",") if d])
  return default


def ring_link_bytes(kind: str, nbytes: float, p: int) -> float:
  """Bytes one device sends over its link for a collective of `nbytes` result bytes among p devices (ring
  algorithms): an all-reduce 2(p-1)/p of them, a gather, scatter or all-to-all (p-1)/p, a permute all."""
  p = max(p, 2)
  if kind == "all-reduce":
    return 2 * (p - 1) / p * nbytes
  return nbytes if kind == "collective-permute" else (p - 1) / p * nbytes


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """One kernel launch as charged: its class (memory, gemm, grouped, attention), the bytes it moves and the
  FLOPs it runs (of which 8-bit x 8-bit), times: how often one execution launches it (a loop's known trip
  count)."""
  name: str
  cls: str
  bytes: float
  flops: float
  eight_bit_flops: float
  times: int = 1

  def seconds(self, ch: Charges) -> float:
    """max(bytes / bandwidth, FLOPs / rate) at the kernel class's fractions of the chip's achievable rates; a
    collective (cls "collective", bytes: what one device sends) its bytes over the link plus its latency."""
    if self.cls == "collective":
      return self.bytes / ch.link_bytes_per_s + 1e-6 * ch.collective_us
    bw, rate = ch.efficiency.of(self.cls)
    compute = ((self.flops - self.eight_bit_flops) / (ch.bf16_flops * rate)
               + self.eight_bit_flops / (ch.eight_bit_flops * rate))
    return max(self.bytes / (ch.hbm_bytes_per_s * bw), compute)


def kernel_costs(mod: Module, ch: Charges, comp: str | None = None, nested: bool = True) -> list[KernelCost]:
  """Every kernel one execution of `comp` (default: the entry) launches, with its bytes (operands + results,
  less overcharges) and FLOPs (GEMM dots, attention, the grouped GEMMs' tiles; the elementwise work of a
  fusion is not charged: such kernels are bound by their bytes). Loops with a known trip count count their
  body that many times, a loop without one (or a conditional: every branch) once, as kernels() does."""
  over = overcharges(mod)
  out: list[KernelCost] = []

  def walk(c: str, times: int) -> None:
    for name, result, op, rest in mod.comps.get(c, []):
      if op in _FREE or op.endswith("-done"):
        continue
      if op in _CONTROL:
        if not nested:
          continue
        if op == "while":
          t = _TRIP.search(rest)
          walk(_BODY.search(rest).group(1), times * (int(t.group(1)) if t else 1))
        elif op == "conditional":
          for br in branches(rest):
            walk(br, times)
        elif (m := _TO_APPLY.search(rest)):
          walk(m.group(1), times)
        continue
      if ch.link_bytes_per_s and (coll := collective_kind(op)):
        sent = ring_link_bytes(coll, nbytes(collective_result(result, op)), group_size(rest, 2))
        out.append(KernelCost(name, "collective", sent, 0.0, 0.0, times))
        continue
      ins = mod.operands(rest)
      if op.endswith("-start"):  # an async copy (a TPU's HBM <-> VMEM DMA): what it moves, once
        into_vmem = nbytes([a for a, layout in zip(arrays(result), _layouts(result)) if _VMEM in layout])
        moved = max(into_vmem, nbytes(hbm_arrays(result)) - nbytes(ins[:1]))
        out.append(KernelCost(name, "memory", max(float(moved), 0.0), 0.0, 0.0, times))
        continue
      # Operands and results in HBM: a TPU kernel reading what a DMA put in VMEM does not read HBM.
      moved = nbytes(mod.operands(rest, hbm=True)) + nbytes(hbm_arrays(result)) - over.get(name, 0.0)
      cls, flops, eight = "memory", 0.0, 0.0
      called = _CALLS.search(rest) if op == "fusion" else None
      if called:
        flops, eight = dot_flops(mod, called.group(1))
        cls = "gemm" if flops else "memory"
      elif op == "custom-call":
        if _CUDNN.search(rest):
          cls, flops = "attention", attention_flops(ins)
        elif name.startswith("splash_mha") and _TPU_CALL.search(rest):  # Pallas's TPU splash kernel: q [B, N, T, H], k [B, N, S, H]
          qk = [s for dt, s in ins if len(s) == 4 and dt not in _EIGHT_BIT][:2]
          cls = "attention"
          if len(qk) == 2:
            (B, N, T, H), S = qk[0], qk[1][2]
            flops = 4.0 * B * N * T * S * H
        elif _CUBLAS.search(rest):
          cls = "gemm"
          k = _CUBLAS_CONTRACT.search(rest)
          dims = [int(d.strip().strip('"')) for d in k.group(1).split(",") if d.strip()] if k else []
          if ins and arrays(result):
            kk = np.prod([ins[0][1][d] for d in dims]) if dims else ins[0][1][-1]
            flops = 2.0 * float(np.prod(arrays(result)[0][1])) * float(kk)
          eight = flops if len(ins) >= 2 and all(dt in _EIGHT_BIT for dt, _ in ins[:2]) else 0.0
        elif (g := grouped_call(mod, result, rest, ch)) is not None:
          cls, flops = "grouped", g["tiles"]["padded_flops"]
          eight = flops if g["eight_bit"] else 0.0
          moved += g["weight_bytes_read"] - g["weight_bytes"]
      out.append(KernelCost(name, cls, max(moved, 0.0), flops, eight, times))

  walk(comp or mod.entry, 1)
  return out


def charged(costs: list[KernelCost], ch: Charges) -> dict[str, Any]:
  """Totals of kernel_costs: seconds (each kernel at its own bound, summed), HBM bytes, FLOPs, seconds per
  class and the bytes collectives send over the links."""
  by_class: dict[str, float] = {}
  for k in costs:
    by_class[k.cls] = by_class.get(k.cls, 0.0) + k.times * k.seconds(ch)
  return {"seconds": sum(by_class.values()), "bytes": sum(k.times * k.bytes for k in costs if k.cls != "collective"),
          "link_bytes": sum(k.times * k.bytes for k in costs if k.cls == "collective"),
          "flops": sum(k.times * k.flops for k in costs), "eight_bit_flops": sum(k.times * k.eight_bit_flops for k in costs),
          "by_class_s": by_class}


def own_time(mod: Module, comp: str, ch: Charges) -> dict[str, Any]:
  """Realistic time of a computation's own kernels, not of the loops and conditionals it runs (a block
  body's bookkeeping between its iterations): each kernel at its own bound, plus the kernel floors."""
  c = charged(kernel_costs(mod, ch, comp, nested=False), ch)
  k = kernels(mod, ch, comp, nested=False)
  return {"realistic_s": c["seconds"] + k.overhead_s(ch), "realistic_bytes": c["bytes"], "kernels": k.total}


def forward_time(cost: dict[str, float], mod: Module, ch: Charges) -> dict[str, Any]:
  """Realistic time of one forward (or of any straight-line program): each kernel charged max(bytes /
  bandwidth, FLOPs / rate) at its class's fractions of the achievable peaks (bytes corrected for what
  operands and results overstate: gathers, in-place updates, slices; the grouped GEMMs' weight tiles as the
  router spreads rows), summed over kernels, plus the kernel floors and the grouped GEMMs' empty grid blocks.
  program_bound_s: the whole program's bytes or FLOPs at the achievable peaks, whichever is longer (the
  model before per-kernel charging: memory- and compute-bound kernels hiding each other); cost: XLA's cost
  analysis of the module (its bytes are reported beside the charged ones)."""
  k = kernels(mod, ch)
  gg = grouped_gemms(mod, ch)
  c = charged(kernel_costs(mod, ch), ch)
  moved, flops, flops8 = c["bytes"], c["flops"], c["eight_bit_flops"]
  program = max(moved / ch.hbm_bytes_per_s, (flops - flops8) / ch.bf16_flops + flops8 / ch.eight_bit_flops)
  overhead = k.overhead_s(ch)
  empty = gg.empty_s(ch)
  return {"realistic_s": c["seconds"] + overhead + empty, "realistic_bytes": moved, "realistic_flops": flops,
          "eight_bit_flops": flops8, "program_bound_s": program,
          "class_ms": {cls: 1e3 * v for cls, v in sorted(c["by_class_s"].items())},
          "kernels": k.total, "graphs": k.graphs, "kernels_in_graphs": k.in_graphs, "separate_launches": k.separate,
          "kernels_by_kind": dict(k.by_kind), "kernel_overhead_s": overhead, "grouped_gemm_calls": gg.calls,
          "grouped_gemm_pad_flops": gg.padded_flops - gg.routed_flops, "grouped_gemm_empty_s": empty,
          "grouped_gemm_weight_bytes_over": gg.weight_bytes_over,
          "overcount_bytes": cost["bytes"] - moved, "dequantized_copy_bytes": dequantized_copies(mod)}
