"""The MoE's grouped GEMM kernel (model/grouped_gemm.py), run by Pallas's interpreter on CPU: against a plain
per-group loop in numpy, at every routing shape that exercises its grid (empty groups, one group holding every
row, groups of many tiles walked by few slots, rows not a multiple of the tile), with 8-bit weights and the
folded per-input scales; its plan by hand; and the MoE layer built on it against the loop-over-experts
reference, gradients included."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.bench import realistic
from dinfer_jax.model import grouped_gemm as gg
from dinfer_jax.model import moe, quant


def _silu(x):
  return x / (1.0 + np.exp(-x))


def loop_reference(x, ws, sizes, out_scale=None):
  """Rows [M, K] sorted by group; one plain matmul per group (numpy, float64)."""
  ws = [np.asarray(quant.dequantize(w, jnp.float32) if quant.is_qarray(w) else w, np.float64) for w in ws]
  x = np.asarray(x, np.float64)
  out = np.zeros((x.shape[0], ws[0].shape[2]))
  lo = 0
  for g, n in enumerate(sizes):
    ys = [x[lo:lo + n] @ w[g] for w in ws]
    y = _silu(ys[0]) * ys[1] if len(ws) == 2 else ys[0]
    if out_scale is not None:
      y = y * np.asarray(out_scale[g, 0], np.float64)
    out[lo:lo + n] = y
    lo += n
  return out


def _run(x, ws, sizes, p, **kw):
  """The kernel on x padded by block_m rows (as the MoE gathers them), rows [0, M) returned."""
  M = x.shape[0]
  xp = jnp.concatenate([x, jnp.zeros((p.block_m, x.shape[1]), x.dtype)])
  ids = jnp.repeat(jnp.arange(len(sizes)), jnp.asarray(sizes), total_repeat_length=M)
  lo, hi = gg.group_bounds(ids, len(sizes))
  return gg.grouped_matmul(xp, tuple(ws), lo, hi, p, interpret=True, **kw)[:M]


ROUTINGS = {
    "even": [5, 7, 6, 6],
    "empty_groups": [0, 17, 0, 3],
    "one_group_takes_all": [0, 0, 40, 0],
    "single_rows": [1, 1, 1, 1],
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("n_weights", [1, 2])
@pytest.mark.parametrize("plan", [gg.Plan(16, 1), gg.Plan(16, 2), gg.Plan(32, 3)], ids=["bm16x1", "bm16x2", "bm32x3"])
def test_grouped_matmul_matches_a_loop_over_groups(routing, n_weights, plan):
  sizes = ROUTINGS[routing]
  rng = np.random.default_rng(len(sizes) + sum(sizes))
  G, K, N, M = len(sizes), 64, 256, sum(sizes)
  x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
  ws = [jnp.asarray(rng.normal(size=(G, K, N)) / 8, jnp.float32) for _ in range(n_weights)]
  out = _run(x, ws, sizes, plan)
  np.testing.assert_allclose(np.asarray(out), loop_reference(x, ws, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["int8", "fp8"])
def test_eight_bit_kernels_and_folded_input_scales(spec):
  """Per-output-channel 8-bit gate/up read as stored and scaled in the epilogue; a [G, 1, N] out_scale (the
  down projection's per-input scales) applied to the result."""
  rng = np.random.default_rng(3)
  sizes, K, N = [9, 0, 20], 64, 128
  G, M = len(sizes), sum(sizes)
  qc = quant.QuantConfig.parse(spec)
  ws = [quant.quantize_leaf(("experts", "gate"), jnp.asarray(rng.normal(size=(G, K, N)) / 8, jnp.float32), qc)
        for _ in range(2)]
  assert all(gg.supports(w) for w in ws) and ws[0].qvalue.dtype == qc.qtype
  out_scale = jnp.asarray(rng.uniform(0.5, 2.0, size=(G, 1, N)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
  out = _run(x, ws, sizes, gg.plan(M, G, K, N, 2), out_scale=out_scale)
  np.testing.assert_allclose(np.asarray(out), loop_reference(x, ws, sizes, out_scale), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
  x = jnp.zeros((32, 64))
  lo = hi = jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match="one kernel or two"):
    gg.grouped_matmul(x, (), lo, hi, gg.Plan(16, 1), interpret=True)
  with pytest.raises(ValueError, match=r"x \[32, 64\] against kernels \[\(4, 32, 128\)\]"):
    gg.grouped_matmul(x, (jnp.zeros((4, 32, 128)),), lo, hi, gg.Plan(16, 1), interpret=True)
  with pytest.raises(ValueError, match=r"out_scale \(4, 128, 1\) is not \[4, 1, 128\]"):
    gg.grouped_matmul(x, (jnp.zeros((4, 64, 128)),), lo, hi, gg.Plan(16, 1), out_scale=jnp.ones((4, 128, 1)),
                      interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    gg.Plan(24, 1)
  w8 = jnp.zeros((4, 64, 128), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="8-bit x .* needs its row_scale"):
    gg.grouped_matmul(x.astype(jnp.float8_e4m3fn), (w8,), lo, hi, gg.Plan(16, 1), interpret=True)
  with pytest.raises(ValueError, match="row_scale needs x in the weights' 8-bit type"):
    gg.grouped_matmul(x.astype(jnp.int8), (w8,), lo, hi, gg.Plan(16, 1), row_scale=jnp.ones((32,)), interpret=True)
  with pytest.raises(ValueError, match=r"row_scale \(16,\) is neither \[32\]"):
    gg.grouped_matmul(x.astype(jnp.float8_e4m3fn), (w8,), lo, hi, gg.Plan(16, 1), row_scale=jnp.ones((16,)),
                      interpret=True)
  block = quant.quantize_leaf(("experts", "gate"), jnp.ones((4, 256, 256)), quant.QuantConfig.parse("fp8-block"))
  assert not gg.supports(block)


def test_group_bounds_by_hand():
  lo, hi = gg.group_bounds(jnp.asarray([2, 0, 2, 3, 0, 2]), 4)
  assert lo.tolist() == [0, 2, 2, 5] and hi.tolist() == [2, 2, 5, 6]


def test_expected_tiles_against_sampled_routing():
  """The expected tiles, groups with rows, passes and longest group of a call, against routing sampled in a
  plain loop (rows pick groups independently with the skewed popularity), and exactly by hand for two rows
  over two groups."""
  M, G, bm, slots, skew = 40, 4, 8, 2, 0.5
  p = gg.popularity(G, skew)
  assert p.sum() == pytest.approx(1.0) and p.std() / p.mean() == pytest.approx(skew, rel=0.35)
  rng = np.random.default_rng(0)
  sums = np.zeros(4)
  trials = 20000
  for _ in range(trials):
    n = np.bincount(rng.choice(G, size=M, p=p), minlength=G)
    t = np.ceil(n / bm)
    steps = np.ceil(t / slots)
    sums += (t.sum(), (n > 0).sum(), steps.sum(), steps.max())
  e = gg.expected_tiles(M, G, bm, skew, slots)
  got = np.array([e["tiles"], e["busy"], e["passes"], e["max_passes"]])
  # The longest group takes the groups as independent (they are not quite: their rows sum to M).
  np.testing.assert_allclose(got, sums / trials, rtol=0.02)
  # Two rows, two groups, 1-row tiles: a group gets 0, 1 or 2 rows with probability 1/4, 1/2, 1/4.
  e = gg.expected_tiles(2, 2, 1)
  assert (e["tiles"], e["busy"], e["passes"]) == pytest.approx((2.0, 1.5, 2.0))
  assert e["max_passes"] == pytest.approx(1 * (0.75 ** 2 - 0.25 ** 2) + 2 * (1 - 0.75 ** 2))


def test_plan_and_tiles_by_hand():
  """LLaDA-MoE-7B-A1B's shapes (64 experts, top-8, gate/up 2048 -> 1024): rows per expert 12 (batch-1 cached
  window of 96 tokens), 96 (batch-8 cached), 160 (batch-1 refresh), 1280 (batch-8 refresh)."""
  plan = lambda M: gg.plan(M, 64, 2048, 1024, 2)  # noqa: E731
  # 12 rows: a 16-row tile holds the average expert, but with the planned skew 1 in 5 experts passes 16 rows
  # and reads its weights twice; a 32-row tile reads them once.
  assert plan(768) == gg.Plan(32, 1)
  assert gg.expected_tiles(768, 64, 16, gg.PLAN_SKEW)["passes"] > 1.2 * 64
  assert gg.expected_tiles(768, 64, 32, gg.PLAN_SKEW)["passes"] < 1.02 * 64
  # 96 rows: 128-row tiles with two slots, so an expert that passes 128 rows is walked by two blocks side by
  # side (its weights read once, shared through L2).
  assert plan(6144) == gg.Plan(128, 2)
  e = gg.expected_tiles(6144, 64, 128, gg.PLAN_SKEW, 2)
  assert e["tiles"] > 1.2 * 64 and e["passes"] < 1.02 * 64
  assert plan(10240) == gg.Plan(64, 6)
  assert plan(81920) == gg.Plan(64, 20)
  # The batch-1 refresh's gate/up kernel with a uniform router: 3 tiles of 64 per expert (192 rows for 160),
  # on 6 slots: every group in one pass, half the launched blocks with rows.
  t = gg.tiles(10240, 2048, 1024, 64, n_weights=2, p=gg.Plan(64, 6))
  assert t["padded_flops"] / t["routed_flops"] == pytest.approx(192 / 160, rel=1e-3)
  assert t["routed_flops"] == 2 * 2 * 10240 * 2048 * 1024
  assert t["weight_tiles"] == pytest.approx(64) and t["blocks"] == 6 * 8 * 64
  assert t["working_blocks"] == pytest.approx(3 * 8 * 64, rel=1e-3)
  assert gg.tiles(81920, 2048, 1024, 64, n_weights=2, p=gg.Plan(256, 5))["blocks"] == 5 * 16 * 64
  # tokamax's grid for the same gate projection at its 256-row tile: 40 x 8 x 64 blocks, 512 with rows.
  tok = moe.grouped_tiles(10240, 2048, 1024, 64, 256, skew=0.0)
  assert tok["blocks"] == 40 * 8 * 64 and tok["working_blocks"] == pytest.approx(64 * 8)


def test_realistic_model_reads_the_kernel_off_its_custom_call():
  """The charges of a hand-written custom call as XLA prints the kernel (name, grid, operands)."""
  line = ('%pallas_call.1 = bf16[784,1024]{1,0} custom-call(%x, %g, %u, %lo, %hi), '
          'custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={bf16[784,2048]{1,0}, '
          'bf16[64,2048,1024]{2,1,0}, bf16[64,2048,1024]{2,1,0}, s32[64]{0}, s32[64]{0}}, '
          'metadata={op_name="jit(f)/dinfer_grouped_swiglu_bm16_m768/pallas_call"}, '
          'backend_config={debug = false, grid_x = 1 : i32, grid_y = 8 : i32, grid_z = 64 : i32, ir = "ML"}')
  ins = realistic.arrays(line.split("operand_layout_constraints=")[1].split("}, metadata")[0])
  own = realistic.own_grouped_call(line, ins, realistic.arrays("bf16[784,1024]"))
  assert own == {"M": 768, "K": 2048, "N": 1024, "G": 64, "n_weights": 2, "block_m": 16, "slots": 1}
  from dinfer_jax.bench import roofline
  assert roofline.kernel_call_cost(line)["flops"] == 2 * 2 * 768 * 2048 * 1024
  params = [f"  %{n} = {s} parameter({i})" for i, (n, s) in enumerate(
      (("x", "bf16[784,2048]"), ("g", "bf16[64,2048,1024]"), ("u", "bf16[64,2048,1024]"), ("lo", "s32[64]"),
       ("hi", "s32[64]")))]
  text = "\n".join(["HloModule m", "", "ENTRY %main (x: bf16[784,2048]) -> bf16[784,1024] {", *params,
                     "  ROOT " + line, "}", ""])
  uniform = dataclasses.replace(realistic.H200, skew=0.0)
  g = realistic.grouped_gemms(realistic.Module(text), uniform)
  assert g.calls == 1 and g.blocks == 512 and g.working_blocks == pytest.approx(512, rel=1e-3)
  # A 16-row tile for 12 rows per expert: Binomial(768, 1/64) passes 16 rows for about 1 expert in 10, which
  # then reads its weights twice.
  e = gg.expected_tiles(768, 64, 16)
  assert g.weight_bytes_over == pytest.approx((e["passes"] - 64) * 2 * 2048 * 1024 * 2)
  assert 0.05 * 64 < e["passes"] - 64 < 0.15 * 64


def _layer(T=21, E=8, D=64, F=128, k=2, seed=0):
  rng = np.random.default_rng(seed)
  ex = {n: jnp.asarray(rng.normal(size=s) / 8, jnp.float32)
        for n, s in (("gate", (E, D, F)), ("up", (E, D, F)), ("down", (E, F, D)))}
  h = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  w, idx = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.normal(size=(T, E)), jnp.float32)), k)
  return h, w, idx.astype(jnp.int32), ex, E


def test_moe_layer_on_the_kernel_matches_the_loop_over_experts():
  h, w, idx, ex, E = _layer()
  ref = moe.moe_loop_reference(h, w, idx, ex, E)
  out = jax.jit(lambda h, w, idx, ex: moe.experts_grouped(h, w, idx, ex, E))(h, w, idx, ex)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  # Every token on the same two experts: one group walks several tiles.
  same = jnp.broadcast_to(jnp.asarray([3, 5], jnp.int32), idx.shape)
  np.testing.assert_allclose(moe.experts_grouped(h, w, same, ex, E), moe.moe_loop_reference(h, w, same, ex, E),
                             rtol=1e-5, atol=1e-5)
  for spec in ("int8", "fp8", "int8+a8:0", "fp8+a8:0"):
    qex = quant.quantize_params({"moe_layers": [{"experts": ex}]}, quant.QuantConfig.parse(spec))
    qex = qex["moe_layers"][0]["experts"]
    assert grouped_gemm_taken(qex)
    np.testing.assert_allclose(moe.experts_grouped(h, w, idx, qex, E), moe.moe_loop_reference(h, w, idx, qex, E),
                               rtol=1e-5, atol=1e-5)
  # 8-bit activations change the result (the reference rounds the same rows the kernels do).
  a8 = quant.quantize_params({"moe_layers": [{"experts": ex}]}, "fp8+a8:0")["moe_layers"][0]["experts"]
  w8 = quant.quantize_params({"moe_layers": [{"experts": ex}]}, "fp8")["moe_layers"][0]["experts"]
  assert float(jnp.abs(moe.experts_grouped(h, w, idx, a8, E) - moe.experts_grouped(h, w, idx, w8, E)).max()) > 1e-3


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_grouped_kernels_with_a_scale_per_128_columns(scheme):
  """"+a8g": each token's input and each routed row's down input rounded with a scale per 128 columns (two
  runs of D = F = 256); the kernels scale each K step's product by its run's scale and match the loop
  reference, which rounds the same runs. With one outlier channel int8's runs keep the other run's rounding
  fine: closer to the unrounded layer than one scale per token."""
  h, w, idx, ex, E = _layer(T=16, E=4, D=256, F=256, k=2, seed=4)
  h = h.at[:, 5].multiply(60.0)  # an outlier channel in the first run
  q = {}
  for spec in (f"{scheme}+a8g:0", f"{scheme}+a8:0", scheme):
    q[spec] = quant.quantize_params({"moe_layers": [{"experts": ex}]}, spec)["moe_layers"][0]["experts"]
  grouped = q[f"{scheme}+a8g:0"]
  assert quant.act_group(grouped["gate"]) == 128 and grouped_gemm_taken(grouped)
  out = moe.experts_grouped(h, w, idx, grouped, E)
  np.testing.assert_allclose(out, moe.moe_loop_reference(h, w, idx, grouped, E), rtol=1e-5, atol=1e-4)
  exact = moe.moe_loop_reference(h, w, idx, q[scheme], E)  # weight-only: the activations unrounded
  err = lambda y: float(jnp.abs(y - exact).mean())  # noqa: E731
  per_token = moe.experts_grouped(h, w, idx, q[f"{scheme}+a8:0"], E)
  if scheme == "int8":  # FP8's exponent keeps small values fine under one scale; int8's steps do not
    assert err(out) < 0.8 * err(per_token)


def grouped_gemm_taken(ex) -> bool:
  return gg.supports(ex["gate"]) and gg.supports(ex["up"]) and gg.supports(ex["down"], per_input=True)


def test_moe_layer_on_the_kernel_has_the_reference_gradients():
  h, w, idx, ex, E = _layer(seed=1)
  loss = lambda f: (lambda h, w, ex: (f(h, w, idx, ex, E) ** 2).sum())  # noqa: E731
  got = jax.grad(loss(moe.experts_grouped), argnums=(0, 1, 2))(h, w, ex)
  want = jax.grad(loss(moe.moe_loop_reference), argnums=(0, 1, 2))(h, w, ex)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_gpu_picks_the_kernel_and_cpu_the_dense_einsum():
  from dinfer_jax.config import ModelConfig
  cfg = ModelConfig(family="llada_moe", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                    ffn_dim=0, n_experts=4, n_experts_per_tok=2, expert_ffn_dim=32)
  with moe.target_backend("gpu"):
    assert moe.choose_impl(cfg, 8) == moe.choose_impl(cfg, 4096) == "grouped"
  with moe.target_backend("cpu"):
    assert moe.choose_impl(cfg, 4096) == "dense"
  # A program partitioned over several devices keeps the dense einsums (the kernel has no partitioning rule).
  with moe.target_backend("gpu"), moe.partitioned():
    assert moe.choose_impl(cfg, 4096) == "dense"


# ----------------------------------------------------------------------------- routing in one kernel

def _align_reference(probs, k):
  """lax.top_k, then the stable sort by expert and the group bounds, as the XLA path does them."""
  w, idx = jax.lax.top_k(probs, k)
  flat = np.asarray(idx).reshape(-1)
  order = np.argsort(flat, kind="stable")
  dest = np.empty_like(order)
  dest[order] = np.arange(order.size)
  lo, hi = gg.group_bounds(jnp.asarray(flat), probs.shape[1])
  return w, idx, dest.reshape(idx.shape), order // k, lo, hi


@pytest.mark.parametrize("T,E,k", [(12, 8, 2), (1, 4, 2), (96, 64, 8), (33, 16, 4)])
def test_topk_align_matches_top_k_and_the_sort(T, E, k):
  rng = np.random.default_rng(T + E)
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(T, E)), jnp.float32))
  if T > 1:  # exact ties: lax.top_k takes the lower expert first
    probs = probs.at[0].set(1.0 / E).at[1, 1:3].set(probs[1, 0])
  bm = 16
  r = gg.topk_align(probs, k, bm, interpret=True)
  w, idx, dest, src, lo, hi = _align_reference(probs, k)
  Tp = 1 << max(0, (T - 1).bit_length())
  assert r.w.shape == r.idx.shape == r.dest.shape == (Tp, k)  # rows past T: padding
  np.testing.assert_array_equal(r.w[:T], w)
  np.testing.assert_array_equal(r.idx[:T], idx)
  np.testing.assert_array_equal(r.dest[:T], dest)
  np.testing.assert_array_equal(r.lo, lo)
  np.testing.assert_array_equal(r.hi, hi)
  M = T * k
  np.testing.assert_array_equal(r.src[:M], src)
  assert r.src.shape == (Tp * k + bm,) and not np.asarray(r.src[M:]).any()  # the rows past M: row 0


def test_topk_align_gradient_is_top_ks():
  probs = jax.nn.softmax(jnp.asarray(np.random.default_rng(1).normal(size=(10, 8)), jnp.float32))
  g = jnp.asarray(np.random.default_rng(2).normal(size=(10, 2)), jnp.float32)
  got = jax.grad(lambda p: (gg.topk_align(p, 2, 16, interpret=True).w[:10] * g).sum())(probs)
  want = jax.grad(lambda p: (jax.lax.top_k(p, 2)[0] * g).sum())(probs)
  np.testing.assert_array_equal(got, want)


def test_topk_align_fits_one_program_only():
  assert gg.align_fits(96, 64, 8) and gg.align_fits(256, 64, 8)
  assert not gg.align_fits(257, 64, 8)  # a refresh's tokens: the XLA routing
  assert not gg.align_fits(8, 48, 8) and not gg.align_fits(8, 64, 6)  # Triton tiles are powers of two
  with pytest.raises(ValueError, match="T=1280, E=64, k=8"):
    gg.topk_align(jnp.zeros((1280, 64)), 8, 16)


@pytest.mark.parametrize("n_weights", [1, 2])
def test_grouped_matmul_reads_rows_through_an_index_and_scales_them(n_weights):
  """rows= (topk_align's src): sorted row r is x[rows[r]], read by the kernel; x_scale multiplies x's columns
  as loaded (an RMSNorm weight). Against the loop on the gathered, scaled rows."""
  rng = np.random.default_rng(5)
  T, K, N, k, E = 11, 64, 128, 2, 4
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(T, E)), jnp.float32))
  p = gg.plan(T * k, E, K, N, n_weights)
  r = gg.topk_align(probs, k, p.block_m, interpret=True)
  x = jnp.asarray(rng.normal(size=(T, K)), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, size=(K,)), jnp.float32)
  ws = [jnp.asarray(rng.normal(size=(E, K, N)) / 8, jnp.float32) for _ in range(n_weights)]
  out = gg.grouped_matmul(x, tuple(ws), r.lo, r.hi, p, rows=r.src, routed_rows=T * k, x_scale=scale,
                          interpret=True)
  assert out.shape == (r.src.shape[0], N)
  sizes = np.asarray(r.hi - r.lo)
  want = loop_reference(np.asarray(x)[np.asarray(r.src[:T * k])] * np.asarray(scale), ws, sizes)
  np.testing.assert_allclose(np.asarray(out[:T * k]), want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="routed_rows"):
    gg.grouped_matmul(x, tuple(ws), r.lo, r.hi, p, rows=r.src, interpret=True)
  with pytest.raises(ValueError, match="x_scale"):
    gg.grouped_matmul(x, tuple(ws), r.lo, r.hi, p, rows=r.src, routed_rows=T * k, x_scale=scale[:8],
                      interpret=True)


def test_moe_ffn_routes_in_the_kernel_and_matches_the_reference():
  """moe_ffn on the grouped kernel with routing in topk_align and the norm weight applied in the GEMM's load,
  against the loop-over-experts reference on the weighted input; 8-bit experts too; gradients (input, norm
  weight, router, experts) against the reference's."""
  from dinfer_jax.config import ModelConfig
  from dinfer_jax.model.params import init_params
  cfg = ModelConfig(family="llada_moe", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                    head_dim=16, ffn_dim=0, n_experts=8, n_experts_per_tok=2, expert_ffn_dim=32)
  p = init_params(cfg, jax.random.PRNGKey(0))
  lp = jax.tree_util.tree_map(lambda x: x[0], p["moe_layers"])
  h = jax.random.normal(jax.random.PRNGKey(1), (2, 19, cfg.d_model))
  nw = 1.0 + 0.3 * jax.random.normal(jax.random.PRNGKey(2), (cfg.d_model,))
  assert moe.routes_in_kernel(cfg, 38, lp["experts"])
  ref = moe.moe_ffn(nw * h, lp, cfg, "loop")
  out = moe.moe_ffn(h, lp, cfg, "grouped", norm_w=nw)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(ref).max()) > 1e-2
  for spec in ("int8", "fp8", "int8+a8:0", "fp8+a8:0"):
    q = quant.quantize_params({"moe_layers": [lp]}, quant.QuantConfig.parse(spec))["moe_layers"][0]
    q = dict(lp, experts=q["experts"])
    np.testing.assert_allclose(moe.moe_ffn(h, q, cfg, "grouped", norm_w=nw), moe.moe_ffn(nw * h, q, cfg, "loop"),
                               rtol=1e-5, atol=1e-5)

  def loss(impl, fused):
    def f(h, nw, lp):
      y = moe.moe_ffn(h, lp, cfg, impl, norm_w=nw) if fused else moe.moe_ffn(nw * h, lp, cfg, impl)
      return (y ** 2).sum()
    return f
  got = jax.grad(loss("grouped", True), argnums=(0, 1, 2))(h, nw, lp)
  want = jax.grad(loss("loop", False), argnums=(0, 1, 2))(h, nw, lp)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T", [12, 13])  # 13: one token per program
def test_combine_normalize_matches_the_xla_combine_add_and_norm(T):
  from dinfer_jax.model.layers import rms_normalize
  rng = np.random.default_rng(T)
  E, k, D = 8, 2, 64
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(T, E)), jnp.float32))
  r = gg.topk_align(probs, k, 16, interpret=True)
  ys = jnp.asarray(rng.normal(size=(r.src.shape[0], D)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  xo, xn = gg.combine_normalize(ys, r.dest, r.w, x, 1e-6, interpret=True)
  want = x + gg.combine_rows(ys, r.dest[:T], r.w[:T])
  np.testing.assert_allclose(xo, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(xn, rms_normalize(want, 1e-6), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="combine_normalize"):
    gg.combine_normalize(ys[:, :48], r.dest, r.w, x, 1e-6, interpret=True)


def test_forward_on_the_grouped_kernels_matches_the_dense_forward():
  """The whole model with the MoE on the grouped kernels (routing in topk_align, the norm weight in the GEMM's
  load, each block's output normalised for the next norm in the combine's kernel) against the dense MoE:
  logits and the gradients of a loss."""
  from dinfer_jax.config import ModelConfig
  from dinfer_jax.model.params import init_params
  from dinfer_jax.model.transformer import forward
  cfg = ModelConfig(family="llada_moe", vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                    head_dim=16, ffn_dim=0, n_experts=8, n_experts_per_tok=2, expert_ffn_dim=32, qk_norm=True,
                    mask_token_id=63, eos_token_id=62, max_position=64)
  params = init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, 62)
  assert moe.routes_in_kernel(cfg, 18, jax.tree_util.tree_map(lambda a: a[0], params["moe_layers"])["experts"])

  def logits(p, impl):
    return forward(p, cfg, tokens, moe_impl=impl).logits
  np.testing.assert_allclose(logits(params, "grouped"), logits(params, "dense"), rtol=1e-5, atol=1e-5)
  loss = lambda impl: (lambda p: (jax.nn.log_softmax(logits(p, impl))[..., 0]).sum())  # noqa: E731
  got, want = jax.grad(loss("grouped"))(params), jax.grad(loss("dense"))(params)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_grouped_matmul_scales_sorted_rows_too():
  """x_scale on the plain (pre-gathered) rows: the same column scaling as the indexed path."""
  rng = np.random.default_rng(9)
  sizes, K, N = [3, 0, 9, 4], 64, 128
  G, M = len(sizes), sum(sizes)
  x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, size=(K,)), jnp.float32)
  ws = [jnp.asarray(rng.normal(size=(G, K, N)) / 8, jnp.float32) for _ in range(2)]
  out = _run(x, ws, sizes, gg.Plan(16, 1), x_scale=scale)
  np.testing.assert_allclose(np.asarray(out), loop_reference(np.asarray(x) * np.asarray(scale), ws, sizes),
                             rtol=1e-5, atol=1e-5)
