"""Mixture of experts: the two routers, two dropless expert kernels and a plain loop reference.

Kernels (chosen by `moe_impl`, "auto" picks per backend and token count, see `choose_impl`):
- "dense": every expert on every token, weighted by the (mostly zero) routing matrix. E/k times the FLOPs,
  but batched GEMMs that read each expert's weights in place. At small token counts a MoE forward is bound
  by reading expert weights anyway (a 64-token block at batch 1 touches all 64 experts of LLaDA-MoE), so
  the wasted FLOPs are free up to the roofline's ridge point.
- "ragged": sort the (token, expert) pairs by expert and run a grouped matmul: FLOPs are exactly the routed
  ones. On GPU the grouped matmul is tokamax's Pallas-Triton kernel; XLA's own `jax.lax.ragged_dot` is
  lowered there by zero-padding to a dense GEMM over all experts (E x the routed FLOPs, worse than "dense";
  roofline bench), so without tokamax "auto" never picks ragged on GPU. Elsewhere it is `jax.lax.ragged_dot`.
`moe_loop_reference` loops over experts in Python; tests compare both kernels against it.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import math
import warnings

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import PartitionSpec as P

from dinfer_jax import hardware, sharding
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import grouped_gemm, grouped_gemm_tpu, quant
from dinfer_jax.model.layers import rms_normalize, swiglu

# Token count above which "auto" switches from the dense kernel to ragged_dot on an accelerator other than a
# GPU (on GPU "auto" is the grouped kernel of model/grouped_gemm.py at every token count). The dense
# kernel does T*E expert-FLOPs against E expert weights, i.e. about T FLOPs per weight byte in bf16; an
# H200 (990 TFLOP/s, 4.8 TB/s) is bound by weight reads below ~200 FLOPs/byte, so dense is free up to
# about that many tokens (roofline bench: a batch-1 64-token block is at 1.1x the weight floor with dense).
# On CPU ragged_dot is far slower than a batched einsum (BENCHMARKS.md: measured 2.4-6x), so CPU always
# uses dense.
ACCEL_DENSE_MAX_TOKENS = 128
# A TPU slice split by tensor: every chip runs every routed row (k copies of each token's activations) on
# its share of each expert's FFN, so past some token count the rows' traffic outweighs the dense kernel's
# FLOPs. Compiled deviceless for v6e x4 (tensor=4, 7B-A1B, bf16; bench.roofline): the batch-8 cached window
# (768 tokens) 4.96 ms ragged against 6.29 dense; the batch-1 refresh (1280 tokens) 7.61 against 5.72; the
# batch-8 refresh (10240) 69 against 47.
SLICE_RAGGED_MAX_TOKENS = 1024
# On TPU the ragged path's grouped matmul: XLA TPU's ragged_dot, or with TPU_GROUPED_GEMM this project's
# Pallas-Mosaic kernel (model/grouped_gemm_tpu.py) where it takes the weights (plain, 128-aligned). Both walk
# the same (row tile, group) work items; compiled deviceless for a v6e (7B-A1B gate/up shapes, K 2048, N
# 1024, 64 experts) XLA TPU's own cost model puts ragged_dot ahead: 0.20 against 0.23 ms at the batch-1
# refresh's 10240 rows, 0.47 against 0.68 ms at batch 8's 81920 (ours pads x to its tile and masks rows past
# the groups in extra passes). So ragged_dot, until the Mosaic kernel wins a compiled comparison.
TPU_GROUPED_GEMM = False


@functools.lru_cache(maxsize=None)
def has_gpu_grouped_gemm() -> bool:
  """tokamax (the `cuda12` extra) provides the GPU grouped GEMM. Installed but not importable (a jax it was
  not built for) counts as absent, with one warning: the MoE then runs the dense kernel on GPU."""
  if importlib.util.find_spec("tokamax") is None:
    return False
  try:
    _tokamax()
  except Exception as e:  # noqa: BLE001  any import-time failure of a third-party kernel library
    warnings.warn(f"tokamax is installed but does not import ({type(e).__name__}: {e}); "
                  "the MoE runs its dense kernel on GPU")
    return False
  return True


def route(h: jax.Array, lp: dict, cfg: ModelConfig, positions: jax.Array | None = None,
          valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Routing, in fp32 whatever the weight dtype (a bf16 router flips near-tied top-k choices).

  Args:
    h: [T, D] normed hidden states (T = all tokens of the batch, flattened).
    lp: one layer's params (router [D, E], optional expert_bias [E]).
    positions, valid: [B, T'] (B * T' = T) the tokens' positions and which are real: block routing's
      blocks (cfg.router "sigmoid_block"); unused by the other routers.
  Returns:
    weights [T, k] fp32 and expert ids [T, k] int32.
  """
  logits = _router_logits(h, lp)
  k = cfg.n_experts_per_tok
  if cfg.router == "softmax":
    # LLaDA-MoE: softmax over all experts, top-k, and no renormalisation (weights sum to < 1).
    w, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    return w, idx.astype(jnp.int32)
  # LLaDA2: sigmoid scores; the bias only steers selection; selection is limited to the best groups (2.0,
  # 2.1), where a group scores the sum of its top-2 biased scores, or to the experts its routing block admits
  # (2.2).
  scores = jax.nn.sigmoid(logits)
  sel = scores + lp["expert_bias"].astype(jnp.float32) if cfg.router_bias else scores
  if cfg.router == "sigmoid_block":
    sel = jnp.where(block_admitted(sel, cfg, positions, valid), sel, -jnp.inf)
    _, idx = jax.lax.top_k(sel, k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    return w / (w.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor, idx.astype(jnp.int32)
  T, E, G = sel.shape[0], cfg.n_experts, cfg.n_groups
  grouped = sel.reshape(T, G, E // G)
  group_score = jax.lax.top_k(grouped, min(2, E // G))[0].sum(-1)  # [T, G]
  _, keep = jax.lax.top_k(group_score, cfg.topk_groups)  # [T, topk_groups]
  group_mask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep].set(True)
  sel = jnp.where(jnp.repeat(group_mask, E // G, axis=1), sel, -jnp.inf)
  _, idx = jax.lax.top_k(sel, k)
  w = jnp.take_along_axis(scores, idx, axis=-1)
  w = w / (w.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
  return w, idx.astype(jnp.int32)


def block_admitted(sel: jax.Array, cfg: ModelConfig, positions: jax.Array, valid: jax.Array | None) -> jax.Array:
  """[T, E] bool: the experts each token's routing block admits (LLaDA2.2). A block is the aligned positions
  [r k, r (k + 1)) of a row (r = cfg.router_block); it admits the expert_capacity experts whose best biased
  score over the block's real tokens is highest (lower expert id on ties). sel [T, E] biased scores of the
  flattened tokens; positions, valid [B, T/B]."""
  B, Tr = positions.shape
  r, E = cfg.router_block, cfg.n_experts
  valid = jnp.ones((B, Tr), bool) if valid is None else valid
  blk = positions // r
  # Block ids relative to the row's first real block: at most Tr // r + 2 blocks in a window of Tr tokens.
  n_blk = Tr // r + 2
  first = jnp.min(jnp.where(valid, blk, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
  rel = jnp.clip(blk - first, 0, n_blk - 1)
  ids = (jnp.arange(B)[:, None] * n_blk + rel).reshape(-1)
  best = jax.ops.segment_max(jnp.where(valid.reshape(-1, 1), sel, -jnp.inf), ids, num_segments=B * n_blk)
  _, keep = jax.lax.top_k(best, cfg.expert_capacity)  # [B * n_blk, capacity]
  admitted = jnp.zeros((B * n_blk, E), bool).at[jnp.arange(B * n_blk)[:, None], keep].set(True)
  return admitted[ids]


def _router_logits(h: jax.Array, lp: dict) -> jax.Array:
  return jnp.einsum("TD,DE->TE", h.astype(jnp.float32), lp["router"].astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("dinfer_jax_target_backend", default=None)


@contextlib.contextmanager
def target_backend(name: str | None):
  """Trace kernel choices for another backend than the one running ("gpu" while compiling deviceless for an
  H200 from a CPU-only process: the roofline bench)."""
  tok = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(tok)


_PARTITIONED: contextvars.ContextVar[bool] = contextvars.ContextVar("dinfer_jax_moe_partitioned", default=False)


@contextlib.contextmanager
def partitioned(on: bool = True):
  """Trace for a program XLA partitions over several devices (the engine on a mesh): Pallas kernels carry no
  partitioning rule (XLA would gather their sharded operands onto every device), so "auto" keeps the dense
  einsums, which partition along the expert and tensor axes."""
  tok = _PARTITIONED.set(on)
  try:
    yield
  finally:
    _PARTITIONED.reset(tok)


def partitioned_now() -> bool:
  """Whether the program being traced is for a mesh (partitioned)."""
  return _PARTITIONED.get()


def backend() -> str:
  """The backend kernel choices are made for: target_backend's, else the default backend."""
  return _TARGET.get() or jax.default_backend()


def choose_impl(cfg: ModelConfig, n_tokens: int) -> str:
  if cfg.moe_impl != "auto":
    return cfg.moe_impl
  if (backend() == "tpu" and _PARTITIONED.get() and ACCEL_DENSE_MAX_TOKENS < n_tokens <= SLICE_RAGGED_MAX_TOKENS
      and _tensor_only_mesh()):
    # A TPU slice split by tensor only: the ragged path under shard_map (experts_ragged), each chip's grouped
    # matmuls on its expert-FFN columns at the routed FLOPs; the dense kernel would run E/k times them.
    return "ragged"
  if backend() == "cpu" or _PARTITIONED.get():
    return "dense"
  if backend() == "gpu":
    # This project's grouped GEMM (model/grouped_gemm.py) at every token count: by the roofline bench's
    # realistic model it costs no more than the dense kernel at 8 tokens and less from 16 up (7B-A1B, one
    # layer: 202 vs 203 us at 8 tokens, 206 vs 224 at 96, 212 vs 274 at 256; BENCHMARKS.md).
    return "grouped"
  if n_tokens <= ACCEL_DENSE_MAX_TOKENS:
    return "dense"
  return "ragged"


def _tokamax():
  # tokamax reads its settings from absl flags, which would otherwise parse this program's sys.argv.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  import tokamax
  return tokamax


# tokamax's Pallas-Triton grouped GEMM tiles each group's rows from the group's own start, over a grid of
# ceil(M / block_m) x ceil(N / block_n) x G blocks: the blocks past a group's rows find nothing and exit (not
# free: about 1 us per wave of the chip's resident blocks), and a group's last tile is padded. Its heuristic
# block_m is 128 whatever the rows per group; grouped_block_m picks the one that costs least on the chip the
# program is for (hardware.current(); the roofline bench's realistic model, rows spread evenly over groups):
# on an H200, 256 at the refreshes (160 rows per expert at batch 1: one tile instead of two; 1280 at batch 8:
# 5 full tiles), half the grid either way.
GROUPED_BLOCK_M = (64, 128, 256)
GROUPED_BLOCK_N = 128


def grouped_tiles(M: int, K: int, N: int, G: int, block_m: int, block_n: int = GROUPED_BLOCK_N,
                  skew: float = grouped_gemm.PLAN_SKEW) -> dict[str, float]:
  """The work of one grouped GEMM x [M, K] by w [G, K, N] with M rows spread over G groups as a router of
  `skew` spreads them (grouped_gemm.expected_tiles): FLOPs of the tiles it runs (each group's rows rounded
  up to block_m), weight tiles read from HBM, grid blocks, and blocks that find rows."""
  e = grouped_gemm.expected_tiles(M, G, block_m, skew)
  col_tiles = math.ceil(N / block_n)
  # Every row tile has a block of its own (the grid's rows), so a group's tiles run side by side and share
  # its weights through L2: one read per group with rows.
  return {"routed_flops": 2.0 * M * K * N, "padded_flops": 2.0 * e["tiles"] * block_m * K * N,
          "weight_tiles": e["busy"], "busy_groups": e["busy"],
          "blocks": math.ceil(M / block_m) * col_tiles * G, "working_blocks": e["tiles"] * col_tiles}


def grouped_time_s(t: dict[str, float], K: int, N: int, chip: hardware.Chip | None = None,
                   weight_bytes: int = 2) -> float:
  """Time of the tiles on `chip` (default hardware.current()): the weight tiles read or the tiles' FLOPs,
  whichever is longer, plus the empty blocks' waves."""
  chip = chip or hardware.current()
  body = max(t["weight_tiles"] * K * N * weight_bytes / chip.copy_bytes_per_s, t["padded_flops"] / chip.gemm_flops)
  return body + chip.empty_wave_s * (t["blocks"] - t["working_blocks"]) / chip.resident_blocks


def grouped_block_m(M: int, K: int, N: int, G: int) -> int:
  """The row tile that costs least for this shape on the target chip (ties: the smaller tile, fewer
  registers)."""
  chip = hardware.current()
  return min(GROUPED_BLOCK_M, key=lambda bm: (grouped_time_s(grouped_tiles(M, K, N, G, bm), K, N, chip), bm))


def _tokamax_op(block_m: int):
  """tokamax's Pallas-Triton ragged dot with our row tile (128x128x32 and 4 warps is its own heuristic; 256
  rows take 8 warps to keep the accumulator in registers). None when this tokamax has no such op/config: its
  own heuristic then runs."""
  try:
    from tokamax._src.ops.ragged_dot import pallas_triton
    cfg = pallas_triton.Config(block_m=block_m, block_n=GROUPED_BLOCK_N, block_k=32,
                               num_warps=8 if block_m >= 256 else 4, num_stages=4)
    return pallas_triton.PallasTritonRaggedDot(config=cfg)
  except (ImportError, AttributeError, TypeError):
    return None


def _grouped_dot(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
  """x [M, K] rows sorted by group, w [G, K, N] (plain or quantised, used in x's dtype), sizes [G] -> [M, N]:
  one GEMM per group's rows."""
  if backend() == "gpu" and has_gpu_grouped_gemm():
    (M, K), (G, _, N) = x.shape, w.shape
    op = _tokamax_op(grouped_block_m(M, K, N, G))
    # A QArray goes in as it is: the Triton kernel loads the 8-bit tiles and scales them in registers.
    return _tokamax().ragged_dot(x, w.astype(x.dtype), sizes, implementation=[op] if op is not None else "triton")
  if backend() == "tpu" and TPU_GROUPED_GEMM and grouped_gemm_tpu.supports(x, w):
    return grouped_gemm_tpu.gmm(x, w, sizes, block_m=grouped_gemm_tpu.block_m_for(x.shape[0], w.shape[0]))
  return quant.ragged_dot(x, w, sizes, eight_bit_operand=backend() == "tpu")


def experts_dense(h: jax.Array, w: jax.Array, idx: jax.Array, ex: dict, n_experts: int) -> jax.Array:
  """Every expert on every token; h [T, D] -> [T, D].

  Written as batched GEMMs over E so each expert's [D, F] kernel is read where it lies ("TD,EDF->TEF" makes
  XLA transpose every layer's weights to [D, E, F] first), with the routing weights folded into the
  activations so the down projection contracts experts and F in one GEMM straight to [T, D] in fp32 (no
  [T, E, D] intermediate; the fp32 weighted sum of MaxText's float32_weight_sum happens in the accumulator).
  """
  dt = h.dtype
  T = h.shape[0]
  combine = jnp.zeros((T, n_experts), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
  hb = jnp.broadcast_to(h, (n_experts,) + h.shape)
  g = quant.einsum("ETD,EDF->ETF", hb, ex["gate"])
  u = quant.einsum("ETD,EDF->ETF", hb, ex["up"])
  a = ((jax.nn.silu(g) * u).astype(jnp.float32) * combine.T[:, :, None]).astype(dt)
  return quant.einsum("ETF,EFD->TD", a, ex["down"], preferred_element_type=jnp.float32).astype(dt)


def experts_ragged(h: jax.Array, w: jax.Array, idx: jax.Array, ex: dict, n_experts: int,
                   dot=None) -> jax.Array:
  """Dropless sort-by-expert + grouped matmul (tokamax's on GPU, this project's Mosaic kernel or XLA's
  ragged_dot on TPU, else XLA's); h [T, D] -> [T, D]. Traced for a mesh (moe.partitioned, a tensor-only
  mesh: choose_impl) it runs per chip under shard_map: each chip's gate/up columns and down rows of every
  expert on all routed rows, the partial outputs summed across "tensor" in h's dtype (as GSPMD sums the dense kernel's)."""
  mesh = sharding.current_mesh()
  if dot is None and _PARTITIONED.get() and mesh is not None and mesh.size > 1:
    return _ragged_tensor_parallel(h, w, idx, ex, n_experts, mesh)
  return _ragged_sum(h, w, idx, ex, n_experts, dot or _grouped_dot).astype(h.dtype)


def _ragged_sum(h, w, idx, ex, n_experts, dot) -> jax.Array:
  """experts_ragged's output in fp32."""
  flat_e, order, tok = _sort_rows(idx)
  xs = h[tok]  # [T*k, D]
  sizes = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32)
  g = dot(xs, ex["gate"], sizes)
  u = dot(xs, ex["up"], sizes)
  ys = dot(jax.nn.silu(g) * u, ex["down"], sizes)  # [T*k, D]
  return _combine(ys, w, order)


_EXPERT_AXES = {"gate": ("experts", "embed", "expert_mlp"), "up": ("experts", "embed", "expert_mlp"),
                "down": ("experts", "expert_mlp", "embed")}


def _tensor_only_mesh() -> bool:
  mesh = sharding.current_mesh()
  return mesh is not None and mesh.shape.get("expert", 1) == 1 and mesh.shape.get("tensor", 1) > 1


def _ragged_tensor_parallel(h, w, idx, ex, n_experts, mesh) -> jax.Array:
  if mesh.shape.get("expert", 1) != 1:
    raise ValueError(f"experts_ragged on a mesh {dict(mesh.shape)}: the ragged path splits experts' FFN by "
                     "tensor only; an expert axis takes the dense kernel")
  data = mesh.shape.get("data", 1)
  rows = P("data", None) if data > 1 and h.shape[0] % data == 0 else P(None, None)
  specs = jax.tree_util.tree_map(lambda s: s.spec, sharding.param_shardings(ex, {k: _EXPERT_AXES[k] for k in ex}, mesh))

  # Each chip's partial sum leaves in h's dtype, as GSPMD all-reduces the dense kernel's (bf16 in production:
  # half the bytes over the links of an fp32 psum, which the batch-1 refresh would spend 1.1 ms on).
  def local(h, w, idx, ex):
    return jax.lax.psum(_ragged_sum(h, w, idx, ex, n_experts, _grouped_dot).astype(h.dtype), "tensor")
  return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, specs), out_specs=rows)(h, w, idx, ex)


def _sort_rows(idx: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """idx [T, k] -> (expert of each (token, slot) row [T*k], the rows in expert order, the token of each
  sorted row)."""
  flat_e = idx.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  return flat_e, order, order // idx.shape[1]


def _combine(ys: jax.Array, w: jax.Array, order: jax.Array) -> jax.Array:
  """Sorted rows' outputs ys [T*k, D] weighted by their routing weights and summed per token in fp32.

  Each token's k rows are gathered back to [T, k, D] and reduced over k (one fusion reading ys once), rather
  than scatter-added: the scatter wrote an fp32 copy of every row first (a TPU slice's batch-8 refresh
  spent 1.75 GB per layer there)."""
  T, k = w.shape
  back = jnp.zeros((T * k,), jnp.int32).at[order].set(jnp.arange(T * k, dtype=jnp.int32))  # sorted slot of each row
  rows = ys[back].reshape(T, k, ys.shape[-1])
  return jnp.sum(rows.astype(jnp.float32) * w[:, :, None].astype(jnp.float32), axis=1)


def _ragged_xla(h, w, idx, ex, n_experts):
  return experts_ragged(h, w, idx, ex, n_experts, dot=quant.ragged_dot)


def moe_loop_reference(h: jax.Array, w: jax.Array, idx: jax.Array, ex: dict, n_experts: int) -> jax.Array:
  """Plain reference: a Python loop over experts, each applied to the tokens routed to it (tests only);
  quantised experts are dequantised first. With 8-bit activations (quant.act_min_tokens) each token's input
  and each (token, expert) row's down input (after the down projection's per-input scales) are rounded
  through quant.quantize_rows, as the grouped kernels quantise them."""
  a8 = quant.act8(ex["gate"], h.shape[0])
  if a8:
    qt, down_s = ex["down"].qvalue.dtype, ex["down"].scale[..., 0]  # [E, F]
    gate = ex["gate"]

    def rounded(x):
      group = quant.run_length(gate, x.shape[1])
      v, s = quant.quantize_rows(x, qt, (1,), group)
      s = jnp.repeat(s, group, axis=1) if group else s
      return (v.astype(jnp.float32) * s).astype(x.dtype)
    h = rounded(h)
    down_q = ex["down"].qvalue
  ex = quant.dequantize_params(ex, h.dtype)
  out = jnp.zeros(h.shape, jnp.float32)
  for e in range(n_experts):
    we = jnp.where(idx == e, w, 0.0).sum(-1)  # [T] this expert's weight per token (0 if not routed)
    g = h @ ex["gate"][e].astype(h.dtype)
    u = h @ ex["up"][e].astype(h.dtype)
    a = jax.nn.silu(g) * u
    if a8:
      y = rounded((a * down_s[e]).astype(h.dtype)) @ down_q[e].astype(h.dtype)
    else:
      y = a @ ex["down"][e].astype(h.dtype)
    out = out + y.astype(jnp.float32) * we[:, None]
  return out.astype(h.dtype)


def _plan(M: int, n_experts: int, gate) -> grouped_gemm.Plan:
  """The grouped kernels' tile for M routed rows over the experts' gate [E, D, F] (gate/up: two weights)."""
  _, D, F = gate.shape
  dt = gate.qvalue.dtype if quant.is_qarray(gate) else gate.dtype
  return grouped_gemm.plan(M, n_experts, D, F, n_weights=2, weight_bytes=jnp.dtype(dt).itemsize)


def _grouped_forward(h, w, idx, ex, n_experts, layout, x_scale, residual, eps):
  T = h.shape[0]
  M = T * idx.shape[1]
  p = _plan(M, n_experts, ex["gate"])
  interpret = backend() != "gpu"  # the CPU tests run the kernel's own code in Pallas's interpreter
  down, fold = ex["down"], None
  if quant.is_qarray(down):  # per-(expert, F) scales: applied to the activations, in the kernel before
    fold, down = down.scale.reshape(down.shape[0], 1, down.shape[1]), down.qvalue
  a8 = quant.act8(ex["gate"], T)
  x, x_rs = h, None
  if a8:  # 8-bit activations: each token quantised once (after the norm weight), before its k rows are formed
    hw = h if x_scale is None else h * x_scale.astype(h.dtype)
    group = quant.run_length(ex["gate"], hw.shape[1])
    x, x_rs = quant.quantize_rows(hw, down.dtype, (1,), group)
    x_rs, x_scale = (x_rs if group else x_rs[:, 0]), None
  per_token = 1
  if layout is None:
    flat_e = idx.reshape(-1)
    lo, hi = grouped_gemm.group_bounds(flat_e, n_experts)
    # block_m pad rows keep every tile's row slice inside the index: sentinel experts (E, after every real
    # one) sorted with the rest, so the sort writes the padded index itself; the kernel reads each row's
    # token as entry // k (pad entries wrap onto real tokens; no group reads them).
    order = jnp.argsort(jnp.concatenate([flat_e, jnp.full((p.block_m,), n_experts, flat_e.dtype)]), stable=True)
    rows, per_token = order, idx.shape[1]
    # Where each (token, slot) row sits in the sorted order (the inverse of the sort), for a combine that
    # gathers each token's k rows. A scatter-add into fp32 zeros [T, D] instead made XLA copy its one shared
    # zeros constant for every layer's in-place scatter: 84 MB read and written per layer at a batch-8
    # refresh of 7B-A1B, launched outside the CUDA graphs. The same holds for zeros as this scatter's buffer;
    # order[:M] is a permutation of [0, M) (the sentinels sort last), so every entry is written and the
    # layer's own expert ids, dead by then, serve.
    dest = flat_e.astype(jnp.int32).at[order[:M]].set(jnp.arange(M, dtype=jnp.int32), unique_indices=True)
    dest = dest.reshape(T, idx.shape[1])
  else:  # topk_align's
    dest, rows, lo, hi = layout
  # The gate/up kernel reads each sorted row from x through its token index (no gathered copy of the rows is
  # written and read back), applying x_scale (the norm weight) as it loads, or the row's 8-bit scale.
  a = grouped_gemm.grouped_matmul(x, (ex["gate"], ex["up"]), lo, hi, p, out_scale=fold, rows=rows,
                                  routed_rows=M, x_scale=x_scale, row_scale=x_rs, out_dtype=h.dtype,
                                  rows_per_token=per_token, interpret=interpret)
  a_rs = None
  if a8:  # the down projection's input, one scale per routed row (and run of columns with "+a8g")
    group = quant.run_length(ex["gate"], a.shape[1])
    a, a_rs = quant.quantize_rows(a, down.dtype, (1,), group)
    a_rs = a_rs if group else a_rs[:, 0]
  ys = grouped_gemm.grouped_matmul(a, (down,), lo, hi, p, routed_rows=M, row_scale=a_rs, out_dtype=h.dtype,
                                   interpret=interpret)
  if residual is not None:  # the residual add and the next norm in the same kernel as the combine
    return grouped_gemm.combine_normalize(ys, dest, w, residual, eps, interpret=interpret)
  # Each token sums its k rows, found by their sorted places: a gather XLA fuses with what follows (the
  # residual add), where a scatter-add into zeros is a kernel of its own.
  return grouped_gemm.combine_rows(ys, dest[:T], w[:T]).astype(h.dtype)


def _residual_normalize(residual, y, eps):
  x = residual + y
  return x, rms_normalize(x, eps)


def _grouped_reference(h, w, idx, ex, n_experts, x_scale, residual, eps):
  """What _grouped computes, through XLA's ragged_dot: its gradients (w, idx: rows past T are padding)."""
  T = h.shape[0]
  y = _ragged_xla(h if x_scale is None else h * x_scale.astype(h.dtype), w[:T], idx[:T], ex, n_experts)
  return y if residual is None else _residual_normalize(residual, y, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 8))
def _grouped(h, w, idx, ex, n_experts, layout, x_scale, residual, eps):
  """h [T, D] (times x_scale [D] when given: an RMSNorm's weight the kernel applies as it loads) -> y [T, D],
  or with a residual [T, D]: (residual + y, its rms_normalize). w, idx [>= T, k]: rows past T are padding
  (topk_align's)."""
  return _grouped_forward(h, w, idx, ex, n_experts, layout, x_scale, residual, eps)


def _grouped_fwd(h, w, idx, ex, n_experts, layout, x_scale, residual, eps):
  out = _grouped_forward(h, w, idx, ex, n_experts, layout, x_scale, residual, eps)
  return out, (h, w, idx, ex, x_scale, residual)


def _grouped_bwd(n_experts, eps, res, g):
  # The kernels have no transpose: gradients recompute the layer through XLA's ragged_dot (same maths).
  h, w, idx, ex, x_scale, residual = res
  _, vjp = jax.vjp(lambda h, w, ex, s, r: _grouped_reference(h, w, idx, ex, n_experts, s, r, eps),
                   h, w, ex, x_scale, residual)
  dh, dw, dex, ds, dr = vjp(g)
  return dh, dw, None, dex, None, ds, dr


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _grouped_takes(ex: dict) -> bool:
  return (grouped_gemm.supports(ex["gate"]) and grouped_gemm.supports(ex["up"])
          and grouped_gemm.supports(ex["down"], per_input=True))


def experts_grouped(h: jax.Array, w: jax.Array, idx: jax.Array, ex: dict, n_experts: int) -> jax.Array:
  """Sort-by-expert + this project's grouped GEMM kernel (model/grouped_gemm.py: a grid that fits the rows
  per expert, gate and up in one kernel); h [T, D] -> [T, D]. Kernels it does not take (block-scaled 8-bit)
  go to experts_ragged."""
  if not _grouped_takes(ex):
    return experts_ragged(h, w, idx, ex, n_experts)
  return _grouped(h, w, idx, ex, n_experts, None, None, None, 0.0)


def routes_in_kernel(cfg: ModelConfig, n_tokens: int, ex: dict) -> bool:
  """Whether the grouped path also routes in a kernel (grouped_gemm.topk_align): a softmax router over few
  enough tokens for one program (the cached windows; a refresh's thousand tokens route in XLA)."""
  return (cfg.router == "softmax" and _grouped_takes(ex)
          and grouped_gemm.align_fits(n_tokens, cfg.n_experts, cfg.n_experts_per_tok))


def experts_grouped_routed(h: jax.Array, lp: dict, cfg: ModelConfig, norm_w: jax.Array | None = None,
                           residual: jax.Array | None = None):
  """A softmax router's MoE FFN on h [T, D] (times norm_w when given) in four kernels besides XLA's router
  GEMM and softmax: top-k and the sort by expert (topk_align), gate/up reading the sorted rows from h (and
  applying norm_w as it loads: the weighted rows are never written), down, and the combine: with a residual
  [T, D] it returns (residual + y, rms_normalize of it) from one kernel (grouped_gemm.combine_normalize), else
  y, each token's k rows gathered (XLA fuses that with the residual add). Same maths as route +
  experts_grouped."""
  k, E = cfg.n_experts_per_tok, cfg.n_experts
  p = _plan(h.shape[0] * k, E, lp["experts"]["gate"])
  hw = h if norm_w is None else norm_w.astype(h.dtype) * h  # the router's input (XLA fuses it into its GEMM)
  probs = jax.nn.softmax(_router_logits(hw, lp), axis=-1)
  r = grouped_gemm.topk_align(probs, k, p.block_m, interpret=backend() != "gpu")
  return _grouped(h, r.w, r.idx, lp["experts"], E, (r.dest, r.src, r.lo, r.hi), norm_w, residual, cfg.rms_eps)


EXPERT_KERNELS = {"dense": experts_dense, "ragged": experts_ragged, "grouped": experts_grouped,
                  "loop": moe_loop_reference}


def moe_ffn(h: jax.Array, lp: dict, cfg: ModelConfig, impl: str | None = None,
            norm_w: jax.Array | None = None, residual: jax.Array | None = None,
            positions: jax.Array | None = None, valid: jax.Array | None = None):
  """The MoE FFN of one layer on normed hidden states h [B, T, D] -> [B, T, D]. With norm_w [D], h is
  normalised but not yet weighted (layers.rms_normalize) and the norm's weight is applied here: by the
  grouped kernel as it loads rows when it routes in a kernel, else first, as rms_norm does.

  With a residual [B, T, D] it returns (residual + y, rms_normalize(residual + y) or None): the block's output
  and, where the grouped kernels route and combine (GPU, cached windows), its normalisation for the next
  norm, computed in the combine's kernel."""
  B, T, D = h.shape
  flat = h.reshape(B * T, D)
  impl = impl or choose_impl(cfg, B * T)
  if impl == "grouped" and "shared" not in lp and routes_in_kernel(cfg, B * T, lp["experts"]):
    res = None if residual is None else residual.reshape(B * T, D)
    out = experts_grouped_routed(flat, lp, cfg, norm_w, res)
    if residual is None:
      return out.reshape(B, T, D)
    return out[0].reshape(B, T, D), out[1].reshape(B, T, D)
  if norm_w is not None:
    flat = norm_w.astype(flat.dtype) * flat
  w, idx = route(flat, lp, cfg, positions, valid)
  y = EXPERT_KERNELS[impl](flat, w, idx, lp["experts"], cfg.n_experts)
  if "shared" in lp:
    sh = lp["shared"]
    y = y + swiglu(flat, sh["gate"], sh["up"], sh["down"])
  y = y.reshape(B, T, D)
  return y if residual is None else (residual + y, None)
