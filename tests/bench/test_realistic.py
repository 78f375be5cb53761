"""The realistic GPU model (bench.realistic) on hand-written modules and hand-worked numbers."""
from __future__ import annotations

import dataclasses

import pytest

from dinfer_jax.bench import realistic, roofline
from dinfer_jax.model import moe

# A module as XLA prints an optimised one: 6 fusions in a row, a copy, 2 more fusions, a loop with a known trip
# count of 3 over 2 fusions, and a gather fusion that looks up 4 rows of a [1000, 64] fp32 table.
_MODULE = """HloModule hand

%fused_a (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %t = f32[8]{0} tanh(%p)
}

%fused_gather (t: f32[1000,64], i: s32[4]) -> f32[4,64] {
  %t = f32[1000,64]{1,0} parameter(0)
  %i = s32[4]{0} parameter(1)
  ROOT %g = f32[4,64]{1,0} gather(%t, %i), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
}

%body (c: (s32[], f32[8])) -> (s32[], f32[8]) {
  %c = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%c), index=1
  %i = s32[] get-tuple-element(%c), index=0
  %b1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %b2 = f32[8]{0} fusion(%b1), kind=kLoop, calls=%fused_a
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %b2)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x: f32[8], t: f32[1000,64], i: s32[4]) -> f32[4,64] {
  %x = f32[8]{0} parameter(0)
  %t = f32[1000,64]{1,0} parameter(1)
  %i = s32[4]{0} parameter(2)
  %f1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %f2 = f32[8]{0} fusion(%f1), kind=kLoop, calls=%fused_a
  %f3 = f32[8]{0} fusion(%f2), kind=kLoop, calls=%fused_a
  %f4 = f32[8]{0} fusion(%f3), kind=kLoop, calls=%fused_a
  %f5 = f32[8]{0} fusion(%f4), kind=kLoop, calls=%fused_a
  %f6 = f32[8]{0} fusion(%f5), kind=kLoop, calls=%fused_a
  %c1 = f32[8]{0} copy(%f6)
  %f7 = f32[8]{0} fusion(%c1), kind=kLoop, calls=%fused_a
  %g = f32[4,64]{1,0} fusion(%t, %i), kind=kLoop, calls=%fused_gather
  %z = s32[] constant(0)
  %tup = (s32[], f32[8]{0}) tuple(%z, %f7)
  %w = (s32[], f32[8]{0}) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[4,64]{1,0} copy(%g)
}
"""


def test_kernels_group_runs_into_cuda_graphs_and_unroll_known_loops():
  mod = realistic.Module(_MODULE)
  k = realistic.kernels(mod, realistic.H200)
  # Entry: 6 fusions (one graph: a run of >= 5), a copy (alone), a run of 2 fusions (f7, the gather: too short
  # for a graph), the loop body's 2 fusions 3 times (a run of 2 each time), the final copy.
  assert k.total == 6 + 1 + 2 + 3 * 2 + 1
  assert (k.graphs, k.in_graphs) == (1, 6)
  assert k.separate == 1 + 2 + 6 + 1
  assert k.by_kind == {"fusion": 6 + 2 + 6, "copy": 2}
  # Each graph and separate kernel: one 2.5 us launch; each kernel in a graph 2.25 us (the central charge).
  assert k.overhead_s(realistic.H200) == pytest.approx(1e-6 * ((1 + 10) * 2.5 + 6 * 2.25))
  # A bigger minimum graph puts the 6 fusions on their own.
  k7 = realistic.kernels(mod, dataclasses.replace(realistic.H200, graph_min_kernels=7))
  assert (k7.graphs, k7.separate) == (0, 16)


def test_gather_is_charged_the_rows_it_reads():
  mod = realistic.Module(_MODULE)
  # Its operands hold the whole [1000, 64] fp32 table; it reads 4 rows (what it writes).
  assert realistic.overcharges(mod) == {"g": 1000 * 64 * 4 - 4 * 64 * 4}


def test_in_place_scatter_is_charged_the_slots_it_writes():
  text = """HloModule s

%fused_scatter (b: bf16[1,1280,16,128], i: s32[96,2], u: bf16[96,16,128]) -> bf16[1,1280,16,128] {
  %b = bf16[1,1280,16,128]{3,2,1,0} parameter(0)
  %i = s32[96,2]{1,0} parameter(1)
  %u = bf16[96,16,128]{2,1,0} parameter(2)
  ROOT %s = bf16[1,1280,16,128]{3,2,1,0} scatter(%b, %i, %u), update_window_dims={1,2}, inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (b: bf16[1,1280,16,128], i: s32[96,2], u: bf16[96,16,128]) -> bf16[1,1280,16,128] {
  %b = bf16[1,1280,16,128]{3,2,1,0} parameter(0)
  %i = s32[96,2]{1,0} parameter(1)
  %u = bf16[96,16,128]{2,1,0} parameter(2)
  ROOT %f = bf16[1,1280,16,128]{3,2,1,0} fusion(%b, %i, %u), kind=kInput, calls=%fused_scatter
}
"""
  buf, upd, idx = 1280 * 16 * 128 * 2, 96 * 16 * 128 * 2, 96 * 2 * 4
  # Charged: the buffer read and written (+ the updates and indices read); touched: the updates and indices
  # read, as many bytes written.
  assert realistic.overcharges(realistic.Module(text)) == {"f": 2 * buf - (upd + idx)}


def _gemm(name: str, x: str, x_dt: str, w: str, w_dt: str, M: int, K: int, N: int) -> str:
  """A GEMM fusion's computation as XLA prints it: x [M, K] times w [K, N] -> f32 [M, N]; a w of another type
  than x is converted to x's in the operand load (names are unique across a module)."""
  conv = w_dt != x_dt
  rhs = f"%{w}c" if conv else f"%{w}"
  return "\n".join([
      f"%{name} ({x}: {x_dt}[{M},{K}], {w}: {w_dt}[{K},{N}]) -> f32[{M},{N}] {{",
      f"  %{x} = {x_dt}[{M},{K}]{{1,0}} parameter(0)",
      f"  %{w} = {w_dt}[{K},{N}]{{1,0}} parameter(1)",
      *([f"  %{w}c = {x_dt}[{K},{N}]{{1,0}} convert(%{w})"] if conv else []),
      f"  ROOT %{name}_dot = f32[{M},{N}]{{1,0}} dot(%{x}, {rhs}), lhs_contracting_dims={{1}}, "
      "rhs_contracting_dims={0}",
      "}"])


def test_sliced_parameters_are_charged_the_slice():
  """A fusion parameter that is only sliced, directly or behind a bitcast (which XLA's cost analysis misses),
  is charged its slices: 320 KB of p0's 4 MB, 40 KB of p2's; p3 is negated whole before its slice."""
  text = """HloModule sl

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%fused_rows (p0: f32[1000,1000], p1: s32[], p2: f32[1000,1000], p3: f32[1000,1000]) -> f32[8,10] {
  %p0 = f32[1000,1000]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[1000,1000]{1,0} parameter(2)
  %p3 = f32[1000,1000]{1,0} parameter(3)
  %z = s32[] constant(0)
  %v = f32[8,125,1000]{2,1,0} bitcast(%p0)
  %d = f32[8,10,1000]{2,1,0} dynamic-slice(%v, %z, %p1, %z), dynamic_slice_sizes={8,10,1000}
  %e = f32[10,1000]{1,0} dynamic-slice(%p2, %p1, %z), dynamic_slice_sizes={10,1000}
  %w = f32[8,125,1000]{2,1,0} bitcast(%p3)
  %n = f32[8,125,1000]{2,1,0} negate(%w)
  %f = f32[8,10,1000]{2,1,0} dynamic-slice(%n, %z, %p1, %z), dynamic_slice_sizes={8,10,1000}
  %s = f32[8,10,1000]{2,1,0} add(%d, %f)
  %i = f32[] constant(-inf)
  ROOT %r = f32[8,10]{1,0} reduce(%s, %i), dimensions={2}, to_apply=%max
}

ENTRY %main (x: f32[1000,1000], i: s32[]) -> f32[8,10] {
  %x = f32[1000,1000]{1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = f32[8,10]{1,0} fusion(%x, %i, %x, %x), kind=kInput, calls=%fused_rows
}
"""
  assert realistic.overcharges(realistic.Module(text)) == {"f": (4_000_000 - 8 * 10 * 1000 * 4) + (4_000_000 - 10 * 1000 * 4)}


def test_dequantized_weight_copies_are_found():
  # The two shapes the H200 compile gives an int8 GEMM: qwix's dequantise-then-dot writes a bf16 copy of the
  # weight (loop fusion of s8 and its scales), the output-scaled form converts inside the GEMM fusion.
  text = """HloModule q

%fused_multiply (q: s8[2048,1024], s: f32[1,1024]) -> bf16[2048,1024] {
  %q = s8[2048,1024]{1,0} parameter(0)
  %s = f32[1,1024]{1,0} parameter(1)
  %c = bf16[2048,1024]{1,0} convert(%q)
  ROOT %m = bf16[2048,1024]{1,0} multiply(%c, %c)
}

""" + _gemm("gemm_fusion_dot_computation", "x", "bf16", "q", "s8", 96, 2048, 1024) + """

ENTRY %main (x: bf16[96,2048], q: s8[2048,1024], s: f32[1,1024]) -> f32[96,1024] {
  %x = bf16[96,2048]{1,0} parameter(0)
  %q = s8[2048,1024]{1,0} parameter(1)
  %s = f32[1,1024]{1,0} parameter(2)
  %deq = bf16[2048,1024]{1,0} fusion(%q, %s), kind=kLoop, calls=%fused_multiply
  %g1 = f32[96,1024]{1,0} fusion(%x, %q), kind=kCustom, calls=%gemm_fusion_dot_computation
  ROOT %g2 = f32[96,1024]{1,0} fusion(%x, %deq), kind=kCustom, calls=%gemm_fusion_dot_computation
}
"""
  assert realistic.dequantized_copies(realistic.Module(text)) == 2048 * 1024 * 2
  assert realistic.dequantized_copies(realistic.Module(_MODULE)) == 0


def test_eight_bit_products_are_charged_at_the_eight_bit_rate():
  """W8A8: a GEMM fusion whose dot multiplies two FP8 operands runs at the 8-bit rate; one that converts the
  8-bit weight to bf16 in its load (weight-only) at the bf16 rate. Worked by hand: a compute-bound module."""
  text = """HloModule w8a8

""" + _gemm("gemm8", "p0", "f8e4m3fn", "p1", "f8e4m3fn", 1280, 2048, 1024) + """

""" + _gemm("gemm16", "p2", "bf16", "p3", "f8e4m3fn", 1280, 2048, 1024) + """

ENTRY %main (x8: f8e4m3fn[1280,2048], x: bf16[1280,2048], q: f8e4m3fn[2048,1024]) -> f32[1280,1024] {
  %x8 = f8e4m3fn[1280,2048]{1,0} parameter(0)
  %x = bf16[1280,2048]{1,0} parameter(1)
  %q = f8e4m3fn[2048,1024]{1,0} parameter(2)
  %a = f32[1280,1024]{1,0} fusion(%x8, %q), kind=kCustom, calls=%gemm8
  ROOT %b = f32[1280,1024]{1,0} fusion(%x, %q), kind=kCustom, calls=%gemm16
}
"""
  mod = realistic.Module(text)
  one = 2.0 * 1280 * 2048 * 1024
  ch = realistic.H200
  t = realistic.forward_time({"bytes": 1e6, "flops": 2 * one}, mod, ch)
  assert t["eight_bit_flops"] == one and t["realistic_flops"] == 2 * one
  # Each GEMM at its own bound, at the GEMM class's fractions of the achievable rates (both compute-bound).
  e = ch.efficiency
  assert t["realistic_s"] == pytest.approx(one / (790e12 * e.gemm_rate) + one / (1580e12 * e.gemm_rate)
                                           + realistic.kernels(mod, ch).overhead_s(ch))
  # The project's grouped GEMM kernel with 8-bit rows: its padded tile FLOPs are the 8-bit ones.
  g = realistic.GroupedGemm()
  tiles = {"routed_flops": 10.0, "padded_flops": 16.0, "blocks": 1, "working_blocks": 1}
  g.add({"tiles": tiles, "eight_bit": True, "weight_bytes": 8.0, "weight_bytes_read": 12.0})
  g.add({"tiles": dict(tiles, padded_flops=12.0), "eight_bit": False, "weight_bytes": 8.0, "weight_bytes_read": 6.0})
  assert (g.padded_flops, g.eight_bit_flops, g.weight_bytes_over) == (28.0, 16.0, 2.0)


def test_kernels_are_charged_each_at_its_own_bound():
  """A memory-bound kernel and a compute-bound one: charged one after the other, each its own bound, not the
  whole program's bytes or FLOPs (which hide one behind the other). By hand at the H200's charges."""
  text = """HloModule mix

%fused_neg (p: f32[4000000]) -> f32[4000000] {
  %p = f32[4000000]{0} parameter(0)
  ROOT %n = f32[4000000]{0} negate(%p)
}

""" + _gemm("gemm", "x", "bf16", "w", "bf16", 4096, 4096, 4096) + """

ENTRY %main (v: f32[4000000], x: bf16[4096,4096], w: bf16[4096,4096]) -> f32[4096,4096] {
  %v = f32[4000000]{0} parameter(0)
  %x = bf16[4096,4096]{1,0} parameter(1)
  %w = bf16[4096,4096]{1,0} parameter(2)
  %n = f32[4000000]{0} fusion(%v), kind=kLoop, calls=%fused_neg
  ROOT %g = f32[4096,4096]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
}
"""
  mod = realistic.Module(text)
  ch = realistic.H200
  e = ch.efficiency
  flops = 2.0 * 4096 ** 3
  mem_s = 32e6 / (4.3e12 * e.memory_bw)  # 16 MB read, 16 MB written
  gemm_bytes = 2 * 4096 * 4096 * 2 + 4096 * 4096 * 4
  gemm_s = max(gemm_bytes / (4.3e12 * e.gemm_bw), flops / (790e12 * e.gemm_rate))
  assert gemm_s == flops / (790e12 * e.gemm_rate)
  t = realistic.forward_time({"bytes": 0.0, "flops": 0.0}, mod, ch)
  assert t["class_ms"] == pytest.approx({"memory": 1e3 * mem_s, "gemm": 1e3 * gemm_s})
  assert t["realistic_s"] == pytest.approx(mem_s + gemm_s + realistic.kernels(mod, ch).overhead_s(ch))
  # The program as a whole: its FLOPs hide the memory-bound kernel.
  assert t["program_bound_s"] == pytest.approx(flops / 790e12)
  assert t["realistic_bytes"] == 32e6 + gemm_bytes
  # The range's ends bracket the central figure.
  slow, fast = realistic.RANGES["h200"]
  assert (realistic.forward_time({"bytes": 0.0, "flops": 0.0}, mod, fast)["realistic_s"] < t["realistic_s"]
          < realistic.forward_time({"bytes": 0.0, "flops": 0.0}, mod, slow)["realistic_s"])


def test_grouped_gemm_tiles_at_the_batch1_refresh():
  """LLaDA-MoE-7B-A1B's batch-1 refresh: 1280 tokens x 8 experts = 10240 rows over 64 experts (160 each),
  gate projection 2048 -> 1024. With tokamax's own 128-row tile and a uniform router: 2 row tiles per expert
  = 1.6x the routed FLOPs, a grid of 80 x 8 x 64 blocks of which 64 x 2 x 8 find rows (the audit's 40,960
  and 1,024), less the experts whose Binomial(10240, 1/64) rows fit one tile: P(n <= 128) = 0.004866 (128 is 2.5 standard
  deviations below 160)."""
  ch128 = dataclasses.replace(realistic.H200, tile_rows=128, skew=0.0)
  t = realistic.grouped_gemm_tiles(10240, 2048, 1024, 64, ch128)
  assert t["routed_flops"] == 2 * 10240 * 2048 * 1024
  assert t["padded_flops"] / t["routed_flops"] == pytest.approx(1.6 * (1 - 0.004866 / 2), rel=1e-5)
  assert t["blocks"] == 40960 and t["working_blocks"] == pytest.approx(1024 * (1 - 0.004866 / 2), rel=1e-5)
  # 256 rows hold an expert's 160 in one tile, the same padding in half the grid, so less time by the model's
  # charges with a uniform router.
  t256 = realistic.grouped_gemm_tiles(10240, 2048, 1024, 64, dataclasses.replace(ch128, tile_rows=256))
  assert t256["block_m"] == 256
  assert t256["padded_flops"] / t256["routed_flops"] == pytest.approx(1.6, rel=1e-4)
  assert t256["blocks"] == 40 * 8 * 64
  # Time = the weights read once per expert with rows at 4.3 TB/s or the tiles at 790 TFLOP/s, whichever is
  # longer, + (empty blocks / 1056 resident) x 1 us.
  def by_hand(t):
    body = max(t["weight_tiles"] * 2048 * 1024 * 2 / 4.3e12, t["padded_flops"] / 790e12)
    return body + 1e-6 * (t["blocks"] - t["working_blocks"]) / 1056
  assert moe.grouped_time_s(t256, 2048, 1024) == pytest.approx(by_hand(t256))
  assert by_hand(t256) < by_hand(t)


def test_grouped_block_m_follows_the_rows_per_group():
  # batch-8 refresh: 1280 rows per expert, 5 full tiles of 256 (no padding) and the smallest grid.
  assert moe.grouped_block_m(81920, 2048, 1024, 64) == 256
  # batch-8 cached window (96 rows per expert): one 128-row tile beats two of 64 and a 256 with 160 padded rows.
  assert moe.grouped_block_m(6144, 2048, 1024, 64) == 128
  # batch-1 refresh (160 per expert): with the planned router skew the popular experts pass 256 rows and take a
  # second 256-row tile; 128-row tiles pad those less.
  assert moe.grouped_block_m(10240, 2048, 1024, 64) == 128
  # 16 rows per expert: reading the weights bounds every tile up to 128, and 128's grid is half 64's.
  assert moe.grouped_block_m(1024, 2048, 1024, 64) == 128


def test_forward_time_adds_the_charges():
  mod = realistic.Module(_MODULE)
  ch = realistic.H200
  t = realistic.forward_time({"bytes": 1e9, "flops": 0.0}, mod, ch)
  k = realistic.kernels(mod, ch)
  # Every kernel moves its operands and result: 14 f32[8] fusions and 2 copies of 64 bytes, the f32[4, 64]
  # copy, and the gather: its indices, and the 4 rows it reads and writes (not the table).
  moved = 13 * 64 + 64 + (1024 + 1024) + (16 + 1024 + 1024)
  assert t["realistic_bytes"] == moved and t["overcount_bytes"] == 1e9 - moved
  assert t["realistic_s"] == pytest.approx(moved / (4.3e12 * ch.efficiency.memory_bw) + k.overhead_s(ch))
  assert t["kernels"] == 16 and t["grouped_gemm_calls"] == 0


def test_host_syncs_of_nested_data_dependent_loops():
  text = """HloModule loops

%branch_a (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}

%step_body (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  %i = s32[] constant(0)
  ROOT %k = f32[8]{0} conditional(%i, %c, %c), branch_computations={%branch_a, %branch_a}
}

%step_cond (c: f32[8]) -> pred[] {
  %c = f32[8]{0} parameter(0)
  ROOT %k = pred[] constant(true)
}

%block_body (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%c), condition=%step_cond, body=%step_body
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%x), condition=%step_cond, body=%block_body
}
"""
  s = realistic.host_syncs(realistic.Module(text))
  assert (s.per_step, s.per_block, s.per_step_max, s.step_loops) == (2, 1, 2, 1)


def test_host_syncs_take_the_path_of_a_block_whose_forwards_are_known():
  """The loop as engine.loop compiles it with a vicinity warm-up: the block body picks (1 read) the warm-up
  loop (a switch per step: 2 reads) or the known path: a refresh under a conditional (1 read), then the
  cached loop (1 read per step)."""
  text = """HloModule loops

%fwd (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}

%c (c: f32[8]) -> pred[] {
  %c = f32[8]{0} parameter(0)
  ROOT %k = pred[] constant(true)
}

%switch_body (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  %i = s32[] constant(0)
  ROOT %k = f32[8]{0} conditional(%i, %c, %c), branch_computations={%fwd, %fwd}
}

%cached_body (c: f32[8]) -> f32[8] {
  ROOT %c = f32[8]{0} parameter(0)
}

%warming (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%c), condition=%c, body=%switch_body
}

%known (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  %t = pred[] constant(true)
  %r = f32[8]{0} conditional(%t, %c, %c), branch_computations={%fwd, %fwd}
  ROOT %w = f32[8]{0} while(%r), condition=%c, body=%cached_body
}

%block_body (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  %t = pred[] constant(true)
  ROOT %k = f32[8]{0} conditional(%t, %c, %c), branch_computations={%warming, %known}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%x), condition=%c, body=%block_body
}
"""
  s = realistic.host_syncs(realistic.Module(text))
  assert (s.per_step, s.per_block, s.per_step_max, s.step_loops) == (1, 3, 2, 2)


# The generate program's shape (engine.loop): the block loop's body copies the cache (its own kernel), runs
# the block-entry iteration under a conditional (the refresh branch has 3 kernels, the other 1) and then the
# step loop, whose body (2 fusions, one calling a helper) picks nothing at run time.
_GENERATE = """HloModule gen

%fused_a (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %t = f32[8]{0} tanh(%p)
}

%fused_b (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %t = f32[8]{0} exponential(%p)
}

%cond (c: f32[8]) -> pred[] {
  %c = f32[8]{0} parameter(0)
  ROOT %k = pred[] constant(true)
}

%refresh (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  %a = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused_a
  %b = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_b
  ROOT %d = f32[8]{0} fusion(%b), kind=kLoop, calls=%fused_a
}

%skip (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  ROOT %a = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused_b
}

%step (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  %a = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused_a
  ROOT %b = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_b
}

%block (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  %k = f32[8]{0} copy(%c)
  %t = pred[] constant(true)
  %r = f32[8]{0} conditional(%t, %k, %k), true_computation=%refresh, false_computation=%skip
  ROOT %w = f32[8]{0} while(%r), condition=%cond, body=%step
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%x), condition=%cond, body=%block
}
"""


def test_loop_parts_find_each_iteration_of_the_generate_program():
  mod = realistic.Module(_GENERATE)
  parts = realistic.loop_parts(mod)
  assert parts == realistic.LoopParts(block="block", entry="refresh", step="step", step_fixed=True)
  assert realistic.reachable(mod, "step") == ["step", "fused_a", "fused_b"]
  sub = realistic.Module(realistic.subprogram(_GENERATE, "refresh"))
  assert sub.entry == "refresh" and set(sub.comps) == {"refresh", "fused_a", "fused_b"}
  assert realistic.kernels(sub, realistic.H200).total == 3
  assert realistic.kernels(mod, realistic.H200, "block").total == 1 + 3 + 1 + 2  # every branch, the loop once
  own = realistic.own_time(mod, "block", realistic.H200)
  # Its own kernel is the copy alone: 32 bytes read, 32 written, one floor (a lone kernel launches alone).
  assert own["kernels"] == 1 and own["realistic_bytes"] == 64
  k = realistic.kernels(mod, realistic.H200, "block", nested=False)
  assert own["realistic_s"] == pytest.approx(64 / (realistic.H200.hbm_bytes_per_s * realistic.H200.efficiency.memory_bw)
                                             + k.overhead_s(realistic.H200))
  # A step that picks its forward at run time is not one iteration of a known kind.
  switching = _GENERATE.replace("ROOT %b = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_b",
                                "%t = pred[] constant(true)\n  ROOT %b = f32[8]{0} conditional(%t, %a, %a), "
                                "true_computation=%refresh, false_computation=%skip")
  assert not realistic.loop_parts(realistic.Module(switching)).step_fixed
  assert realistic.loop_parts(realistic.Module(_MODULE)) is None  # no data-dependent loop


def test_realistic_prediction_by_hand():
  """tiny preset: G 64, L 16 -> 4 blocks; at TPF 3.2 20 forwards: 4 refreshes + 16 cached (4 per block)."""
  def row(kind, ideal, real, step):
    return {"batch": 1, "cache": "dual", "kind": kind, "roofline_ms": ideal, "floor_ms": ideal / 2,
            "realistic_ms": real, "step_ms": step}
  rows = [row("refresh", 2.0, 3.0, 0.5), row("cached", 1.0, 1.5, 0.25),
          {"batch": 1, "cache": "dual", "kind": "generate", "host_syncs_per_step": 2, "host_syncs_per_block": 1}]
  p = roofline.predict(rows, "tiny", 3.2, realistic.H200)[0]
  ideal_s = 1e-3 * (4 * 2.0 + 16 * 1.0)
  assert p["predicted_tps_per_seq"] == pytest.approx(64 / ideal_s)
  sync = 15e-6
  real_s = 4 * (3.5e-3 + 2 * sync + sync) + 16 * (1.75e-3 + 2 * sync)
  assert p["realistic_tps_per_seq"] == pytest.approx(64 / real_s)
  assert p["host_syncs_per_step"] == 2
  assert p["realistic_source"] == "composed forwards" and p["composed_realistic_tps_per_seq"] == p["realistic_tps_per_seq"]
  # With the generate program's own iterations the realistic figure is theirs; the composed one stays beside it.
  rows[2].update(loop_step_fixed=True, loop_entry_ms=4.0, loop_step_ms=2.0, loop_block_ms=0.5)
  q = roofline.predict(rows, "tiny", 3.2, realistic.H200)[0]
  loop_s = 4 * (4.0e-3 + 2 * sync + 0.5e-3 + sync) + 16 * (2.0e-3 + 2 * sync)
  assert q["realistic_tps_per_seq"] == pytest.approx(64 / loop_s) and q["realistic_source"] == "generate program"
  assert q["composed_realistic_tps_per_seq"] == pytest.approx(64 / real_s)
  rows[2]["loop_step_fixed"] = False  # a step of either kind: only the composed figure knows their mix
  assert roofline.predict(rows, "tiny", 3.2, realistic.H200)[0]["realistic_tps_per_seq"] == pytest.approx(64 / real_s)


def test_bad_charges():
  with pytest.raises(ValueError, match="Charges.hbm_bytes_per_s"):
    realistic.Charges(hbm_bytes_per_s=0)
  with pytest.raises(ValueError, match="Charges.sync_us"):
    realistic.Charges(sync_us=-1)
  with pytest.raises(ValueError, match="Efficiency.grouped_bw"):
    realistic.Efficiency(grouped_bw=1.5)
  with pytest.raises(ValueError, match="case 'typical'"):
    realistic.charges_for(realistic.hardware.CHIPS["h200"], "typical")


# The block entry of a smoothing program (engine.loop): the entry runs its forward (one fusion) and then one
# of two widths of the LM head + soft embedding, picked per block by a conditional: 3 kernels wide (refresh),
# 1 narrow (skip).
_GENERATE_TAIL = _GENERATE.replace("%block (c: f32[8])", """%tail_entry (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  %a = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused_a
  %i = s32[] constant(1)
  ROOT %r = f32[8]{0} conditional(%i, %a, %a), branch_computations={%refresh, %skip}
}

%block (c: f32[8])""").replace("true_computation=%refresh", "true_computation=%tail_entry")


def test_block_entry_is_costed_by_how_often_each_branch_runs():
  """A conditional of the block entry costs each branch as often as it runs: by hand, the wide branch's entry
  is 1 + 3 kernels, the narrow one's 1 + 1, each launched alone (2.5 us: no run of 5 between the control
  flow); at shares 3/4 and 1/4 that is 3.5 kernels and 8.75 us (the 64-byte fusions' bytes are 1e-11 s).
  Costed as the cost analysis and the kernel count see the conditional, it would be 5 kernels, 12.5 us."""
  mod = realistic.Module(_GENERATE_TAIL)
  parts = realistic.loop_parts(mod)
  assert parts.entry == "tail_entry" and realistic.conditionals(mod, "tail_entry") == [("r", ["refresh", "skip"])]
  narrow = realistic.specialize(_GENERATE_TAIL, "tail_entry", "r", 1)
  assert "ROOT %r = f32[8]{0} call(%a), to_apply=%skip" in narrow
  assert realistic.kernels(realistic.Module(realistic.subprogram(narrow, "tail_entry")), realistic.H200).total == 2
  assert realistic.kernels(realistic.Module(realistic.subprogram(_GENERATE_TAIL, "tail_entry")),
                           realistic.H200).total == 5
  out = roofline.loop_costs(_GENERATE_TAIL, realistic.H200, {"entry": (0.75, 0.25)})
  assert out["loop_entry_kernels"] == pytest.approx(3.5)
  assert out["loop_entry_ms"] == pytest.approx(8.75e-3, rel=1e-3)
  assert out["loop_entry_branch_ms"] == pytest.approx([10e-3, 5e-3], rel=1e-3)
  # Without the shares the entry's cost is unknown: a clear error, not the most expensive branch.
  with pytest.raises(ValueError, match="shares gives None"):
    roofline.loop_costs(_GENERATE_TAIL, realistic.H200)
  # A step loop whose one conditional is chosen per block (no cache: every step is a full forward) is costed
  # the same way, and is then one iteration of a known kind: 1 + 3 or 1 + 1 kernels, 10 or 5 us.
  per_block = _GENERATE.replace("ROOT %b = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_b",
                                "%i = s32[] constant(0)\n  ROOT %b = f32[8]{0} conditional(%i, %a, %a), "
                                "branch_computations={%refresh, %skip}")
  out = roofline.loop_costs(per_block, realistic.H200, {"step": (0.5, 0.5)})
  assert out["loop_step_fixed"] and out["loop_step_ms"] == pytest.approx(7.5e-3, rel=1e-3)
  assert not roofline.loop_costs(per_block, realistic.H200)["loop_step_fixed"]  # a per-step choice, unweighted
  with pytest.raises(ValueError, match="no conditional named 'q'"):
    realistic.specialize(_GENERATE_TAIL, "tail_entry", "q", 0)
  with pytest.raises(ValueError, match="no branch 2"):
    realistic.specialize(_GENERATE_TAIL, "tail_entry", "r", 2)


def test_a_tpu_dma_into_vmem_is_charged_once():
  """A TPU module: an async slice copies 4 MB of an 8 MB HBM buffer into VMEM (memory space S(1)); the fusion
  that reads it there and writes 1 KB to HBM reads no HBM itself. Charged: the 4 MB once (at the start, the
  done launches nothing) and the fusion's 1 KB; XLA's cost analysis would see the VMEM reads as bytes too."""
  text = """HloModule tpu

%fused_neg (p: f32[1048576]) -> f32[256] {
  %p = f32[1048576]{0:T(1024)S(1)} parameter(0)
  %s = f32[256]{0:T(256)} slice(%p), slice={[0:256]}
  ROOT %n = f32[256]{0:T(256)} negate(%s)
}

ENTRY %main (w: s8[8388608]) -> f32[256] {
  %w = s8[8388608]{0:T(1024)} parameter(0)
  %ss = ((s8[8388608]{0:T(1024)}), s8[4194304]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:4194304]}
  %sd = s8[4194304]{0:T(1024)S(1)} slice-done(%ss)
  %b = f32[1048576]{0:T(1024)S(1)} bitcast(%sd)
  ROOT %f = f32[256]{0:T(256)} fusion(%b), kind=kLoop, calls=%fused_neg
}
"""
  mod = realistic.Module(text)
  costs = {k.name: k.bytes for k in realistic.kernel_costs(mod, realistic.CHARGES["v6e"])}
  assert costs == {"ss": 4194304, "f": 1024}
  assert realistic.kernels(mod, realistic.CHARGES["v6e"]).total == 2


def test_tpu_op_floors_by_where_the_op_runs():
  """On a TPU an op pays the fill and drain of its HBM pipeline (1 us central), an op wholly in VMEM a smaller
  floor (0.25 us), a DMA's start none (its bytes are charged). A GPU's charges floor each the same (a launch)."""
  text = """HloModule tpu

%fused_neg (p: f32[1048576]) -> f32[256] {
  %p = f32[1048576]{0:T(1024)S(1)} parameter(0)
  %s = f32[256]{0:T(256)} slice(%p), slice={[0:256]}
  ROOT %n = f32[256]{0:T(256)} negate(%s)
}

%fused_abs (q: f32[256]) -> f32[256] {
  %q = f32[256]{0:T(256)S(1)} parameter(0)
  ROOT %a = f32[256]{0:T(256)S(1)} abs(%q)
}

ENTRY %main (w: s8[8388608]) -> f32[256] {
  %w = s8[8388608]{0:T(1024)} parameter(0)
  %ss = ((s8[8388608]{0:T(1024)}), s8[4194304]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:4194304]}
  %sd = s8[4194304]{0:T(1024)S(1)} slice-done(%ss)
  %b = f32[1048576]{0:T(1024)S(1)} bitcast(%sd)
  %v = f32[256]{0:T(256)S(1)} slice(%b), slice={[0:256]}
  %g = f32[256]{0:T(256)S(1)} fusion(%v), kind=kLoop, calls=%fused_abs
  ROOT %f = f32[256]{0:T(256)} fusion(%b), kind=kLoop, calls=%fused_neg
}
"""
  mod = realistic.Module(text)
  v6e = realistic.CHARGES["v6e"]
  k = realistic.kernels(mod, v6e)
  assert (k.total, k.dma, k.on_chip, k.separate) == (4, 1, 2, 1)  # the start; slice and abs in VMEM; the neg
  assert k.overhead_s(v6e) == pytest.approx(1e-6 * (0.0 + 2 * 0.25 + 1.0))
  slow, fast = realistic.RANGES["v6e"]
  assert k.overhead_s(slow) == pytest.approx(1e-6 * (2 * 0.5 + 1.5))
  assert k.overhead_s(fast) == pytest.approx(1e-6 * (2 * 0.1 + 0.5))
  gpu = realistic.kernels(mod, realistic.H200)
  assert (gpu.total, gpu.dma, gpu.on_chip) == (4, 0, 0)
  assert gpu.overhead_s(realistic.H200) == pytest.approx(4 * 2.5e-6)  # four launches, no graph of 5
  with pytest.raises(ValueError, match="on_chip_us"):
    dataclasses.replace(v6e, on_chip_us=-1.0)


def test_collectives_are_charged_over_the_link_by_their_group():
  """A partitioned program's collectives: each sends its ring share of its result bytes over the link (an
  all-reduce among 4 devices 2 x 3/4 of them, an all-gather among 2 half) plus a latency each; they are not
  HBM bytes. Without a link (one chip's charges) they stay ordinary kernels."""
  text = """HloModule slice

ENTRY %main (p: bf16[64,2048], y: bf16[4,16]) -> (bf16[64,2048], bf16[8,16]) {
  %p = bf16[64,2048]{1,0} parameter(0)
  %y = bf16[4,16]{1,0} parameter(1)
  %ars = bf16[64,2048]{1,0} all-reduce-start(%p), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
  %ard = bf16[64,2048]{1,0} all-reduce-done(%ars)
  %ag = (bf16[4,16]{1,0}, bf16[8,16]{1,0}) all-gather-start(%y), channel_id=3, replica_groups={{0,1},{2,3}}, dimensions={0}
  %agd = bf16[8,16]{1,0} all-gather-done(%ag)
  ROOT %t = (bf16[64,2048]{1,0}, bf16[8,16]{1,0}) tuple(%ard, %agd)
}
"""
  mod = realistic.Module(text)
  ch = dataclasses.replace(realistic.CHARGES["v6e"], link_bytes_per_s=1e11, collective_us=5.0)
  costs = {k.name: k for k in realistic.kernel_costs(mod, ch)}
  assert {n: k.cls for n, k in costs.items()} == {"ars": "collective", "ag": "collective"}
  assert costs["ars"].bytes == pytest.approx(2 * 3 / 4 * 64 * 2048 * 2)
  assert costs["ag"].bytes == pytest.approx(1 / 2 * 8 * 16 * 2)
  c = realistic.charged(list(costs.values()), ch)
  assert c["bytes"] == 0 and c["link_bytes"] == pytest.approx(costs["ars"].bytes + costs["ag"].bytes)
  assert c["by_class_s"]["collective"] == pytest.approx(c["link_bytes"] / 1e11 + 2 * 5e-6)
  one_chip = {k.cls for k in realistic.kernel_costs(mod, realistic.CHARGES["v6e"])}
  assert "collective" not in one_chip
  with pytest.raises(ValueError, match="link_bytes_per_s"):
    dataclasses.replace(ch, link_bytes_per_s=0.0)


def test_tpu_grouped_matmuls_are_charged_their_work_items():
  """XLA TPU's ragged dot and this project's Mosaic kernel both walk (row tile, group) items, each reading its
  group's weights: 10240 rows in 40 tiles of 256 over 64 groups (all of them busy at this many rows) make
  40 + 64 - 1 = 103 weight reads, read off the ragged dot's metadata tables (sized tiles + G - 1) and off
  the Mosaic kernel's name (its tile)."""
  ragged = ('%d = bf16[10240,1024]{1,0} custom-call(%t, %i, %g, %n, %lhs, %rhs), custom_call_target="tpu_custom_call", '
            'metadata={op_name="jit(f)/ragged_dot_general/ragged-dot-none"}')
  ours = ('%d = bf16[10240,1024]{1,0} custom-call(%i, %g, %r, %st, %sz, %lhs, %rhs), custom_call_target="tpu_custom_call", '
          'metadata={op_name="jit(f)/dinfer_gmm_tpu_bm256/pallas_call"}')
  params = """  %t = s32[65]{0} parameter(0)
  %i = s32[103]{0} parameter(1)
  %g = s32[103]{0} parameter(2)
  %n = s32[1]{0} parameter(3)
  %r = s32[103]{0} parameter(4)
  %st = s32[64]{0} parameter(5)
  %sz = s32[64]{0} parameter(6)
  %lhs = bf16[10240,2048]{1,0} parameter(7)
  %rhs = bf16[64,2048,1024]{2,1,0} parameter(8)
"""
  wb = 2048 * 1024 * 2
  for line in (ragged, ours):
    text = f"HloModule m\n\nENTRY %main () -> bf16[10240,1024] {{\n{params}  ROOT {line}\n}}\n"
    mod = realistic.Module(text)
    c = realistic.grouped_call(mod, "bf16[10240,1024]{1,0}", line.split(" custom-call", 1)[1], realistic.CHARGES["v6e"])
    busy = 64 - realistic.idle_groups(10240, 64)
    assert c["weight_bytes"] == 64 * wb
    assert c["weight_bytes_read"] == pytest.approx((40 + busy - 1) * wb) and busy > 63.99


def test_tpu_splash_attention_is_charged_its_products():
  """Pallas's splash kernel on a TPU, known by its name: 4 B N T S H FLOPs from q [B, N, T, H] and k [B, N,
  S, H] (its 8-bit mask tables aside), in the attention class."""
  text = """HloModule m

ENTRY %main (a: s8[1,1,5], q: bf16[2,4,96,128], k: bf16[2,4,1280,128], v: bf16[2,4,1280,128]) -> bf16[2,4,96,128] {
  %a = s8[1,1,5]{2,1,0} parameter(0)
  %q = bf16[2,4,96,128]{3,2,1,0} parameter(1)
  %k = bf16[2,4,1280,128]{3,2,1,0} parameter(2)
  %v = bf16[2,4,1280,128]{3,2,1,0} parameter(3)
  ROOT %splash_mha_fwd_segmented_no_residuals.3 = bf16[2,4,96,128]{3,2,1,0} custom-call(%a, %a, %q, %k, %v), custom_call_target="tpu_custom_call"
}
"""
  (k,) = realistic.kernel_costs(realistic.Module(text), realistic.CHARGES["v6e"])
  assert k.cls == "attention" and k.flops == 4.0 * 2 * 4 * 96 * 1280 * 128


def test_subprogram_keeps_an_instruction_whose_config_runs_over_lines():
  """Pallas's splash kernel prints its backend config over several lines, one starting with '}': the
  computation goes on to its own closing line."""
  text = """HloModule m

%body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %c = f32[8]{0} custom-call(%p), custom_call_target="tpu_custom_call", backend_config={"a":"{\\"x\\":
}"}
  ROOT %n = f32[8]{0} negate(%c)
}

ENTRY %main (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  ROOT %r = f32[8]{0} call(%q), to_apply=%body
}
"""
  sub = realistic.subprogram(text, "body")
  assert sub.splitlines()[-1] == "}" and "ROOT %n = f32[8]{0} negate(%c)" in sub
