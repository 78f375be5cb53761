"""The MoE's grouped GEMM on GPU: a Pallas-Triton kernel whose grid fits the rows each expert gets.

tokamax's grouped GEMM launches ceil(M / block_m) x N-tiles x G blocks and each block looks for rows of its
group from the group's start: with rows spread over G = 64 experts, almost every block finds none (98% of the
batch-8 refresh's grid; bench/realistic.py charges them). This kernel launches `slots` x N-tiles x G blocks,
slots = the row tiles a group holds when the router spreads rows evenly, and each block walks its group's
tiles slots apart (a group with more rows than that is walked in more steps by the same blocks): no block
without work under balanced routing, none skipped under any routing (dropless).

The gate and up projections run as one kernel (two accumulators, silu(gate) * up in fp32 in the epilogue):
the [M, F] gate and up outputs are never written. 8-bit weights with one scale per output channel
(model/quant.py) are loaded as they are and scaled in the epilogue; the down projection's per-input-channel
scales fold into the gate/up kernel's output (`out_scale`); block scales are not this kernel's (`supports`).

Around it, for token counts whose routing fits one program (the cached windows): `topk_align` (a softmax
router's top-k, the counting sort by expert and the group bounds in one kernel), the gate/up kernel reading
each sorted row through its index (`rows=`) with the RMSNorm weight applied as it loads (`x_scale=`), and
`combine_normalize` (each token's rows summed, the residual added and the sum RMS-normalised for the next
layer, in one kernel).

Rows are padded: x has M + block_m rows (the caller gathers them so; the pad rows are never read as a
group's rows), because a tile's rows are a dynamic slice of block_m rows and the interpreter (CPU tests)
clamps a slice that runs past the end rather than masking it. Output rows outside every group are left
unwritten: the caller reads rows [0, M) only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dinfer_jax import hardware
from dinfer_jax.model import quant
from dinfer_jax.model.layers import rms_normalize

NAME = "dinfer_grouped"  # kernel names: f"{NAME}_{kind}_bm{block_m}_m{M}" (bench/realistic.py reads them)
BLOCK_N = 128
BLOCK_K = 32
# Row tiles. Below 64 rows per group the GEMM streams weights (one tile per group, no compute to speak of), so
# the tile is the smallest that holds the rows; from 64 up the tile sizes of tokamax's kernel (64-256), the
# one that pads least, the larger on ties (fewer programs, more FLOPs per byte loaded).
SMALL_BLOCK_M = (16, 32)
BLOCK_M = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class Plan:
  """block_m rows per tile; slots: blocks per (group, column tile)."""
  block_m: int
  slots: int

  def block_n(self, n_weights: int) -> int:
    # Two fp32 accumulators of 256 x 128 would not stay in registers: half the columns there.
    return BLOCK_N // 2 if (n_weights == 2 and self.block_m >= 256) else BLOCK_N

  def __post_init__(self):
    if self.block_m < 16 or self.block_m & (self.block_m - 1):
      raise ValueError(f"block_m must be a power of two >= 16 (Triton's dot), got {self.block_m}")
    if self.slots < 1:
      raise ValueError(f"slots must be >= 1, got {self.slots}")


# Routing is never even: a group gets Binomial(M, p_g) rows, p_g its expert's popularity, and a group with more
# rows than its tile is walked again, re-reading its weights (a weight-streaming kernel's whole cost). The
# popularity is modelled as lognormal with this coefficient of variation across experts: 0 is a uniform
# router, 0.75 the embedded default model's trained router as measured (bench/router_skew.py). Tiles are
# chosen for a router in between (LLaDA-MoE trains with a balancing loss; the default model did not).
PLAN_SKEW = 0.5
# The tile choice's rates: an H200's achievable ones from the hardware table, whatever the target (tuning per
# chip would move some H100 tiles, e.g. 10240 rows: 64 x 6 -> 128 x 4; its predictions were made with these).
_PLAN_CHIP = hardware.CHIPS["h200"]


def popularity(G: int, skew: float) -> np.ndarray:
  """[G] expert probabilities: uniform at skew 0, else lognormal quantiles with coefficient of variation
  `skew` (sigma^2 = log(1 + skew^2)), normalised."""
  if skew <= 0:
    return np.full(G, 1.0 / G)
  sigma = math.sqrt(math.log1p(skew * skew))
  z = np.array([statistics.NormalDist().inv_cdf((g + 0.5) / G) for g in range(G)])
  p = np.exp(sigma * z)
  return p / p.sum()


@functools.lru_cache(maxsize=4096)
def expected_tiles(M: int, G: int, block_m: int, skew: float = 0.0, slots: int = 1) -> dict[str, float]:
  """What a call whose M rows each pick group g with probability popularity(G, skew)[g] (independently: a
  slight overestimate of the spread of top-k routing, where a token picks k distinct experts) runs, in
  expectation: row tiles (each group's rows rounded up to block_m), groups with rows, passes (a group's
  tiles are walked by `slots` blocks side by side, which share each weight tile through L2, so a group reads
  its weights from HBM once per ceil(tiles / slots) steps) and the most passes of any group (the kernel's
  longest block)."""
  if M <= 0:
    return {"tiles": 0.0, "busy": 0.0, "passes": 0.0, "max_passes": 0.0}
  p = np.clip(popularity(G, skew), 1e-12, 1 - 1e-12)
  mu, sd = M * p, np.sqrt(M * p * (1 - p))
  lo, hi = int(max(0, np.floor((mu - 12 * sd).min()) - 1)), int(min(M, np.ceil((mu + 12 * sd).max()) + 1))
  n = np.arange(lo, hi + 1)
  logfact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, M + 1)))])
  logpmf = (logfact[M] - logfact[n] - logfact[M - n])[None, :] + n[None, :] * np.log(p)[:, None] \
      + (M - n)[None, :] * np.log1p(-p)[:, None]
  pmf = np.exp(logpmf)  # [G, n]
  t = np.ceil(n / block_m)
  steps = np.ceil(t / slots)
  cdf = np.cumsum(pmf, axis=1)
  # P(the most passes of any group <= s) = prod over groups of P(its passes <= s).
  levels = np.unique(steps)
  below = np.array([np.prod(np.clip(cdf[:, np.searchsorted(steps, lv, side="right") - 1], 0, 1)) for lv in levels])
  return {"tiles": float((pmf * t).sum()), "busy": float(G - pmf[:, n == 0].sum()),
          "passes": float((pmf * steps).sum()),
          "max_passes": float(np.sum(levels * np.diff(np.concatenate([[0.0], below]))))}


def plan(M: int, G: int, K: int, N: int, n_weights: int = 1, weight_bytes: int = 2) -> Plan:
  """The tile and slots for M rows over G groups of [K, N] weights (n_weights of them per group): the pair
  whose expected time is least, with rows spread as PLAN_SKEW's router spreads them: max(bytes, FLOPs) at an
  H200's achievable rates, counting the weights re-read by a group's extra passes (more tiles than slots)
  and the padded rows, plus the waves of blocks that find no rows (a wave of resident blocks costs about
  1 us). The column tiles of a row tile share its rows through L2. Of pairs within 1% of the least, the
  largest tile, then the fewest slots. Slots range from what a group of average load needs to twice that."""
  rows = M / G
  chip = _PLAN_CHIP

  def cost(bm: int, slots: int) -> float:
    e = expected_tiles(M, G, bm, PLAN_SKEW, slots)
    moved = e["passes"] * K * N * n_weights * weight_bytes + e["tiles"] * bm * K * 2 + M * N * 2
    cols = math.ceil(N / Plan(bm, slots).block_n(n_weights))
    empty = cols * (slots * G - min(slots * e["busy"], e["tiles"]))
    return (max(moved / chip.copy_bytes_per_s, 2.0 * e["tiles"] * bm * K * N * n_weights / chip.gemm_flops)
            + chip.empty_wave_s * empty / chip.resident_blocks)

  # Small tiles only where the GEMM streams weights (a 16-row tile runs the tensor cores at a fraction).
  costs = {}
  for bm in (SMALL_BLOCK_M + BLOCK_M if rows <= SMALL_BLOCK_M[-1] else BLOCK_M):
    need = max(1, math.ceil(rows / bm))
    for slots in range(need, 2 * need + 1):
      costs[(bm, slots)] = cost(bm, slots)
  best = min(costs.values())
  bm, slots = min((k for k, c in costs.items() if c <= 1.01 * best), key=lambda k: (-k[0], k[1]))
  return Plan(bm, slots)


def tiles(M: int, K: int, N: int, G: int, n_weights: int = 1, p: Plan | None = None,
          skew: float = 0.0) -> dict[str, float]:
  """The work of one call with M rows over G groups spread as a router of `skew` spreads them (plan's
  model): routed and tile FLOPs (each group's rows rounded up to block_m), the weight tiles read from HBM (a
  group with more tiles than slots reads its weights again per pass; one with none reads nothing), grid
  blocks, and blocks that find rows."""
  p = p or plan(M, G, K, N, n_weights)
  e = expected_tiles(M, G, p.block_m, skew, p.slots)
  col_tiles = math.ceil(N / p.block_n(n_weights))
  return {"routed_flops": 2.0 * M * K * N * n_weights,
          "padded_flops": 2.0 * e["tiles"] * p.block_m * K * N * n_weights,
          "weight_tiles": e["passes"], "busy_groups": e["busy"], "max_passes": e["max_passes"],
          "blocks": p.slots * col_tiles * G, "working_blocks": min(p.slots * e["busy"], e["tiles"]) * col_tiles,
          "block_m": p.block_m}


def supports(w, per_input: bool = False) -> bool:
  """Plain [G, K, N] weights, or QArrays with one scale per (group, output column), or with per_input one per
  (group, input row) (the experts' down projection: its scales fold into the previous kernel's out_scale)."""
  if not quant.is_qarray(w):
    return True
  G, K, N = w.shape
  return tuple(w.scale.shape) == ((G, K, 1) if per_input else (G, 1, N))


def _values_scale(w):
  if quant.is_qarray(w):
    return w.qvalue, w.scale.astype(jnp.float32)
  return w, None


def _kernel(*refs, n_weights: int, scaled: bool, out_scaled: bool, swiglu: bool, block_m: int, slots: int,
            gathered: bool, x_scaled: bool, row_scaled: bool, rows_per_token: int, row_group: int = 0):
  """One (slot, column tile, group) block: the group's row tiles slot, slot + slots, ..."""
  x_ref, refs = refs[0], refs[1:]
  src_ref, refs = (refs[0], refs[1:]) if gathered else (None, refs)
  xs_ref, refs = (refs[0], refs[1:]) if x_scaled else (None, refs)
  rs_ref, refs = (refs[0], refs[1:]) if row_scaled else (None, refs)
  w_refs, refs = refs[:n_weights], refs[n_weights:]
  s_refs, refs = (refs[:n_weights], refs[n_weights:]) if scaled else ((None,) * n_weights, refs)
  os_ref, refs = (refs[0], refs[1:]) if out_scaled else (None, refs)
  lo_ref, hi_ref, o_ref = refs
  s = pl.program_id(0)
  lo, hi = lo_ref[...], hi_ref[...]
  K, bn = x_ref.shape[1], o_ref.shape[1]
  n_tiles = (hi - lo + block_m - 1) // block_m
  steps = jnp.maximum(n_tiles - s + slots - 1, 0) // slots

  def tile(i, carry):
    start = lo + (s + i * slots) * block_m
    rows = (start + jnp.arange(block_m)) < hi
    src = src_ref[pl.ds(start, block_m)] if gathered else None
    if gathered and rows_per_token > 1:  # (token, slot) rows in argsort's order: the token, wrapped onto x
      src = (src // rows_per_token) % x_ref.shape[0]

    def k_step(kk, accs):
      ks = pl.multiple_of(kk * BLOCK_K, BLOCK_K)
      if gathered:  # each sorted row read from its token's row (every src entry is a valid row)
        a = x_ref[src, pl.ds(ks, BLOCK_K)]
      else:
        # A float fill for float x: Triton casts no integer constant to FP8.
        a = plgpu.load(x_ref.at[pl.ds(start, block_m), pl.ds(ks, BLOCK_K)], mask=rows[:, None],
                       other=0 if jnp.issubdtype(x_ref.dtype, jnp.integer) else 0.0)
      if x_scaled:  # in x's dtype, one rounding, as the XLA multiply it replaces
        a = a * xs_ref[pl.ds(ks, BLOCK_K)][None, :]
      # 8-bit weights convert to the activations' dtype in the load (a no-op for 8-bit activations: the
      # product then runs on 8-bit tensor cores); the scales wait for the epilogue.
      if row_group:  # a scale per row and group of row_group columns: each K step's product scaled by its group's
        g = ks // row_group
        rs = (rs_ref[src, pl.ds(g, 1)] if gathered
              else plgpu.load(rs_ref.at[pl.ds(start, block_m), pl.ds(g, 1)], mask=rows[:, None], other=0.0))
        return tuple(acc + jnp.dot(a, w[pl.ds(ks, BLOCK_K), :].astype(a.dtype),
                                   preferred_element_type=quant.accumulator(x_ref.dtype)).astype(jnp.float32) * rs
                     for acc, w in zip(accs, w_refs))
      return tuple(acc + jnp.dot(a, w[pl.ds(ks, BLOCK_K), :].astype(a.dtype), preferred_element_type=acc.dtype)
                   for acc, w in zip(accs, w_refs))

    acc_dt = quant.accumulator(x_ref.dtype) if (row_scaled and not row_group) else jnp.float32
    accs = jax.lax.fori_loop(0, K // BLOCK_K, k_step, tuple(jnp.zeros((block_m, bn), acc_dt) for _ in range(n_weights)))
    accs = [acc.astype(jnp.float32) for acc in accs]
    if row_scaled and not row_group:  # each row's activation scale (8-bit x), before the nonlinearity
      rs = rs_ref[src] if gathered else plgpu.load(rs_ref.at[pl.ds(start, block_m)], mask=rows, other=0.0)
      accs = [acc * rs[:, None] for acc in accs]
    accs = [acc if sr is None else acc * sr[...] for acc, sr in zip(accs, s_refs)]
    # fp32 epilogue: silu(gate) * up before the one rounding to the output dtype.
    out = jax.nn.silu(accs[0]) * accs[1] if swiglu else accs[0]
    if os_ref is not None:
      out = out * os_ref[...]
    plgpu.store(o_ref.at[pl.ds(start, block_m), :], out.astype(o_ref.dtype), mask=rows[:, None])
    return carry

  jax.lax.fori_loop(0, steps, tile, 0)


class Routed(NamedTuple):
  """A softmax router's top-k, laid out for the grouped GEMM (topk_align). T tokens, padded to Tp (a power
  of two); k slots per token; M = T * k routed rows.

  w, idx [Tp, k]: top-k weights (fp32) and experts, as jax.lax.top_k gives them (ties: the lower expert).
  dest [Tp, k]: the sorted row of each (token, slot): rows sorted by expert, then by token.
  Rows from T on are padding (kept: a slice would be a copy in front of the kernels that read them).
  src [Tp * k + block_m]: the token of each sorted row; rows from M on are 0 (never a group's).
  lo, hi [E]: the sorted rows [lo[e], hi[e]) of expert e."""
  w: jax.Array
  idx: jax.Array
  dest: jax.Array
  src: jax.Array
  lo: jax.Array
  hi: jax.Array


# One program holds a [Tp, E] tile of routing state: beyond this many elements the XLA routing stays (a
# refresh forward's thousand tokens), below it (the cached windows) one kernel replaces top_k, its slice, the
# sort by expert and the group bounds.
ALIGN_MAX_ELEMENTS = 16384


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def align_fits(T: int, E: int, k: int) -> bool:
  return (_pow2(T) * E <= ALIGN_MAX_ELEMENTS and E & (E - 1) == 0 and k & (k - 1) == 0 and k <= E)


def _align_kernel(p_ref, w_ref, idx_ref, dest_ref, src_ref, lo_ref, hi_ref, *, T: int, k: int, block_m: int):
  Tp, E = w_ref.shape[0], p_ref.shape[1]
  t = jnp.arange(Tp, dtype=jnp.int32)
  col = jnp.arange(E, dtype=jnp.int32)[None, :]
  kcol = jnp.arange(k, dtype=jnp.int32)[None, :]
  real = t < T
  # Gathered with clamped rows: a [Tp, E] tile of a [T, E] input, no out-of-range read (the interpreter clamps
  # slices instead of masking them). Probabilities are >= 0: padded tokens and taken experts go below.
  p = jnp.where(real[:, None], p_ref[jnp.minimum(t, T - 1), :], -1.0)
  taken = jnp.zeros((Tp, E), jnp.int32)
  w = jnp.zeros((Tp, k), jnp.float32)
  ids = []
  for i in range(k):
    m = jnp.max(p, axis=1)
    j = jnp.min(jnp.where(p == m[:, None], col, E), axis=1)  # the lower expert on ties, as lax.top_k
    sel = col == j[:, None]
    taken = taken + sel.astype(jnp.int32)
    p = jnp.where(sel, -2.0, p)
    w = jnp.where(kcol == i, m[:, None], w)
    ids.append(j)
  taken = jnp.where(real[:, None], taken, 0)
  # Counting sort: a token takes an expert at most once, so a row's place within its expert is the number of
  # earlier tokens that took the expert; the expert's rows start after every lower expert's.
  counts = jnp.sum(taken, axis=0)
  ends = jnp.cumsum(counts)
  starts = ends - counts
  place = starts[None, :] + jnp.cumsum(taken, axis=0) - taken  # [Tp, E]
  M = T * k
  idx = jnp.zeros((Tp, k), jnp.int32)
  dest = jnp.zeros((Tp, k), jnp.int32)
  token = jnp.where(real, t, 0)
  for i, j in enumerate(ids):
    d = jnp.sum(jnp.where(col == j[:, None], place, 0), axis=1)
    d = jnp.where(real, d, M + (t - T) * k + i)  # padded tokens' rows after every real one, each its own
    src_ref[d] = token
    idx = jnp.where(kcol == i, j[:, None], idx)
    dest = jnp.where(kcol == i, d[:, None], dest)
  src_ref[pl.ds(Tp * k, block_m)] = jnp.zeros((block_m,), jnp.int32)
  w_ref[...] = w
  idx_ref[...] = idx
  dest_ref[...] = dest
  lo_ref[...] = starts
  hi_ref[...] = ends


def _topk_align_call(probs: jax.Array, k: int, block_m: int, interpret: bool) -> Routed:
  T, E = probs.shape
  Tp = _pow2(T)
  outs = (jax.ShapeDtypeStruct((Tp, k), jnp.float32), jax.ShapeDtypeStruct((Tp, k), jnp.int32),
          jax.ShapeDtypeStruct((Tp, k), jnp.int32), jax.ShapeDtypeStruct((Tp * k + block_m,), jnp.int32),
          jax.ShapeDtypeStruct((E,), jnp.int32), jax.ShapeDtypeStruct((E,), jnp.int32))
  w, idx, dest, src, lo, hi = pl.pallas_call(
      functools.partial(_align_kernel, T=T, k=k, block_m=block_m), out_shape=outs,
      in_specs=[pl.no_block_spec], out_specs=[pl.no_block_spec] * len(outs), grid=(1,), interpret=interpret,
      name=f"{NAME}_topk_align", compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
  )(probs.astype(jnp.float32))
  return Routed(w, idx, dest, src, lo, hi)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _topk_align(probs, k, block_m, interpret):
  return _topk_align_call(probs, k, block_m, interpret)


def _topk_align_fwd(probs, k, block_m, interpret):
  r = _topk_align_call(probs, k, block_m, interpret)
  return r, (r.idx[:probs.shape[0]], probs.shape[1])


def _topk_align_bwd(k, block_m, interpret, res, g):
  # Only the weights are differentiable: each went to its (token, expert) probability.
  idx, E = res
  return (jnp.einsum("Tk,TkE->TE", g.w[:idx.shape[0]], jax.nn.one_hot(idx, E, dtype=g.w.dtype)),)


_topk_align.defvjp(_topk_align_fwd, _topk_align_bwd)


def topk_align(probs: jax.Array, k: int, block_m: int, *, interpret: bool = False) -> Routed:
  """probs [T, E] (a softmax router's) -> its top-k laid out for grouped_matmul (Routed), in one kernel: what
  lax.top_k, the sort by expert and group_bounds do in four (top_k, its slice, the bounds, the sort; the row
  gather becomes the GEMM's own load). Differentiable in the weights. Needs align_fits(T, E, k)."""
  T, E = probs.shape
  if not align_fits(T, E, k):
    raise ValueError(f"topk_align: T={T}, E={E}, k={k} do not fit one program (align_fits)")
  return _topk_align(probs, k, block_m, interpret)


def _combine_norm_kernel(ys_ref, dest_ref, w_ref, x_ref, xo_ref, n_ref, *, k: int, bt: int, eps: float):
  rows = pl.ds(pl.program_id(0) * bt, bt)
  dest, w = dest_ref[rows, :], w_ref[rows, :]
  kcol = jnp.arange(k, dtype=jnp.int32)[None, :]
  acc = None
  for i in range(k):  # slot order, fp32: the sum the XLA combine does
    d = jnp.sum(jnp.where(kcol == i, dest, 0), axis=1)
    wi = jnp.sum(jnp.where(kcol == i, w, 0.0), axis=1)
    term = ys_ref[d, :].astype(jnp.float32) * wi[:, None]
    acc = term if acc is None else acc + term
  x = x_ref[rows, :] + acc.astype(x_ref.dtype)
  xo_ref[rows, :] = x
  n_ref[rows, :] = rms_normalize(x, eps)


def combine_rows(ys: jax.Array, dest: jax.Array, w: jax.Array) -> jax.Array:
  """XLA's combine: token t's output is sum_i w[t, i] ys[dest[t, i]] in fp32 (slot order), [T, D] fp32 for
  dest / w [T, k]."""
  # One gather-multiply-reduce over the k rows, not k column slices of dest and w (XLA launches each slice
  # as a kernel of its own).
  return jnp.sum(ys[dest].astype(jnp.float32) * w[..., None].astype(jnp.float32), axis=1)


def combine_normalize(ys: jax.Array, dest: jax.Array, w: jax.Array, x: jax.Array, eps: float, *,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """The end of a MoE block and the start of the next, in one kernel: x + combine(ys) (the residual, in x's
  dtype) and its RMS normalisation before the weight (layers.rms_normalize; the next GEMM applies the weight
  as it loads). ys [R, D] sorted rows (the down GEMM's), dest / w [>= T, k] (topk_align's; rows [0, T)
  read), x [T, D]. Two XLA kernels otherwise (a gather-add, then the norm: a reduction does not fuse into the
  gather)."""
  T, D = x.shape
  k = w.shape[1]
  if dest.shape != w.shape or dest.shape[0] < T or ys.shape[1] != D or D & (D - 1) or k & (k - 1):
    raise ValueError(f"combine_normalize: ys {tuple(ys.shape)}, dest {tuple(dest.shape)}, w {tuple(w.shape)}, "
                     f"x {tuple(x.shape)} (D and k powers of two)")
  bt = min(T & -T, 8)  # a power of two dividing T: every program's rows exist (no masked stores)
  out = jax.ShapeDtypeStruct((T, D), x.dtype)
  return pl.pallas_call(
      functools.partial(_combine_norm_kernel, k=k, bt=bt, eps=eps), out_shape=(out, out),
      in_specs=[pl.no_block_spec] * 4, out_specs=[pl.no_block_spec] * 2, grid=(T // bt,), interpret=interpret,
      name=f"{NAME}_combine_norm", compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
  )(ys, dest.astype(jnp.int32), w.astype(jnp.float32), x)


def group_bounds(group_of_row: jax.Array, G: int) -> tuple[jax.Array, jax.Array]:
  """(lo, hi) [G] int32: the rows [lo[g], hi[g]) of group g once rows are sorted by group, counted straight
  from the unsorted group ids (one compare-and-sum kernel on GPU, no histogram scatter and cumsum)."""
  g = jnp.arange(G, dtype=group_of_row.dtype)[:, None]
  return ((group_of_row[None, :] < g).sum(1, dtype=jnp.int32),
          (group_of_row[None, :] <= g).sum(1, dtype=jnp.int32))


def grouped_matmul(x: jax.Array, ws: tuple, lo: jax.Array, hi: jax.Array, p: Plan, *,
                   out_scale: jax.Array | None = None, rows: jax.Array | None = None,
                   routed_rows: int | None = None, x_scale: jax.Array | None = None,
                   row_scale: jax.Array | None = None, out_dtype=None, rows_per_token: int = 1,
                   interpret: bool = False) -> jax.Array:
  """x [M + block_m, K] (rows sorted by group, pad rows last), ws one or two [G, K, N] kernels (two: gate and
  up, the result is silu(x @ gate) * (x @ up)), group g's rows [lo[g], hi[g]) (group_bounds) ->
  [M + block_m, N] in x's dtype, rows outside every group unwritten. out_scale [G, 1, N] multiplies the fp32
  result per (group, column) before the rounding: the next GEMM's per-input-channel scales (the experts'
  down projection, model/quant.py) folded into this one's output.

  rows [R] (R >= M + block_m, every entry a row of x: topk_align's src): sorted row r is x[rows[r]], read by
  the kernel itself, so x is the unsorted [T, K] and no gathered copy is written; the result has R rows.
  x_scale [K]: multiplies x's columns as they are loaded (in x's dtype): an RMSNorm's weight, so the
  normalised rows need not be written weighted.
  rows_per_token: with rows, each entry is a (token, slot) row number whose token is entry // rows_per_token
  (modulo x's rows: pad entries past the last token wrap to real ones), so argsort's output over the
  flattened [T, k] expert ids is the index as it is (no kernel to divide it).
  row_scale [rows of x] fp32: x is 8-bit activations (quant.quantize_rows) of the weights' 8-bit type, row r
  standing for x[r] * row_scale[r]; the product runs on the 8-bit values (int32 / fp32 accumulator). With
  rows=, indexed like x (by token). [rows of x, K / group]: one scale per row and run of `group` columns
  (quant's "+a8g"), each K step's product scaled by its run's scale into an fp32 accumulator. out_dtype: the result's (default x's; needed for 8-bit x).
  routed_rows: M, the rows the plan was made for (needed with rows; else x's rows less block_m). The kernel's
  name carries it and the tile (`dinfer_grouped_{dot|swiglu}_bm{block_m}_m{M}`: bench/realistic.py reads
  them)."""
  if len(ws) not in (1, 2):
    raise ValueError(f"grouped_matmul takes one kernel or two (gate, up), got {len(ws)}")
  if not all(supports(w) for w in ws):
    raise ValueError("grouped_matmul: a QArray kernel needs one scale per output column (scale [G, 1, N])")
  Mp, K = x.shape
  G, K2, N = ws[0].shape
  if K2 != K or any(tuple(w.shape) != (G, K, N) for w in ws):
    raise ValueError(f"grouped_matmul: x [{Mp}, {K}] against kernels {[tuple(w.shape) for w in ws]}")
  if K % BLOCK_K:
    raise ValueError(f"grouped_matmul: K={K} is not a multiple of {BLOCK_K}")
  bn = min(p.block_n(len(ws)), N)
  if N % bn:
    raise ValueError(f"grouped_matmul: N={N} is not a multiple of {bn}")
  parts = [_values_scale(w) for w in ws]
  scaled = parts[0][1] is not None
  if any((s is not None) != scaled for _, s in parts):
    raise ValueError("grouped_matmul: gate and up must both be quantised or both plain")
  lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
  w_spec = pl.BlockSpec((None, K, bn), lambda s, j, e: (e, 0, j))
  s_spec = pl.BlockSpec((None, 1, bn), lambda s, j, e: (e, 0, j))
  g_spec = pl.BlockSpec((None,), lambda s, j, e: (e,))
  out_scaled = out_scale is not None
  if out_scaled and tuple(out_scale.shape) != (G, 1, N):
    raise ValueError(f"grouped_matmul: out_scale {tuple(out_scale.shape)} is not [{G}, 1, {N}]")
  gathered = rows is not None
  if gathered:
    if rows.ndim != 1 or rows.shape[0] <= p.block_m:
      raise ValueError(f"grouped_matmul: rows {tuple(rows.shape)} must be one index per sorted row "
                       f"(M + block_m of them at least)")
    if routed_rows is None:
      raise ValueError("grouped_matmul: rows needs routed_rows (M)")
    Mp = rows.shape[0]
  M = routed_rows if routed_rows is not None else Mp - p.block_m
  x_scaled = x_scale is not None
  if x_scaled and tuple(x_scale.shape) != (K,):
    raise ValueError(f"grouped_matmul: x_scale {tuple(x_scale.shape)} is not [{K}]")
  row_scaled = row_scale is not None
  if row_scaled:
    if x_scaled or jnp.dtype(x.dtype).itemsize != 1 or x.dtype != parts[0][0].dtype:
      raise ValueError(f"grouped_matmul: row_scale needs x in the weights' 8-bit type (x {x.dtype}, weights "
                       f"{parts[0][0].dtype}) and no x_scale (fold it in before quantising x)")
    row_group = K // row_scale.shape[1] if row_scale.ndim == 2 and row_scale.shape[1] else 0
    if tuple(row_scale.shape) not in ((x.shape[0],), (x.shape[0], K // max(row_group, 1))) or (
        row_group and (K % row_scale.shape[1] or row_group % BLOCK_K)):
      raise ValueError(f"grouped_matmul: row_scale {tuple(row_scale.shape)} is neither [{x.shape[0]}] (one per row "
                       f"of x) nor [{x.shape[0]}, K / group] with groups of a multiple of {BLOCK_K} columns")
  elif jnp.dtype(x.dtype).itemsize == 1:
    raise ValueError(f"grouped_matmul: 8-bit x ({x.dtype}) needs its row_scale")
  out_dtype = out_dtype or x.dtype
  in_specs = ([pl.no_block_spec] + [pl.no_block_spec] * (gathered + x_scaled + row_scaled) + [w_spec] * len(ws)
              + ([s_spec] * len(ws) if scaled else []) + ([s_spec] if out_scaled else []) + [g_spec, g_spec])
  args = ([x] + ([rows.astype(jnp.int32)] if gathered else []) + ([x_scale.astype(x.dtype)] if x_scaled else [])
          + ([row_scale.astype(jnp.float32)] if row_scaled else [])
          + [v for v, _ in parts] + ([s for _, s in parts] if scaled else [])
          + ([out_scale.astype(jnp.float32)] if out_scaled else []) + [lo, hi])
  kind = "swiglu" if len(ws) == 2 else "dot"
  kernel = functools.partial(_kernel, n_weights=len(ws), scaled=scaled, out_scaled=out_scaled, swiglu=len(ws) == 2,
                             block_m=p.block_m, slots=p.slots, gathered=gathered, x_scaled=x_scaled,
                             row_scaled=row_scaled, rows_per_token=rows_per_token,
                             row_group=row_group if row_scaled else 0)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype), in_specs=in_specs,
      out_specs=pl.BlockSpec((Mp, bn), lambda s, j, e: (0, j)), grid=(p.slots, N // bn, G),
      interpret=interpret, name=f"{NAME}_{kind}_bm{p.block_m}_m{M}",
      compiler_params=plgpu.CompilerParams(num_warps=8 if p.block_m >= 256 else 4, num_stages=3),
  )(*args)
