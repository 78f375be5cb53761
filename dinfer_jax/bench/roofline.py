"""GPU speed on paper: compile the engine's forwards and generate program for an H200/H100 without a GPU and
read the bytes and FLOPs XLA's optimised module moves.

python -m dinfer_jax.bench.roofline [--preset llada_moe_7b_a1b] [--chip h200] [--batches 1,8]
                                    [--caches dual] [--tpf 3.87] [--json FILE]
python -m dinfer_jax.bench.roofline --preset tiny --target cpu     # no CUDA plugin needed (CI)

Targets:
- cuda (default when a CUDA plugin is installed, `pip install jax[cuda12]` or `jax[cuda13]`): a deviceless
  ahead-of-time compile for the chip's GpuTargetConfig (jax.experimental.topologies), run with
  JAX_PLATFORMS=cpu; XLA's cost analysis of the GPU-optimised module, run by the CPU client;
- cpu: the same measurement of the CPU-optimised module. Its bytes/FLOPs are the CPU compiler's, labelled
  as such: use it to exercise the bench anywhere, not to predict GPU speed.

Per forward (the refresh forward over the whole canvas, the cached forward over the window) it reports FLOPs
and bytes accessed with every while loop (the layer scan) counted body x trip count, the temp memory, the
floor (bytes the forward must move: every weight it touches, K/V read and written, embedding rows, fp32
logits written; floors.bytes_per_forward), bytes/floor, routed FLOPs (floors.flops_per_forward) and
the roofline time max(bytes / bandwidth, FLOPs / peak). The whole generate program is compiled too (temp
memory, host transfers). Predicted TPS at a tokens-per-forward figure: a G-token generation takes G / TPF
forwards, one refresh per block and the rest cached (all full forwards without a cache).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import json
import math
import os
import pathlib
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib import _jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec
from jaxlib import _hlo

from dinfer_jax import cli_help, hardware, sharding
from dinfer_jax.bench import presets, realistic
from dinfer_jax.bench.floors import bytes_per_forward, flops_per_forward
from dinfer_jax.bench.throughput import cached_kind, forward_programs
from dinfer_jax.cache import KVCache
from dinfer_jax.cli_common import QUANTIZE_CHOICES, is_quantize_spec
from dinfer_jax.engine import generate as gen_lib, iteration, loop
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.engine.loop import decode_rows, init_rows
from dinfer_jax.engine.program import Knobs
from dinfer_jax.model import moe, params as params_lib, quant

DINFER_TPF = 3.87  # dInfer, LLaDA-MoE, threshold 0.8 + smoothing + vicinity, dual cache (paper Table 1)
LLADA21_S_TPF = 5.93  # LLaDA2.1-mini, S mode (M2T 0.5, T2T 0.0), as its report counts forwards (editing.md)

_GPU_INFO = """gpu_device_info {{
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: {sms}  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: {bw}  l2_cache_size: {l2}  clock_rate_ghz: 1.98
  device_memory_size: {mem}  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{name}"
"""


def target_config(chip: hardware.Chip) -> str:
  """The chip as XLA's GpuTargetConfig (a deviceless compile for it)."""
  return _GPU_INFO.format(bw=int(chip.hbm_bytes_per_s), l2=chip.l2_bytes, mem=chip.memory_bytes, name=chip.name,
                          sms=chip.sms)


def roofline_s(chip: hardware.Chip, flops: float, nbytes: float) -> float:
  """The ideal time at the spec peaks."""
  return max(nbytes / chip.hbm_bytes_per_s, flops / chip.bf16_flops)


CHIPS = hardware.CHIPS
ALL_CHIPS = {**hardware.CHIPS, **hardware.TPUS}
# TPU slices as libtpu's topologies name them, by chip count (v5e / v6e: a 2D torus; v5p: 3D).
TPU_TOPOLOGIES = {1: "1x1", 2: "1x2", 4: "2x2", 8: "2x4", 16: "4x4"}
TPU_TOPOLOGIES_3D = {1: "1x1x1", 2: "1x1x2", 4: "1x2x2", 8: "2x2x2", 16: "2x2x4"}


def parse_chip(spec: str) -> tuple[str, int]:
  """'h200' -> ('h200', 1); 'v6e-4' -> ('v6e', 4): a TPU slice of 4 chips (a chip count in TPU_TOPOLOGIES)."""
  key, sep, n = spec.partition("-")
  if key not in ALL_CHIPS:
    raise ValueError(f"--chips {spec!r}: unknown chip {key!r}; choose from {', '.join(ALL_CHIPS)} (a TPU slice as "
                     "v6e-4)")
  if not sep:
    return key, 1
  if key not in hardware.TPUS:
    raise ValueError(f"--chips {spec!r}: slices are TPU ones here (a GPU mesh: bench.mesh_compile)")
  if not n.isdigit() or int(n) not in TPU_TOPOLOGIES:
    raise ValueError(f"--chips {spec!r}: a {key} slice of {sorted(TPU_TOPOLOGIES)} chips")
  return key, int(n)


def tpu_mesh(key: str, layout: dict[str, int]):
  """A (data, tensor, expert) mesh over a described TPU slice of prod(layout) chips (libtpu's topology; no
  TPU needed). One chip: a 1x1 topology on a one-chip host."""
  n = math.prod(layout.values())
  names = TPU_TOPOLOGIES_3D if key == "v5p" else TPU_TOPOLOGIES
  if n not in names:
    raise ValueError(f"mesh of {n} {key} chips: choose {sorted(names)} chips")
  # libtpu asks the cloud metadata server what it runs on unless told not to (no network here).
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  extra = {"chips_per_host_bounds": (1, 1, 1)} if n == 1 else {}
  topo = topologies.get_topology_desc(topology_name=f"{key}:{names[n]}", platform="tpu", **extra)
  return sharding.make_mesh(devices=topo.devices, **{a: layout.get(a, 1) for a in sharding.MESH_AXES})


def libtpu_available() -> bool:
  """Whether libtpu is installed (`pip install -e ".[tpu]"`): it compiles for TPUs without one."""
  try:
    return importlib.util.find_spec("libtpu") is not None
  except ImportError:
    return False


def cuda_plugin_available() -> bool:
  """Whether a CUDA plugin is installed: jax[cuda12]'s, or jax[cuda13]'s (the GPU machine's stack, jax 0.11).
  Without one the bench compiles for the CPU, a different program: the CUDA 13 plugin was once missed here
  and jax 0.11's rows came out dense and host-looped."""
  try:
    return any(importlib.util.find_spec(f"jax_plugins.xla_{v}") is not None for v in ("cuda12", "cuda13"))
  except ImportError:  # no jax_plugins package at all: CPU jax alone
    return False


# ----------------------------------------------------------------------------- compile targets

class Target:
  """Where to compile: abstract inputs carry the target's sharding; kernel choices are traced for it.

  layout: a TPU slice's mesh ({"tensor": 4}, {"tensor": 2, "expert": 2}); the weights are placed by the
  rules table (sharding.param_shardings) and the programs traced as the engine traces them on a mesh
  (sharding.use_mesh, moe.partitioned). Batch rows stay whole (no "data" axis here)."""

  def __init__(self, kind: str, chip: hardware.Chip | hardware.Tpu, layout: dict[str, int] | None = None):
    if kind not in ("cuda", "cpu", "tpu"):
      raise ValueError(f"--target {kind!r}: choose cuda, tpu or cpu")
    if (kind == "tpu") != isinstance(chip, hardware.Tpu):
      raise ValueError(f"--target {kind}: chip {chip.key} is not one ({'a TPU' if kind == 'tpu' else 'a GPU'})")
    layout = {a: n for a, n in (layout or {}).items() if n != 1}
    if layout and kind != "tpu":
      raise ValueError(f"--mesh on {chip.key}: slices are TPU ones here (a GPU mesh: bench.mesh_compile)")
    if layout.get("data", 1) != 1:
      raise ValueError(f"--mesh {layout}: a slice runs tensor and expert parallel here; batch rows are not split")
    self.kind, self.chip, self.layout = kind, chip, layout
    self.n_chips = math.prod(layout.values())
    self.sharding = self.mesh = None
    if kind == "tpu":
      if not libtpu_available():
        raise ValueError(f"chip {chip.key}: a deviceless TPU compile needs libtpu: pip install -e '.[tpu]'")
      self.mesh = tpu_mesh(chip.key, layout)
      self.sharding = NamedSharding(self.mesh, PartitionSpec())
    if kind == "cuda":
      if not cuda_plugin_available():
        raise ValueError("--target cuda needs the CUDA plugin: pip install 'jax[cuda12]' or 'jax[cuda13]' (or use "
                         "--target cpu)")
      topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(chip), topology="1x1x1")
      mesh = topologies.make_mesh(topo, (1,), ("x",))
      self.sharding = NamedSharding(mesh, PartitionSpec())
      self.mesh = mesh

  @property
  def label(self) -> str:
    if self.kind in ("cuda", "tpu"):
      return f"{self.chip_name} (deviceless {self.kind.upper()} compile)"
    return "CPU compile (CPU-optimised HLO, not a GPU prediction)"

  @property
  def chip_name(self) -> str:
    """The chip as rows name it: 'TPU v6 lite', or a slice's 'TPU v6 lite x4 (tensor=4)'."""
    if self.n_chips == 1:
      return self.chip.name
    return f"{self.chip.name} x{self.n_chips} ({','.join(f'{a}={n}' for a, n in self.layout.items())})"

  def charges(self, case: str = "central") -> realistic.Charges:
    """The realistic model's charges on this target (a range's end: "slow", "fast"); a slice's with its
    collectives over the chips' links."""
    ch = {"central": realistic.CHARGES[self.chip.key], "slow": realistic.RANGES[self.chip.key][0],
          "fast": realistic.RANGES[self.chip.key][1]}[case]
    return realistic.with_links(ch, self.chip.key) if self.n_chips > 1 else ch

  def abstract_params(self, tree, cfg):
    """The weights as the target holds them: on a slice each leaf split by its logical axes."""
    if self.n_chips == 1:
      return self.abstract(tree)
    shard = sharding.param_shardings(tree, params_lib.unstacked_logical_axes(cfg, tree), self.mesh)
    return jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shard)

  @property
  def backend(self) -> str:
    return {"cuda": "gpu", "tpu": "tpu"}.get(self.kind, "cpu")

  def abstract(self, tree):
    """Abstract args, replicated; on a slice a KV cache's layers split by kv heads as the engine's loop holds
    them (sharding.CACHE_AXES), and a leaf that already has a sharding (a weight, a vocab-split table or
    logits) keeps it."""
    def one(a, spec=None):
      if isinstance(a, jax.ShapeDtypeStruct) and a.sharding is not None:
        return a
      sh = self.sharding if spec is None else NamedSharding(self.mesh, sharding.spec_for(spec, self.mesh, np.shape(a)))
      return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sh)

    def node(x):
      if isinstance(x, KVCache):
        return jax.tree_util.tree_map(lambda a: one(a, sharding.CACHE_AXES[-np.ndim(a):] if self.n_chips > 1 else None), x)
      return one(x)
    return jax.tree_util.tree_map(node, tree, is_leaf=lambda x: isinstance(x, KVCache))

  def vocab_split(self, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...]) -> jax.ShapeDtypeStruct:
    """An abstract array with these logical axes (the vocabulary split on a slice; replicated on a chip)."""
    if self.n_chips == 1:
      return jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.named(self.mesh, axes, shape))

  def compile(self, fn, *args, donate=(), options: dict | None = None):
    # jax 0.11's Pallas-Triton lowering reads the GPU it compiles for from the abstract mesh's device when the
    # process has none ("No supported GPU devices found" otherwise; jax 0.10 did not ask): the topology's.
    mesh_ctx = contextlib.ExitStack()
    if self.n_chips > 1:  # as the engine traces a program for a mesh (engine.generate)
      mesh_ctx.enter_context(sharding.use_mesh(self.mesh))
      mesh_ctx.enter_context(moe.partitioned(True))
    elif self.mesh is not None:
      mesh_ctx.enter_context(jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh))
    tuned = hardware.target(self.chip.key) if self.kind != "tpu" else contextlib.nullcontext()
    with moe.target_backend(self.backend), tuned, deviceless_tokamax(self.kind == "cuda"), mesh_ctx:
      t = time.perf_counter()
      jf = jax.jit(fn, donate_argnums=donate if self.kind != "cpu" else (),
                   compiler_options=options or None)
      compiled = jf.lower(*args).compile()
      return compiled, time.perf_counter() - t


@contextlib.contextmanager
def deviceless_tokamax(on: bool):
  """tokamax checks the default device (this process's CPU) before lowering its Triton kernels; with no GPU
  here, tell it the target is one. Only the bench's deviceless compiles do this."""
  if not (on and moe.has_gpu_grouped_gemm()):
    yield
    return
  from tokamax._src.ops.ragged_dot import pallas_triton
  cls = pallas_triton.PallasTritonRaggedDot
  saved = cls.supported_on
  cls.supported_on = lambda self, device: True
  try:
    yield
  finally:
    cls.supported_on = saved


# ----------------------------------------------------------------------------- cost of the optimised module

_KERNEL = re.compile(r'= (.*?) custom-call\(.*custom_call_target="(__gpu\$xla\.gpu\.triton|__cudnn\$fmha[\w$]*)".*?'
                     r'operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}')


def kernel_call_cost(line: str) -> dict[str, float] | None:
  """Cost analysis sees a Pallas-Triton or cuDNN attention kernel as an opaque custom call (0 bytes, 0
  FLOPs). Count its operands and outputs once, and the FLOPs of a grouped GEMM (x [M, K], w [G, K, N] ->
  [M, N]: 2 M K N) or of attention (q [B, T, N, H], k [B, S, K, H]: 4 B N T S H)."""
  m = _KERNEL.search(line)
  if not m:
    return None
  outs, ins = realistic.arrays(m.group(1)), realistic.arrays(m.group(3))
  flops = 0.0
  if m.group(2).startswith("__cudnn"):
    flops = realistic.attention_flops(ins)
  elif (own := realistic.own_grouped_call(line, ins, outs)) is not None:
    flops = 2.0 * own["M"] * own["K"] * own["N"] * own["n_weights"]
  elif len(ins) >= 2 and len(ins[0][1]) == 2 and len(ins[1][1]) == 3 and outs and len(outs[0][1]) == 2:
    (M, K), (_, K2, N) = ins[0][1], ins[1][1]
    if K == K2 and outs[0][1] == (M, N):
      flops = 2.0 * M * K * N
  return {"flops": flops, "bytes": float(realistic.nbytes(ins) + realistic.nbytes(outs))}

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(")
_WHILE = re.compile(r"\bwhile\(.*?body=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_HOST = re.compile(r"\b(infeed|outfeed|send|recv|send-done|recv-done)\(|xla_python_cpu_callback|xla_python_gpu_callback|xla_ffi_python")


class ModuleCost:
  """XLA's cost analysis of an optimised module with every while loop counted body x trip count.

  Cost analysis visits a loop body once. total(c) = flat(c) + sum over c's loops of n * total(body) -
  flat(body), where flat(c) is the analysis of the module re-rooted at c (text round trip). A loop without a
  known trip count (the generate program's data-dependent loops) counts once and is listed as unknown."""

  def __init__(self, hlo_text: str):
    self._from_text = _hlo.hlo_module_from_text
    self._client = jax.devices("cpu")[0].client
    self.lines = hlo_text.splitlines()
    self.comps: dict[str, list[int]] = {}  # name -> [header line index, ...]
    self.entry = None
    cur = None
    for i, line in enumerate(self.lines):
      m = _HEADER.match(line)
      if m:
        cur = m.group(2)
        self.comps[cur] = [i]
        if m.group(1):
          self.entry = cur
      elif cur is not None:
        self.comps[cur].append(i)
    self.unknown_trip_loops = 0
    self.kernel_calls = 0
    self._flat: dict[str, dict[str, float]] = {}
    self.host_ops = sum(1 for line in self.lines if _HOST.search(line))

  def _loops(self, comp: str) -> list[tuple[str, int | None]]:
    out = []
    for i in self.comps[comp]:
      line = self.lines[i]
      m = _WHILE.search(line)
      if m:
        t = _TRIP.search(line)
        out.append((m.group(1), int(t.group(1)) if t else None))
    return out

  def flat(self, comp: str) -> dict[str, float]:
    if comp not in self._flat:
      lines = ["HloModule rerooted"]
      for i, line in enumerate(self.lines[1:], start=1):
        if line.startswith("ENTRY "):
          line = line[len("ENTRY "):]
        if i == self.comps[comp][0]:
          line = "ENTRY " + line
        lines.append(line)
      c = _jax.hlo_module_cost_analysis(self._client, self._from_text("\n".join(lines)))
      self._flat[comp] = {"flops": float(c.get("flops", 0.0)), "bytes": float(c.get("bytes accessed", 0.0))}
    return self._flat[comp]

  def opaque(self, comp: str) -> dict[str, float]:
    out = {"flops": 0.0, "bytes": 0.0}
    for i in self.comps[comp]:
      c = kernel_call_cost(self.lines[i])
      if c:
        self.kernel_calls += 1
        for k in out:
          out[k] += c[k]
    return out

  def total(self, comp: str | None = None) -> dict[str, float]:
    comp = comp or self.entry
    out = dict(self.flat(comp))
    for k, v in self.opaque(comp).items():
      out[k] += v
    for body, n in self._loops(comp):
      if n is None:
        self.unknown_trip_loops += 1
        n = 1
      inner, flat = self.total(body), self.flat(body)
      for k in out:
        out[k] += n * inner[k] - flat[k]
    return out


def compiled_text(compiled) -> str:
  return compiled.runtime_executable().hlo_modules()[0].to_string()


def compiler_optimal_ms(compiled) -> float | None:
  """The target compiler's own roofline of a compiled program (XLA TPU's cost analysis reports one,
  `optimal_seconds`, with its memory spaces accounted: VMEM traffic is not HBM traffic); None elsewhere."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - a compile-only client without one
    return None
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  s = cost.get("optimal_seconds") if isinstance(cost, dict) else None
  # libtpu 0.0.42.1 reported -3.9999 s for the tiny preset's forwards: no estimate, not a time.
  return None if s is None or float(s) <= 0 else 1e3 * float(s)


def memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes)}


# ----------------------------------------------------------------------------- the bench

def _prompts(cfg, batch: int, length: int) -> list[list[int]]:
  bad = {cfg.mask_token_id, cfg.eos_token_id}
  return [[t if t not in bad else 7 for t in range(10 + r, 10 + r + length)] for r in range(batch)]


# The decoder settings the bench compiles, and the tokens per forward each is known to reach (dInfer paper
# Table 1, LLaDA-MoE, dual cache): a prediction uses the TPF of what was compiled (--tpf overrides).
SETTINGS = {
    # threshold 0.8 + iteration smoothing + vicinity refresh (prefix/after look 16, warm-up 4): dInfer's
    # KV-cache row, TPF 3.87.
    "dinfer": DINFER_TPF,
    # plain threshold 0.8: dInfer reports no TPF for it with a cache; give --tpf (LLaDA2.0: 3.08, editing.md).
    "threshold": None,
    # LLaDA2.1's token editing, S mode (JointThreshold 0.5 / 0.0): TPF 5.93 on LLaDA2.1-mini as its report counts
    # forwards (editing.md); blocks settle on a forward that saw them, so no cross-block forward.
    "editing": LLADA21_S_TPF,
}


def generation_config(preset: presets.Preset, cache: str, setting: str = "dinfer") -> GenerationConfig:
  if setting not in SETTINGS:
    raise ValueError(f"--setting {setting!r}: choose from {', '.join(SETTINGS)}")
  gcfg = GenerationConfig(gen_length=preset.gen_length, block_length=preset.block_length, cache=cache,
                          threshold=0.8, prompt_bucket=preset.block_length, early_stop=True)
  if setting == "editing":
    return gcfg.replace(decoder="joint_threshold", threshold=0.5, edit_threshold=0.0)
  if setting == "dinfer" and preset.model().block_diffusion:
    raise ValueError("--setting dinfer compiles iteration smoothing, which block diffusion does not run; use "
                     "--setting threshold --tpf T or --setting editing")
  if setting == "dinfer":
    vic = dict(prefix_look=16, after_look=16, warmup_steps=4) if cache == "dual" else {}
    gcfg = gcfg.replace(cont_weight=0.3, **vic)
  return gcfg


def step_programs(cfg, gcfg: GenerationConfig, lay, prog, *, dtype, table=None,
                  target: Target | None = None) -> dict[str, tuple[Any, tuple]]:
  """The work of a loop iteration outside its forward, per forward kind: the decoder on the block's logits
  and, with smoothing, the soft embeddings of the positions the forward saw (the generation region after a
  refresh, the window after a cached forward): f(table, logits, canvas, ...) as the loop runs them. table:
  the abstract embedding table as the engine holds it (an 8-bit QArray with +embed; default [V, D] dtype).
  target: table and logits split by vocabulary as a slice holds them."""
  def abstract(shape, dt, axes):
    return target.vocab_split(shape, dt, axes) if target is not None else jax.ShapeDtypeStruct(shape, dt)
  grid = lay.grid
  B, L, W, V, D = grid.batch, grid.block_len, grid.window, cfg.vocab_size, cfg.d_model
  G = grid.canvas_len - grid.first_block
  decoder, mask_id, knobs = prog.decoder, prog.mask_id, Knobs.of(gcfg).decoder
  out = {}
  kinds = (("refresh", G), ("cached", W)) if gcfg.cache != "none" else (("refresh", G),)
  for kind, width in kinds:
    width = width if gcfg.smoothing else L

    def f(table, logits, tokens, maskable, n, seed, width=width):
      blk = logits[:, :L]
      dec = init_rows(decoder, tokens[:, :L], maskable)
      thr = iteration.step_threshold(n, gcfg.smoothing, gcfg.threshold)
      keys = jax.vmap(lambda r: jax.random.fold_in(seed, r))(jnp.arange(B))
      new, committed, _ = decode_rows(decoder, dec, blk, tokens[:, :L], maskable, knobs, thr, keys, mask_id=mask_id,
                                      temperature=0.0)
      res = {"tokens": new, "committed": committed}
      if gcfg.smoothing:
        toks = jnp.concatenate([new, tokens[:, L:]], axis=1)
        res["emb"] = iteration.soft_embed(table, toks, logits, toks == mask_id,
                                          iteration.smooth_weight(n, gcfg.cont_weight))
      return res
    args = (abstract((V, D), dtype, ("vocab", "embed")) if table is None else table,
            abstract((B, width, V), jnp.float32, ("act_batch", "act_len", "vocab")),
            jax.ShapeDtypeStruct((B, width), jnp.int32), jax.ShapeDtypeStruct((B, L), jnp.bool_),
            jax.ShapeDtypeStruct((B,), jnp.int32), jax.random.PRNGKey(0))
    out[kind] = (f, args)
  return out


def abstract_inference_params(cfg, dtype, weights: str = "bf16"):
  """The engine's per-layer param layout (params.engine_layout) as ShapeDtypeStructs, with the matmul
  weights as abstract QArrays for 8-bit `weights` (model/quant.py)."""
  tree = params_lib.abstract_params(cfg, dtype)
  qc = quant.QuantConfig.parse(weights)
  if qc is not None:
    tree = jax.eval_shape(lambda p: quant.quantize_params(p, qc), tree)
  return params_lib.unstack_layers(tree, take=lambda a, i: jax.ShapeDtypeStruct(a.shape[1:], a.dtype))


def forward_rows(target: Target, preset_name: str, batch: int, cache: str, *, dtype=jnp.bfloat16,
                 with_generate: bool = True, setting: str = "dinfer", weights: str = "bf16",
                 charges: realistic.Charges = realistic.H200,
                 ends: dict[str, realistic.Charges] | None = None) -> list[dict[str, Any]]:
  """One row per forward kind (refresh/full and cached) plus one for the generate program.

  Each forward row has the ideal figures (spec peaks, cost analysis as is) and the realistic ones
  (bench.realistic: each kernel at its class's share of the achievable peaks, kernel floors, the grouped
  GEMM's tiles as the router spreads rows, the gather at its rows) plus the realistic time of the
  iteration's work outside the forward (decoder, smoothing: step_ms). ends: other charges (the range's
  "slow" and "fast" ends), whose realistic times each row keeps under "cases" (as_case reads them)."""
  ends = ends or {}
  preset = presets.get(preset_name)
  cfg = preset.model()
  gcfg = generation_config(preset, cache, setting)
  lay, prog = gen_lib.prepare(cfg, _prompts(cfg, batch, preset.prompt_length), gcfg)
  grid = lay.grid
  aparams = target.abstract_params(abstract_inference_params(cfg, dtype, weights), cfg)
  table = aparams["embed"] if quant.is_qarray(aparams["embed"]) else None
  dbytes = jnp.dtype(dtype).itemsize
  qc = quant.QuantConfig.parse(weights)
  qbytes = None if qc is None else 1
  head_bytes = 1 if (qc is not None and qc.lm_head) else None
  L, Tc, W = grid.block_len, grid.canvas_len, grid.window
  rows = []
  steps = {}
  for kind, (f, args) in step_programs(cfg, gcfg, lay, prog, dtype=dtype, table=table, target=target).items():
    compiled, _ = target.compile(f, *target.abstract(args))
    text = compiled_text(compiled)
    cost, mod = ModuleCost(text).total(), realistic.Module(text)
    steps[kind] = realistic.forward_time(cost, mod, charges)
    for case, ch in ends.items():
      steps[(kind, case)] = realistic.forward_time(cost, mod, ch)
  for kind, (f, args) in forward_programs(cfg, gcfg, lay, prog, abstract_dtype=dtype, cache_out=True).items():
    # A cached forward takes the cache donated and returns it, as the engine's loop carries it: its K/V
    # writes are then in place (argument 2 of f(params, inputs, cache, ...)).
    donate = (2,) if kind.startswith("cached") or kind == "cross" else ()
    # The engine's compile options, as its loop compiles these forwards.
    compiled, compile_s = target.compile(f, aparams, *target.abstract(args), donate=donate,
                                         options=loop.compiler_options(target.backend))
    text = compiled_text(compiled)
    mc = ModuleCost(text)
    cost = mc.total()
    mod = realistic.Module(text)
    real = realistic.forward_time(cost, mod, charges)
    # Block diffusion's prefill decodes nothing; its cross-block forward decodes the block as a cached one does.
    step_kind = "cached" if kind.startswith("cached") or kind == "cross" else "refresh"
    none = {"realistic_s": 0.0, "kernels": 0}
    step = none if kind == "prefill" else steps[step_kind]
    cases = {case: {"realistic_ms": 1e3 * realistic.forward_time(cost, mod, ch)["realistic_s"],
                    "step_ms": 0.0 if kind == "prefill" else 1e3 * steps[(step_kind, case)]["realistic_s"]}
             for case, ch in ends.items()}
    tokens = {"full": Tc, "prefill": grid.prefill_len, "cross": 2 * L}.get(
        kind, int(kind.split("@")[1]) if "@" in kind else W)
    kv_len = 0 if kind in ("full", "prefill") else Tc
    floor = bytes_per_forward(cfg, dtype_bytes=dbytes, batch=batch, tokens=tokens, kv_len=kv_len, logits_tokens=L,
                              quant_bytes=qbytes, head_bytes=head_bytes)
    # A slice's rows are per chip: its share of the floor, the model's split evenly over the chips.
    floor_bytes = (floor["total"] + batch * L * cfg.vocab_size * 4) / target.n_chips  # + fp32 logits written
    routed = flops_per_forward(cfg, batch=batch, tokens=tokens, kv_len=Tc, logits_tokens=L) / target.n_chips
    slice_mesh = sharding.use_mesh(target.mesh) if target.n_chips > 1 else contextlib.nullcontext()
    with moe.target_backend(target.backend), moe.partitioned(target.n_chips > 1), slice_mesh:
      impl = moe.choose_impl(cfg, batch * tokens) if cfg.n_moe_layers else "n/a"
      if impl == "grouped":  # model/grouped_gemm.py; block-scaled 8-bit experts go to the ragged path
        impl = "ragged" if (qc is not None and qc.scales == "block") else "grouped/pallas-triton"
      if impl == "ragged":
        impl += "/tokamax" if (target.kind == "cuda" and moe.has_gpu_grouped_gemm()) else "/xla"
    rows.append({
        "preset": preset_name, "target": target.kind, "chip": target.chip_name, "batch": batch, "cache": cache,
        "weights": weights, "kind": "refresh" if (kind == "full" and cache != "none") else kind, "tokens": tokens, "kv_len": kv_len,
        "moe_impl": impl, "flops": cost["flops"], "bytes": cost["bytes"], **memory(compiled),
        "floor_bytes": floor_bytes, "bytes_over_floor": cost["bytes"] / floor_bytes, "routed_flops": routed,
        "flops_over_routed": cost["flops"] / routed, "roofline_ms": 1e3 * roofline_s(target.chip, cost["flops"], cost["bytes"]),
        "floor_ms": 1e3 * roofline_s(target.chip, routed, floor_bytes), "unknown_trip_loops": mc.unknown_trip_loops,
        "host_ops": mc.host_ops, "kernel_calls": mc.kernel_calls, "compile_s": compile_s, "setting": setting,
        **({"compiler_optimal_ms": opt} if (opt := compiler_optimal_ms(compiled)) is not None else {}),
        "realistic_ms": 1e3 * real["realistic_s"], "step_ms": 1e3 * step["realistic_s"],
        "step_kernels": step["kernels"], **{k: v for k, v in real.items() if k != "realistic_s"}, "cases": cases,
    })
  # Block diffusion is predicted from its forwards: the generate program's iteration costing (loop_costs)
  # reads the masked-diffusion loop's shape (refresh entry, cached steps).
  if with_generate and not prog.cache.block_diffusion:
    args = (jnp.asarray(lay.canvas), jnp.asarray(lay.valid), jnp.asarray(lay.positions), jax.random.PRNGKey(0))
    # The engine's own compile options for the target (loop.compiler_options: on GPU the device-driven loop).
    options = loop.compiler_options(target.backend)
    # The setting's knob values compiled in (the bench's figures have always been of that program).
    run = functools.partial(loop.run, prog, knobs=Knobs.of(gcfg))
    compiled, compile_s = target.compile(run, aparams, *target.abstract(args), donate=(1,), options=options)
    text = compiled_text(compiled)
    mc = ModuleCost(text)
    syncs = realistic.host_syncs(realistic.Module(text))
    # Smoothing's full forwards take the LM head over one of a few widths per block (engine.loop): the block
    # entry's, and without a cache every step's.
    shares = {}
    if gcfg.smoothing:
      G = Tc - grid.first_block
      shares["entry"] = shares["step"] = iteration.block_shares(iteration.tail_widths(G, L), G, L)
    # With WHILE and CONDITIONAL command buffers XLA runs the loops and conditionals as CUDA-graph conditional
    # nodes (captured when the executable loads on a GPU: a deviceless compile cannot show it), unless the loop
    # calls the host.
    commands = set(options.get("xla_gpu_enable_command_buffer", "").split(","))
    # A TPU runs a program's loops and conditionals on the chip (its scalar unit): no host read per step.
    device_loop = (target.kind == "tpu" or {"WHILE", "CONDITIONAL"} <= commands) and mc.host_ops == 0
    rows.append({"preset": preset_name, "target": target.kind, "chip": target.chip_name, "batch": batch,
                 "cache": cache, "weights": weights, "kind": "generate", "tokens": Tc, **memory(compiled), "host_ops": mc.host_ops,
                 "while_loops": sum(len(mc._loops(c)) for c in mc.comps), "compile_s": compile_s, "setting": setting,
                 "device_loop": device_loop, "host_syncs_per_step": 0 if device_loop else syncs.per_step,
                 "host_syncs_per_block": 0 if device_loop else syncs.per_block,
                 "host_driven_syncs_per_step": syncs.per_step, "host_driven_syncs_per_block": syncs.per_block,
                 "host_driven_syncs_per_step_max": syncs.per_step_max, **loop_costs(text, charges, shares),
                 "cases": {case: loop_costs(text, ch, shares) for case, ch in ends.items()}})
  return rows


def as_case(rows: list[dict[str, Any]], case: str) -> list[dict[str, Any]]:
  """The rows with their realistic figures taken from charges `case` (a range's end kept under "cases")."""
  return [dict(r, **r["cases"][case]) for r in rows]


def loop_costs(text: str, charges: realistic.Charges,
               shares: dict[str, tuple[float, ...]] | None = None) -> dict[str, Any]:
  """The generate program's own iterations, costed where they run (realistic.loop_parts): the block-entry
  iteration (refresh forward + decoder + smoothing, as the block body runs it), one step of the step loop and
  the block body's own bookkeeping. These see what composing separately compiled forwards cannot: work the
  loop adds or fails to drop around the forward (the dead soft embedding of engine.loop's fix), copies
  between the loop carries, fusion across the forward's edge. Empty without a data-dependent block loop.

  shares: for a part ("entry", "step") whose iteration runs a conditional chosen once per block (smoothing's
  LM head over the rows from the block on, in bucketed widths: engine.loop), how often each branch runs
  (iteration.block_shares); that part is costed as each branch runs it, weighted by those shares, and a step
  loop whose only conditional is such a choice is one iteration of a known kind (loop_step_fixed)."""
  shares = shares or {}
  mod = realistic.Module(text)
  parts = realistic.loop_parts(mod)
  if parts is None or parts.step is None:
    return {}
  out: dict[str, Any] = {"loop_step_fixed": parts.step_fixed}

  def cost(t: str, comp: str) -> dict[str, Any]:
    sub = realistic.subprogram(t, comp)
    return realistic.forward_time(ModuleCost(sub).total(), realistic.Module(sub), charges)

  for name, comp in (("entry", parts.entry), ("step", parts.step)):
    if comp is None:
      continue
    conds = realistic.conditionals(mod, comp)
    if name == "step" and (name not in shares or not conds):
      conds = []  # a step that picks its forward per iteration: loop_step_fixed says it is not of one kind
    if not conds:
      runs = [(1.0, cost(text, comp))]
    else:
      w = shares.get(name)
      if len(conds) > 1 or w is None or len(w) != len(conds[0][1]):
        raise ValueError(f"loop_costs: the {name} runs conditionals {[(c, len(b)) for c, b in conds]} "
                         f"(name, branches); shares gives {w!r}: one share per branch of one")
      cond, brs = conds[0]
      if name == "step":
        others = [c for c in realistic.reachable(mod, comp) if c != comp and c not in brs and realistic.conditionals(mod, c)]
        out["loop_step_fixed"] = not others
      runs = [(x, cost(realistic.specialize(text, comp, cond, i), comp)) for i, x in enumerate(w)]
      out[f"loop_{name}_branch_ms"] = [1e3 * t["realistic_s"] for _, t in runs]
    out.update({f"loop_{name}_ms": 1e3 * sum(x * t["realistic_s"] for x, t in runs),
                f"loop_{name}_kernels": sum(x * t["kernels"] for x, t in runs),
                f"loop_{name}_bytes": sum(x * t["realistic_bytes"] for x, t in runs),
                f"loop_{name}_flops": sum(x * t["realistic_flops"] for x, t in runs)})
  own = realistic.own_time(mod, parts.block, charges)
  out.update({"loop_block_ms": 1e3 * own["realistic_s"], "loop_block_kernels": own["kernels"]})
  return out


def _generation_s(t: dict[str, float], cache: str, G: int, L: int, tpf: float, per_block_s: float = 0.0) -> float:
  """Seconds of a G-token generation at tpf tokens per forward from per-forward-kind seconds t."""
  forwards = G / tpf
  if cache == "none":
    return forwards * t["full"]
  refreshes = -(-G // L)
  cached = max(forwards - refreshes, 0.0)
  # The cached forwards spread evenly over the blocks; the prefix cache's window shrinks with the block.
  kinds = ["cached"] * refreshes
  if cache == "prefix":
    widths = iteration.prefix_windows(refreshes, L)
    kinds = [cached_kind(widths, widths[int(iteration.prefix_window_index(k * L, widths=widths, gen_end=G))])
             for k in range(refreshes)]
  return refreshes * (t["refresh"] + per_block_s) + sum(cached / refreshes * t[k] for k in kinds)


def _bd_generation_s(t: dict[str, float], G: int, L: int, tpf: float) -> float:
  """Seconds of a G-token block-diffusion generation at tpf tokens per forward (the decode forwards, as
  SGLang and LLaDA2.1's report count them): the prompt's prefill, and per block one cross-block forward (its
  first, when the program has one) and cached forwards for the rest."""
  forwards = G / tpf
  blocks = -(-G // L)
  cross = blocks if "cross" in t else 0
  return t["prefill"] + cross * t.get("cross", 0.0) + max(forwards - cross, 0.0) * t["cached"]


def predict(rows: list[dict[str, Any]], preset_name: str, tpf: float,
            charges: realistic.Charges = realistic.H200) -> list[dict[str, Any]]:
  """Predicted TPS per (batch, cache) at tpf tokens per forward: ideal (the forwards' roofline times at spec
  peaks), floor (the byte/FLOP floors) and realistic: the generate program's own iterations (loop_costs) where
  its rows have them and each step is of one kind, else composed from each forward's realistic time + the
  iteration's work outside it (kept beside it as composed_realistic_*); both + the host syncs as compiled."""
  preset = presets.get(preset_name)
  G, L = preset.gen_length, preset.block_length
  out = []
  keys = sorted({(r["batch"], r["cache"], r.get("weights", "bf16")) for r in rows if r["kind"] != "generate"})
  for batch, cache, weights in keys:
    mine = [r for r in rows if (r["batch"], r["cache"], r.get("weights", "bf16")) == (batch, cache, weights)]
    fwd = [r for r in mine if r["kind"] != "generate"]
    gen = [r for r in mine if r["kind"] == "generate"]
    per_step = gen[0]["host_syncs_per_step"] if gen else None
    per_block = gen[0]["host_syncs_per_block"] if gen else None
    sync_s = 1e-6 * charges.sync_us
    if "prefill" in {r["kind"] for r in fwd}:  # block diffusion
      kinds = {r["kind"]: r for r in fwd}
      gen_s = _bd_generation_s({k: r["roofline_ms"] / 1e3 for k, r in kinds.items()}, G, L, tpf)
      floor_s = _bd_generation_s({k: r["floor_ms"] / 1e3 for k, r in kinds.items()}, G, L, tpf)
      real_s = _bd_generation_s({k: (r["realistic_ms"] + r["step_ms"]) / 1e3 for k, r in kinds.items()}, G, L, tpf)
      out.append({"batch": batch, "cache": cache, "weights": weights, "tpf": tpf, "generate_ms": 1e3 * gen_s,
                  "predicted_tps_per_seq": G / gen_s, "predicted_tps_aggregate": batch * G / gen_s,
                  "floor_tps_per_seq": G / floor_s, "realistic_generate_ms": 1e3 * real_s,
                  "realistic_tps_per_seq": G / real_s, "realistic_tps_aggregate": batch * G / real_s,
                  "realistic_source": "composed forwards", "composed_realistic_tps_per_seq": G / real_s,
                  "composed_realistic_tps_aggregate": batch * G / real_s,
                  "host_syncs_per_step": None, "host_syncs_per_block": None})
      continue
    gen_s = _generation_s({r["kind"]: r["roofline_ms"] / 1e3 for r in fwd}, cache, G, L, tpf)
    floor_s = _generation_s({r["kind"]: r["floor_ms"] / 1e3 for r in fwd}, cache, G, L, tpf)
    composed = {r["kind"]: (r["realistic_ms"] + r["step_ms"]) / 1e3 + (per_step or 0) * sync_s for r in fwd}
    composed_s = _generation_s(composed, cache, G, L, tpf, per_block_s=(per_block or 0) * sync_s)
    real_s, source = composed_s, "composed forwards"
    g = gen[0] if gen else {}
    # The generate program's own iterations where each is of one known kind (dual, prefix without windows,
    # no cache): the program that runs, not the sum of programs that do not.
    if g.get("loop_step_fixed") and (cache == "none" or "loop_entry_ms" in g):
      step_s = g["loop_step_ms"] / 1e3 + (per_step or 0) * sync_s
      t = {k: step_s for k in composed}
      if cache != "none":
        t["refresh"] = g["loop_entry_ms"] / 1e3 + (per_step or 0) * sync_s
      real_s = _generation_s(t, cache, G, L, tpf, per_block_s=g["loop_block_ms"] / 1e3 + (per_block or 0) * sync_s)
      source = "generate program"
    out.append({"batch": batch, "cache": cache, "weights": weights, "tpf": tpf, "generate_ms": 1e3 * gen_s,
                "predicted_tps_per_seq": G / gen_s, "predicted_tps_aggregate": batch * G / gen_s,
                "floor_tps_per_seq": G / floor_s, "realistic_generate_ms": 1e3 * real_s,
                "realistic_tps_per_seq": G / real_s, "realistic_tps_aggregate": batch * G / real_s,
                "realistic_source": source, "composed_realistic_tps_per_seq": G / composed_s,
                "composed_realistic_tps_aggregate": batch * G / composed_s,
                "host_syncs_per_step": per_step, "host_syncs_per_block": per_block})
  return out


def run(preset_name: str, chips: list[str], batches: list[int], caches: list[str], target_kind: str,
        tpf: float | None = None, with_generate: bool = True, progress=print, setting: str = "dinfer",
        weights: tuple[str, ...] = ("bf16",), mesh: dict[str, int] | None = None) -> dict[str, Any]:
  """tpf: tokens per forward of the prediction; None takes the compiled setting's known figure (SETTINGS).
  chips: keys of ALL_CHIPS, or TPU slices as "v6e-4" (parse_chip), laid out as `mesh` (default tensor=N).
  weights: the weight formats compiled ("bf16", "int8", "fp8", "int8-block", "fp8-block"); the summary fields
  are the first one's, and each 8-bit one's batch-1 figures get their own (..._fp8) beside bf16's."""
  if tpf is None:
    tpf = SETTINGS.get(setting)
    if tpf is None:
      raise ValueError(f"--setting {setting}: no known tokens-per-forward figure for it; give --tpf")
  rows, predictions, label, targets, unfit = [], [], "", {}, []
  for spec in chips:
    key, n = parse_chip(spec)
    kind = "tpu" if key in hardware.TPUS else target_kind
    target = targets[spec] = Target(kind, ALL_CHIPS[key], (mesh or {"tensor": n}) if n > 1 else None)
    if target.n_chips != n:
      raise ValueError(f"--mesh {mesh}: {target.n_chips} chips for --chips {spec}")
    label = target.label if kind == "cpu" else f"deviceless {kind.upper()} compile"
    chip_rows = []
    for w in weights:
      for cache in caches:
        for b in batches:
          try:
            new = forward_rows(target, preset_name, b, cache, with_generate=with_generate, setting=setting,
                               weights=w, charges=target.charges(), ends={c: target.charges(c) for c in ("slow", "fast")})
          except Exception as e:  # noqa: BLE001 - XLA's error type differs across jaxlib versions
            if not overflows(e):
              raise
            # XLA TPU refuses a program that overflows HBM: that is the answer for this chip and batch.
            unfit.append({"chip": target.chip_name, "batch": b, "cache": cache, "weights": w,
                          "error": str(e).strip().splitlines()[0][:400]})
            if progress:
              progress(_unfit_line(unfit[-1]))
            continue
          for r in new:
            if progress:
              progress(_line(r))
            if (u := over_memory(r, target)) is not None:
              unfit.append(u)
              if progress:
                progress(_unfit_line(u))
          chip_rows += new
    rows += chip_rows
    # The range: the same prediction with every charge at its slow end, and at its fast end.
    slow, fast = (predict(as_case(chip_rows, case), preset_name, tpf, target.charges(case)) for case in ("slow", "fast"))
    over = {(u["batch"], u["cache"], u["weights"]) for u in unfit if u["chip"] == target.chip_name}
    predictions += [dict(p, chip=target.chip_name, fits=(p["batch"], p["cache"], p["weights"]) not in over,
                         realistic_tps_per_seq_range=[lo["realistic_tps_per_seq"], hi["realistic_tps_per_seq"]],
                         realistic_tps_aggregate_range=[lo["realistic_tps_aggregate"], hi["realistic_tps_aggregate"]])
                    for p, lo, hi in zip(predict(chip_rows, preset_name, tpf, target.charges()), slow, fast)]
  out: dict[str, Any] = {"preset": preset_name, "target": targets[chips[0]].kind, "label": label, "setting": setting,
                         "charges": {c: dataclasses.asdict(t.charges()) for c, t in targets.items()},
                         "charge_ranges": {c: {case: dataclasses.asdict(t.charges(case)) for case in ("slow", "fast")}
                                           for c, t in targets.items()},
                         "tpf": tpf, "rows": rows, "predictions": predictions, "does_not_fit": unfit, "jax": jax.__version__,
                         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
  out.update(summary(rows, predictions, targets[chips[0]].chip_name, weights))
  first = targets[chips[0]]
  out["memory_fit"] = memory_fit([r for r in rows if r["chip"] == first.chip_name and r["cache"] == "dual"
                                  and r.get("weights", "bf16") == weights[0]], first.chip.memory_bytes)
  return out


def overflows(e: BaseException) -> bool:
  """Whether a compile failed for want of device memory (XLA: RESOURCE_EXHAUSTED, 'out of memory')."""
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def footprint(row: dict[str, Any]) -> int:
  """A compiled program's HBM per chip by its memory_analysis: arguments + temporaries + outputs."""
  return row["argument_bytes"] + row["temp_bytes"] + row["output_bytes"]


def over_memory(row: dict[str, Any], target: Target) -> dict[str, Any] | None:
  """A does_not_fit entry for a generate program that compiled but whose arguments, temporaries and outputs
  together exceed the chip's HBM: XLA TPU's compile-time check measures them apart (a v5e's batch-8 int8
  program compiled with 8.0 GB of weights and 9.4 GB of temporaries, 17.5 GB on a chip that holds 16.9)."""
  if row["kind"] != "generate" or "temp_bytes" not in row:
    return None
  need = footprint(row)
  if need <= target.chip.memory_bytes:
    return None
  return {"chip": row["chip"], "batch": row["batch"], "cache": row["cache"], "weights": row.get("weights", "bf16"),
          "error": f"compiles, but needs {need / 1e9:.2f} GB per chip (arguments {row['argument_bytes'] / 1e9:.2f}, "
                   f"temporaries {row['temp_bytes'] / 1e9:.2f}) of {target.chip.memory_bytes / 1e9:.2f}"}


def memory_fit(rows: list[dict[str, Any]], hbm_bytes: int) -> dict[str, Any]:
  """What fits in one chip's HBM, from the generate program's memory_analysis (arguments + temporaries +
  outputs per chip) at the batches compiled: affine in the batch (the weights once; each row's cache,
  canvas and logits), so two batches give its slope. The largest batch is where the line meets the HBM; the
  largest canvas at batch 1 takes each row's bytes as proportional to its canvas (cache, activations and
  logits all are, to first order). An estimate: compile at the batch it gives to know (XLA TPU refuses a
  program whose temporaries overflow HBM; over_memory reports one whose whole footprint does)."""
  gen = sorted((r for r in rows if r["kind"] == "generate"), key=lambda r: r["batch"])
  out: dict[str, Any] = {"hbm_bytes_per_chip": hbm_bytes}
  use = {r["batch"]: footprint(r) for r in gen}
  if 1 in use:
    out["memory_per_chip_batch1_bytes"] = use[1]
  if len(use) >= 2:
    (b1, u1), (b2, u2) = sorted(use.items())[0], sorted(use.items())[-1]
    per_row = (u2 - u1) / (b2 - b1)
    fixed = u1 - b1 * per_row
    out["memory_per_row_bytes"], out["memory_fixed_bytes"] = per_row, fixed
    out["max_batch_per_chip"] = int((hbm_bytes - fixed) // per_row) if per_row > 0 else None
    out["max_canvas_batch1"] = int(gen[0]["tokens"] * (hbm_bytes - fixed) / per_row) if per_row > 0 else None
  return out


def summary(rows, predictions, chip: str, weights: tuple[str, ...]) -> dict[str, Any]:
  """The JSON's top-level fields: the default preset's dual-cache figures for the first weight format, and
  for each 8-bit one its batch-1 figures beside bf16's."""
  def pick(items, batch, kind=None, w=weights[0]):
    return [x for x in items if x["chip"] == chip and x["batch"] == batch and x["cache"] == "dual"
            and x.get("weights", "bf16") == w and (kind is None or x["kind"] == kind)]
  out: dict[str, Any] = {}
  p1, c1, p8, g1 = pick(predictions, 1), pick(rows, 1, "cached"), pick(predictions, 8), pick(rows, 1, "generate")
  out["predicted_tps_batch1"] = p1[0]["predicted_tps_per_seq"] if p1 else None
  out["cached_bytes_over_floor_batch1"] = c1[0]["bytes_over_floor"] if c1 else None
  out["realistic_tps_batch1"] = p1[0]["realistic_tps_per_seq"] if p1 else None
  out["realistic_tps_batch8_aggregate"] = p8[0]["realistic_tps_aggregate"] if p8 else None
  # [slow end, fast end] of the charges (bench.realistic.RANGES): the central figure lies between.
  out["realistic_tps_batch1_range"] = p1[0].get("realistic_tps_per_seq_range") if p1 else None
  out["realistic_tps_batch8_aggregate_range"] = p8[0].get("realistic_tps_aggregate_range") if p8 else None
  # The figure composed from separately compiled forwards (what realistic_tps_* were before the generate
  # program's own iterations were costed), for comparison across runs.
  out["composed_realistic_tps_batch1"] = p1[0].get("composed_realistic_tps_per_seq") if p1 else None
  out["composed_realistic_tps_batch8_aggregate"] = p8[0].get("composed_realistic_tps_aggregate") if p8 else None
  out["kernels_per_cached_forward_batch1"] = c1[0]["kernels"] if c1 else None
  out["host_syncs_per_step"] = g1[0]["host_syncs_per_step"] if g1 else None
  for w in weights:
    if quant.QuantConfig.parse(w) is None:
      continue
    tag = quant.format_tag(w)
    q1, qc1 = pick(predictions, 1, w=w), pick(rows, 1, "cached", w=w)
    b1 = pick(rows, 1, "cached", w="bf16")
    out[f"cached_bytes_{tag}_over_bf16_batch1"] = qc1[0]["bytes"] / b1[0]["bytes"] if qc1 and b1 else None
    out[f"predicted_tps_batch1_{tag}"] = q1[0]["predicted_tps_per_seq"] if q1 else None
    out[f"realistic_tps_batch1_{tag}"] = q1[0]["realistic_tps_per_seq"] if q1 else None
    out[f"realistic_tps_batch1_{tag}_range"] = q1[0].get("realistic_tps_per_seq_range") if q1 else None
    q8 = pick(predictions, 8, w=w)
    out[f"realistic_tps_batch8_aggregate_{tag}"] = q8[0]["realistic_tps_aggregate"] if q8 else None
    out[f"dequantized_copy_bytes_{tag}"] = sum(r["dequantized_copy_bytes"] for r in rows
                                               if r.get("weights") == w and r["kind"] != "generate")
  return out


def _unfit_line(u: dict[str, Any]) -> str:
  return f"{u['chip']} b{u['batch']} {u['cache']} {u['weights']}: does not fit ({u['error']})"


def _line(r: dict[str, Any]) -> str:
  if r["kind"] == "generate":
    return (f"{r['chip']} b{r['batch']} {r['cache']} {r.get('weights', 'bf16')} generate: temp {r['temp_bytes'] / 1e9:.2f} GB, "
            f"host ops {r['host_ops']}, host syncs {r['host_syncs_per_step']} per step + {r['host_syncs_per_block']} "
            f"per block (device loop {r['device_loop']}; host-driven {r['host_driven_syncs_per_step']} + "
            f"{r['host_driven_syncs_per_block']}), compile {r['compile_s']:.1f} s")
  return (f"{r['chip']} b{r['batch']} {r['cache']} {r.get('weights', 'bf16')} {r['kind']} ({r['moe_impl']}): {r['flops'] / 1e12:.2f} TFLOP, "
          f"{r['bytes'] / 1e9:.2f} GB (floor {r['floor_bytes'] / 1e9:.2f}, x{r['bytes_over_floor']:.2f}), "
          f"{r['roofline_ms']:.2f} ms ideal, {r['realistic_ms']:.2f} ms realistic ({r['kernels']} kernels) + "
          f"{r['step_ms']:.2f} ms outside the forward, temp {r['temp_bytes'] / 1e9:.2f} GB, compile {r['compile_s']:.1f} s")


def markdown(res: dict[str, Any]) -> str:
  lines = [f"{res['preset']}, {res['label']}, jax {res['jax']}, {res['date']}", "",
           "| chip | batch | cache | weights | forward | MoE | TFLOP | routed TFLOP | GB | floor GB | bytes/floor | temp GB "
           "| roofline ms | floor ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    if r["kind"] == "generate":
      continue
    lines.append(f"| {r['chip']} | {r['batch']} | {r['cache']} | {r.get('weights', 'bf16')} | {r['kind']} | {r['moe_impl']} | {r['flops'] / 1e12:.3f} "
                 f"| {r['routed_flops'] / 1e12:.3f} | {r['bytes'] / 1e9:.2f} | {r['floor_bytes'] / 1e9:.2f} "
                 f"| {r['bytes_over_floor']:.2f} | {r['temp_bytes'] / 1e9:.3f} | {r['roofline_ms']:.2f} | {r['floor_ms']:.2f} |")
  lines += ["", "Realistic (each kernel at its class's share of the achievable peaks, kernel floors, grouped GEMM tiles as "
            "the router spreads rows, gather at its rows; bench.realistic):", "",
            "| chip | batch | cache | weights | forward | kernels (in CUDA graphs / separate) | GB | TFLOP "
            "| grouped GEMM pad TFLOP | kernel floors ms | empty grid ms | realistic ms | outside the forward ms (kernels) "
            "| dequantised copies GB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    if r["kind"] == "generate":
      continue
    lines.append(f"| {r['chip']} | {r['batch']} | {r['cache']} | {r.get('weights', 'bf16')} | {r['kind']} "
                 f"| {r['kernels']} ({r['kernels_in_graphs']} / "
                 f"{r['separate_launches']}) | {r['realistic_bytes'] / 1e9:.2f} | {r['realistic_flops'] / 1e12:.3f} "
                 f"| {r['grouped_gemm_pad_flops'] / 1e12:.3f} | {r['kernel_overhead_s'] * 1e3:.2f} "
                 f"| {r['grouped_gemm_empty_s'] * 1e3:.2f} | {r['realistic_ms']:.2f} | {r['step_ms']:.2f} ({r['step_kernels']}) "
                 f"| {r.get('dequantized_copy_bytes', 0) / 1e9:.2f} |")
  lines += ["", "| chip | batch | cache | weights | generate program temp GB | host transfers | device loop | host syncs per step "
            "/ per block | host-driven: per step / per block | block entry ms (kernels) | step ms (kernels) "
            "| block own ms (kernels) | compile s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

  def part(r, name):
    return f"{r[f'loop_{name}_ms']:.2f} ({r[f'loop_{name}_kernels']})" if f"loop_{name}_ms" in r else "-"
  for r in res["rows"]:
    if r["kind"] == "generate":
      lines.append(f"| {r['chip']} | {r['batch']} | {r['cache']} | {r.get('weights', 'bf16')} | {r['temp_bytes'] / 1e9:.3f} "
                   f"| {r['host_ops']} "
                   f"| {r['device_loop']} | {r['host_syncs_per_step']} / {r['host_syncs_per_block']} "
                   f"| {r['host_driven_syncs_per_step']} / {r['host_driven_syncs_per_block']} | {part(r, 'entry')} "
                   f"| {part(r, 'step')} | {part(r, 'block')} | {r['compile_s']:.1f} |")
  lines += ["", f"Setting {res['setting']}, TPF {res['tpf']}:", "",
            "| chip | batch | cache | weights | ideal TPS per seq | ideal aggregate | realistic TPS per seq (range) "
            "| realistic aggregate (range) | realistic from | composed per seq / aggregate | floor TPS per seq |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]

  def rng(p, key):
    r = p.get(f"{key}_range")
    return f"{p[key]:.0f} ({r[0]:.0f}-{r[1]:.0f})" if r else f"{p[key]:.0f}"
  for p in res["predictions"]:
    over = "" if p.get("fits", True) else " (over HBM)"
    lines.append(f"| {p['chip']} | {p['batch']}{over} | {p['cache']} | {p.get('weights', 'bf16')} "
                 f"| {p['predicted_tps_per_seq']:.0f} "
                 f"| {p['predicted_tps_aggregate']:.0f} | {rng(p, 'realistic_tps_per_seq')} "
                 f"| {rng(p, 'realistic_tps_aggregate')} | {p.get('realistic_source', 'composed forwards')} "
                 f"| {p.get('composed_realistic_tps_per_seq', p['realistic_tps_per_seq']):.0f} / "
                 f"{p.get('composed_realistic_tps_aggregate', p['realistic_tps_aggregate']):.0f} "
                 f"| {p['floor_tps_per_seq']:.0f} |")
  lines += [f"- {_unfit_line(u)}" for u in res.get("does_not_fit", [])]
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  ap.add_argument("--preset", default="llada_moe_7b_a1b", choices=sorted(presets.PRESETS))
  ap.add_argument("--chips", default="h200", help=f"comma list of {', '.join(ALL_CHIPS)} (TPUs: a deviceless TPU "
                  "compile, with libtpu: pip install -e '.[tpu]'; a TPU slice as v6e-4)")
  ap.add_argument("--mesh", default=None, metavar="tensor=T,expert=E",
                  help="a TPU slice's layout (default: tensor over all its chips); rows are per chip")
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--caches", default="dual", help="comma list of none, prefix, dual")
  ap.add_argument("--target", default=None, choices=["cuda", "cpu"],
                  help="default: cuda when the CUDA plugin is installed, else cpu")
  ap.add_argument("--setting", default="dinfer", choices=sorted(SETTINGS),
                  help="decoder settings compiled: dinfer = threshold 0.8 + smoothing + vicinity (TPF 3.87), "
                       "threshold = plain threshold 0.8 (needs --tpf), editing = LLaDA2.1's JointThreshold S "
                       "mode (TPF 5.93)")
  ap.add_argument("--tpf", type=float, default=None,
                  help="tokens per forward for the predicted TPS (default: the setting's known figure)")
  ap.add_argument("--weights", default="bf16",
                  help="comma list of weight formats: bf16, int8, fp8 (per-channel scales), int8-block, fp8-block "
                       "(128x128 blocks); 8-bit ones add ..._fp8 summary fields beside bf16's")
  ap.add_argument("--no-generate", action="store_true", help="skip compiling the whole generate program")
  ap.add_argument("--json", dest="json_out", default=None)
  args = ap.parse_args(argv)
  chips = [c.strip() for c in args.chips.split(",") if c.strip()]
  try:
    for c in chips:
      parse_chip(c)
    mesh = sharding.parse_mesh(args.mesh) if args.mesh else None
  except ValueError as e:
    raise SystemExit(str(e)) from None
  try:
    batches = [int(b) for b in args.batches.split(",")]
  except ValueError:
    raise SystemExit(f"--batches {args.batches!r}: expected a comma list of positive ints") from None
  if any(b <= 0 for b in batches):
    raise SystemExit(f"--batches {args.batches!r}: expected a comma list of positive ints")
  caches = [c.strip() for c in args.caches.split(",") if c.strip()]
  bad = [c for c in caches if c not in ("none", "prefix", "dual")]
  if bad:
    raise SystemExit(f"--caches: unknown {bad}; choose from none, prefix, dual")
  weights = tuple(w.strip() for w in args.weights.split(",") if w.strip())
  bad = [w for w in weights if w != "bf16" and not is_quantize_spec(w)]
  if bad or not weights:
    raise SystemExit(f"--weights: unknown {bad}; choose from bf16, {', '.join(QUANTIZE_CHOICES)} (per-channel "
                     "ones with +head, +embed, +a8 or +a8:N)")
  target = args.target or ("cuda" if cuda_plugin_available() else "cpu")
  try:
    res = run(args.preset, chips, batches, caches, target, args.tpf, with_generate=not args.no_generate,
              setting=args.setting, weights=weights, mesh=mesh)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  res["command"] = "python -m dinfer_jax.bench.roofline " + " ".join(argv if argv is not None else sys.argv[1:])
  print(markdown(res))
  print(f"\npredicted_tps_batch1: {res['predicted_tps_batch1']}")
  for key in ("cached_bytes_over_floor_batch1", "realistic_tps_batch1", "realistic_tps_batch1_range",
              "realistic_tps_batch8_aggregate", "realistic_tps_batch8_aggregate_range", "composed_realistic_tps_batch1", "composed_realistic_tps_batch8_aggregate",
              "kernels_per_cached_forward_batch1", "host_syncs_per_step"):
    print(f"{key}: {res[key]}")
  tags = ["_" + quant.format_tag(w) for w in weights if w != "bf16"]
  for key in sorted(k for k in res if any(k.endswith(t) or f"{t}_over" in k for t in tags)):
    print(f"{key}: {res[key]}")
  if args.json_out:
    path = pathlib.Path(args.json_out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)
  return 0


if __name__ == "__main__":
  if "JAX_PLATFORMS" not in os.environ:
    # The deviceless compile needs no GPU; never grab one that happens to be there.
    jax.config.update("jax_platforms", "cpu")
  sys.exit(main())
