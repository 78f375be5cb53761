"""8-bit weights (model/quant.py): the quantisation by hand, the tiles, and the quantised forward against the
plain reference (the same forward on the dequantised weights) and against fp32 on the golden tiny models."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dinfer_jax
from dinfer_jax.model import moe
from dinfer_jax.model import quant
from dinfer_jax.model.transformer import forward

GOLD = pathlib.Path(__file__).parent.parent / "golden" / "forward"
SCHEMES = [quant.QuantConfig(w, s, block=16) for w in ("int8", "fp8") for s in ("channel", "block")]
# Measured (fp32 logits, input_ids.npy, block 16) over the three golden models: max |error| and mean |error|
# per scheme. int8: max 0.08 / 0.53 (channel / block; the block case is one routing flip on tiny_llada2_moe),
# mean <= 0.012 / 0.019; fp8 (3 mantissa bits): max 0.58 / 1.19, mean <= 0.054 / 0.076. Bounds: 1.5x the
# largest mean; the mean logit magnitude is ~0.8.
MEAN_BOUND = {"int8": 0.03, "fp8": 0.12}


def _ids(s):
  return f"{s.weights}-{s.scales}"


def test_int8_channel_by_hand():
  w = np.array([[1.0, -2.0], [0.5, 4.0], [-0.25, 1.0]], np.float32)  # [D=3, F=2]: scales per column
  q = quant.quantize_leaf(("mlp", "gate"), w, quant.QuantConfig("int8", "channel"))
  # qwix's int8 bound is 127.5 (the +-absmax ends round to -128 / clip to 127: the top bucket is used).
  scale = np.array([[1.0 / 127.5, 4.0 / 127.5]])
  np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-6)
  expect = np.clip(np.round(w / scale), -128, 127)
  np.testing.assert_array_equal(np.asarray(q.qvalue), expect.astype(np.int8))
  assert int(q.qvalue[1, 1]) == 127 and int(q.qvalue[0, 1]) == -64
  assert q.qvalue.dtype == jnp.int8 and q.scale.dtype == jnp.float32


def test_fp8_block_by_hand():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(4, 6)).astype(np.float32)
  w[0, 0] = 10.0  # one block gets a large scale, the others keep theirs
  qc = quant.QuantConfig("fp8", "block", block=2)
  q = quant.quantize_leaf(("mlp", "down"), w, qc)
  assert q.scale.shape == (2, 3)
  for i in range(2):
    for j in range(3):
      blk = w[2 * i:2 * i + 2, 2 * j:2 * j + 2]
      s = np.abs(blk).max() / 448.0
      np.testing.assert_allclose(float(q.scale[i, j]), s, rtol=1e-6)
      np.testing.assert_array_equal(np.asarray(q.qvalue[2 * i:2 * i + 2, 2 * j:2 * j + 2]),
                                    np.asarray(jnp.asarray(blk / s).astype(jnp.float8_e4m3fn)))
  deq = np.asarray(quant.dequantize(q))
  assert np.abs(deq - w).max() <= np.abs(w).max() * 2 ** -4  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("path,shape,qc,tiles", [
    # q [D, N, H]: 128-blocks of (N, H) are 2 heads of 64, or half a head of 256.
    (("q",), (256, 4, 64), quant.QuantConfig("fp8", "block"), (128, 2, 64)),
    (("q",), (256, 2, 256), quant.QuantConfig("fp8", "block"), (128, 1, 128)),
    (("moe_layers", "o"), (3, 4, 64, 256), quant.QuantConfig("int8", "block"), (1, 2, 64, 128)),
    (("experts", "gate"), (8, 256, 512), quant.QuantConfig("int8", "block"), (1, 128, 128)),
    (("experts", "gate"), (8, 64, 96), quant.QuantConfig("int8", "block"), (1, 64, 96)),  # < 1 block: whole
    (("q",), (256, 4, 64), quant.QuantConfig("int8", "channel"), (256, 1, 1)),
    (("experts", "down"), (2, 8, 128, 64), quant.QuantConfig("int8", "channel"), (1, 1, 1, 64)),
    (("shared", "down"), (128, 64), quant.QuantConfig("int8", "channel"), (128, 1)),
])
def test_tiles(path, shape, qc, tiles):
  assert quant.tile_shape(path, shape, qc) == tiles


def test_untileable_shape_names_the_leaf():
  with pytest.raises(ValueError, match=r"experts/gate \(8, 192, 256\).*192.*128"):
    quant.tile_shape(("experts", "gate"), (8, 192, 256), quant.QuantConfig("fp8", "block"))
  with pytest.raises(ValueError, match="weights must be one of"):
    quant.QuantConfig("int4")


def test_only_the_matmul_weights_are_quantised():
  m = dinfer_jax.load(GOLD / "tiny_llada_moe", dtype="float32")
  qp = quant.quantize_params(m.params, "int8")
  flat = jax.tree_util.tree_flatten_with_path(qp, is_leaf=quant.is_qarray)[0]
  names = {"/".join(str(getattr(k, "key", k)) for k in path): quant.is_qarray(x) for path, x in flat}
  assert all(names[k] for k in names if k.split("/")[-1] in ("q", "k", "v", "o", "gate", "up", "down"))
  assert not any(names[k] for k in names if k.split("/")[-1] in ("embed", "lm_head", "router", "attn_norm",
                                                                 "q_norm", "final_norm"))
  b = quant.weight_bytes(qp)
  assert b["qvalue"] > 0 and b["scale"] * 10 < b["qvalue"]
  # "+head": the LM head too, one scale per vocabulary entry; the forward stays the dequantised one.
  qh = quant.quantize_params(m.params, "fp8+head")
  assert quant.is_qarray(qh["lm_head"]) and qh["lm_head"].scale.shape == (1, m.config.vocab_size)
  x = jnp.arange(10)[None] % m.config.vocab_size
  np.testing.assert_allclose(forward(qh, m.config, x).logits, forward(quant.dequantize_params(qh), m.config, x).logits,
                             atol=1e-5)
  with pytest.raises(ValueError, match="unknown option '\\+norms'"):
    quant.QuantConfig.parse("fp8+norms")


# The default run takes each model and each scheme once (tiny_llada_moe twice); -m slow the whole matrix.
_DEFAULT = {("tiny_llada_moe", 0), ("tiny_llada", 1), ("tiny_llada2_moe", 2), ("tiny_llada_moe", 3)}
FORWARD_CASES = [pytest.param(name, qc, id=f"{name}-{_ids(qc)}",
                              marks=() if (name, i) in _DEFAULT else pytest.mark.slow)
                 for name in ("tiny_llada_moe", "tiny_llada", "tiny_llada2_moe") for i, qc in enumerate(SCHEMES)]


@pytest.mark.parametrize("name,qc", FORWARD_CASES)
def test_quantised_forward_matches_dequantised_reference(name, qc):
  m = dinfer_jax.load(GOLD / name, dtype="float32")
  cfg = m.config
  x0 = jnp.asarray(np.load(GOLD / name / "input_ids.npy"))
  qp = quant.quantize_params(m.params, qc)
  ref = forward(quant.dequantize_params(qp), cfg, x0, moe_impl="loop" if cfg.n_moe_layers else None).logits
  # Every MoE kernel on one scheme per model; the default kernel on the others (compiles are most of the time).
  impls = list(moe.EXPERT_KERNELS) if cfg.n_moe_layers and qc == SCHEMES[0] else [None]
  for impl in impls:
    out = jax.jit(lambda p, x: forward(p, cfg, x, moe_impl=impl).logits)(qp, x0)
    assert float(jnp.abs(out - ref).max()) <= 1e-5, impl
  # ... and the quantisation error against the fp32 weights, bounded by what was measured.
  full = forward(m.params, cfg, x0).logits
  err = jnp.abs(out - full)
  assert 1e-4 < float(err.mean()) <= MEAN_BOUND[qc.weights]


@pytest.mark.parametrize("spec", ["fp8", "fp8+embed"])
def test_quantised_generate_matches_dequantised_reference(spec):
  """The engine (jit, while loops, per-layer weights) takes the quantised tree as it takes a plain one; with
  the 8-bit embedding table, iteration smoothing (cont_weight) reads it."""
  from dinfer_jax.engine.config import GenerationConfig
  from dinfer_jax.engine.generate import generate
  from dinfer_jax.cli_common import encode_prompts
  m = dinfer_jax.load("default", quantize=spec)
  gcfg = GenerationConfig(gen_length=16, block_length=8, cache="dual", threshold=0.9,
                          cont_weight=0.3 if "embed" in spec else 0.0)
  # Real prompts: on arbitrary ids the model may answer <|eos|> at once, and empty answers compare nothing.
  prompts = encode_prompts(m, ["What is 348+279?", "61 x 7"])
  a = generate(m, prompts, gcfg)
  b = generate((quant.dequantize_params(m.params), m.config), prompts, gcfg)
  assert [list(t) for t in a.tokens] == [list(t) for t in b.tokens]
  assert a.nfe == b.nfe and sum(map(len, a.tokens)) > 0


# ----------------------------------------------------------------------------- 8-bit activations (W8A8)
# Measured (fp32 logits, input_ids.npy) with every forward's activations in 8 bits (+a8:0), over the three
# golden models: int8 max 0.37, mean <= 0.024 (weight-only 0.012); fp8 max 1.38, mean <= 0.090 (weight-only
# 0.054). Bounds: 1.5x the largest mean.
A8_MEAN_BOUND = {"int8": 0.036, "fp8": 0.135}


def test_a8_specs():
  qc = quant.QuantConfig.parse("fp8+head+a8")
  assert (qc.weights, qc.lm_head, qc.act_min_tokens) == ("fp8", True, quant.DEFAULT_ACT_MIN_TOKENS)
  assert quant.QuantConfig.parse("int8+a8:0").act_min_tokens == 0
  assert quant.QuantConfig.parse("fp8").act_min_tokens is None
  for bad, msg in (("fp8-block+a8", "per-channel"), ("fp8+a8+a8", "each once"), ("fp8+a8:x", "unknown option"),
                   ("fp8+a9", "unknown option")):
    with pytest.raises(ValueError, match=msg):
      quant.QuantConfig.parse(bad)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a8_einsum_is_the_product_of_the_rounded_activations(scheme):
  """W8A8 equals the fp32 product of the dequantised weight and the activations rounded per token (absmax,
  quantize_rows) - for output-channel scales (q) and input-channel ones (the experts' down projection, whose
  scales go to x before it is rounded); below the policy's token count the weight-only product is kept."""
  rng = np.random.default_rng(0)
  qc = quant.QuantConfig.parse(f"{scheme}+a8:10")
  wq = quant.quantize_params({"layers": [{"q": jnp.asarray(rng.normal(size=(64, 4, 16)), jnp.float32)}]},
                             qc)["layers"][0]["q"]
  assert quant.act_min_tokens(wq) == 10 and quant.act_min_tokens(quant.join_columns([wq, wq])) == 10
  x = jnp.asarray(rng.normal(size=(2, 5, 64)), jnp.float32)
  v, s = quant.quantize_rows(x, wq.qvalue.dtype, (2,))
  assert v.dtype == wq.qvalue.dtype and s.shape == (2, 5, 1)
  ref = jnp.einsum("BTD,DNH->BTNH", v.astype(jnp.float32) * s, quant.dequantize(wq, jnp.float32))
  got = quant.einsum("BTD,DNH->BTNH", x, wq)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
  weight_only = quant.einsum("BTD,DNH->BTNH", x, quant.with_act(wq, None))
  assert float(jnp.abs(got - weight_only).max()) > 1e-3  # the activations were rounded
  # 8 tokens < 10: weight-only.
  np.testing.assert_array_equal(quant.einsum("BTD,DNH->BTNH", x[:, :4], wq), weight_only[:, :4])
  wd = quant.quantize_params({"moe_layers": [{"experts": {"down": jnp.asarray(rng.normal(size=(3, 32, 64)),
                                                                           jnp.float32)}}]}, qc)
  wd = wd["moe_layers"][0]["experts"]["down"]
  a = jnp.asarray(rng.normal(size=(3, 12, 32)), jnp.float32)
  scaled = a * wd.scale[:, None, :, 0]
  v, s = quant.quantize_rows(scaled, wd.qvalue.dtype, (0, 2))  # "ETF,EFD->TD": E and F contracted
  ref = jnp.einsum("ETF,EFD->TD", v.astype(jnp.float32) * s, wd.qvalue.astype(jnp.float32))
  np.testing.assert_allclose(quant.einsum("ETF,EFD->TD", a, wd), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a8g_einsum_rounds_each_run_of_128(scheme):
  """"+a8g": one scale per token and run of 128 contracted elements. The product equals the fp32 product of
  the dequantised weight and the activations rounded run by run; a contracted axis shorter than a run (o's
  16-wide heads here) is one run per head. With an outlier channel int8's runs are closer to the unrounded
  product than one scale per token."""
  qc = quant.QuantConfig.parse(f"{scheme}+a8g:0")
  assert (qc.act_min_tokens, qc.act_group) == (0, quant.ACT_GROUP)
  assert quant.QuantConfig.parse(f"{scheme}+a8g:64").act_min_tokens == 64
  rng = np.random.default_rng(1)
  w = quant.quantize_params({"layers": [{"q": jnp.asarray(rng.normal(size=(256, 4, 16)) / 16, jnp.float32),
                                         "o": jnp.asarray(rng.normal(size=(4, 16, 256)) / 16, jnp.float32)}]},
                            qc)["layers"][0]
  assert quant.act_group(w["q"]) == 128 and quant.act_group(quant.join_columns([w["q"], w["q"]])) == 128
  x = np.asarray(rng.normal(size=(2, 5, 256)), np.float32)
  x[..., 3] *= 80.0
  x = jnp.asarray(x)
  v, s = quant.quantize_rows(x, w["q"].qvalue.dtype, (2,), 128)
  assert s.shape == (2, 5, 2)
  rounded = v.astype(jnp.float32) * jnp.repeat(s, 128, axis=2)
  deq = quant.dequantize(w["q"], jnp.float32)
  got = quant.einsum("BTD,DNH->BTNH", x, w["q"])
  np.testing.assert_allclose(got, jnp.einsum("BTD,DNH->BTNH", rounded, deq), rtol=1e-5, atol=1e-4)
  if scheme == "int8":  # FP8's exponent keeps small values fine under one scale; int8's steps do not
    exact = jnp.einsum("BTD,DNH->BTNH", x, deq)
    per_token = quant.einsum("BTD,DNH->BTNH", x, quant.with_act(w["q"], 0))
    assert float(jnp.abs(got - exact).mean()) < 0.8 * float(jnp.abs(per_token - exact).mean())
  a = jnp.asarray(rng.normal(size=(2, 5, 4, 16)), jnp.float32)
  v, s = quant.quantize_rows(a, w["o"].qvalue.dtype, (3,), 16)  # per (token, head)
  ref = jnp.einsum("BTNH,NHD->BTD", v.astype(jnp.float32) * jnp.repeat(s, 16, axis=3),
                   quant.dequantize(w["o"], jnp.float32))
  np.testing.assert_allclose(quant.einsum("BTNH,NHD->BTD", a, w["o"]), ref, rtol=1e-5, atol=1e-4)
  for bad, msg in (("fp8-block+a8g", "per-channel"), ("fp8+a8g+a8", "each once"), ("fp8+a8g:x", "unknown option")):
    with pytest.raises(ValueError, match=msg):
      quant.QuantConfig.parse(bad)
  with pytest.raises(ValueError, match="groups of 128 cut the last axis"):
    quant.quantize_rows(x, jnp.int8, (1, 2), 128)


def test_a8_rounding_by_hand():
  x = jnp.asarray([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
  v, s = quant.quantize_rows(x, jnp.int8, (1,))
  # Bound 127 (quant.ACT_QMAX): the absmax element lands on -127 exactly; 63.5 and 31.75 round to 64 and 32;
  # an all-zero row gets the smallest normal scale (no 0 / 0).
  np.testing.assert_allclose(s[:, 0], [2.0 / 127, np.finfo(np.float32).tiny])
  np.testing.assert_array_equal(v, [[64, -127, 32], [0, 0, 0]])
  v, s = quant.quantize_rows(x, jnp.float8_e4m3fn, (1,))
  np.testing.assert_allclose(s[0, 0], 2.0 / 448)
  np.testing.assert_array_equal(v.astype(jnp.float32)[0], [224.0, -448.0, 112.0])


@pytest.mark.parametrize("name", ["tiny_llada_moe", "tiny_llada", "tiny_llada2_moe"])
def test_a8_forward_error_and_kernels(name, monkeypatch):
  """Every forward in 8-bit activations (+a8:0): the error against fp32 weights bounded by what was measured,
  larger than weight-only's (the activations are rounded), and the grouped kernels equal to the loop over
  experts that rounds the same rows, layer by layer on the same input.

  Not the composed forward: the two kernels sum in different orders, so a layer's outputs differ by an ulp,
  and where the next layer's activation lands on a rounding boundary that ulp moves it a whole quantum (1/16
  of the value for fp8). Measured on tiny_llada_moe, fp8: each layer within 2e-6, the logits 1.1e-3 apart.
  The grouped forward is then held to the same error bound as the loop's."""
  calls = []
  ffn = moe.moe_ffn

  def recording(h, lp, cfg, impl=None, norm_w=None, residual=None, **kw):
    calls.append((h, lp, norm_w, residual, kw))
    return ffn(h, lp, cfg, impl, norm_w, residual, **kw)

  m = dinfer_jax.load(GOLD / name, dtype="float32")
  cfg = m.config
  x0 = jnp.asarray(np.load(GOLD / name / "input_ids.npy"))
  full = forward(m.params, cfg, x0).logits
  for scheme in ("int8", "fp8"):
    qp = quant.quantize_params(m.params, f"{scheme}+a8:0")
    out = jax.jit(lambda p, x: forward(p, cfg, x).logits)(qp, x0)
    err = float(jnp.abs(out - full).mean())
    weight_only = float(jnp.abs(forward(quant.quantize_params(m.params, scheme), cfg, x0).logits - full).mean())
    assert weight_only < err <= A8_MEAN_BOUND[scheme]
    if cfg.n_moe_layers:
      g = forward(qp, cfg, x0, moe_impl="grouped").logits
      assert float(jnp.abs(g - full).mean()) <= A8_MEAN_BOUND[scheme]
      calls.clear()
      with monkeypatch.context() as mp:
        mp.setattr(moe, "moe_ffn", recording)
        forward(qp, cfg, x0, moe_impl="loop")
      assert len(calls) == cfg.n_moe_layers
      for h, lp, norm_w, residual, kw in calls:
        ys = [ffn(h, lp, cfg, impl, norm_w, residual, **kw) for impl in ("grouped", "loop")]
        ys = [y[0] if isinstance(y, tuple) else y for y in ys]  # with a residual: (block output, its norm)
        np.testing.assert_allclose(ys[0], ys[1], atol=1e-5)


def test_eight_bit_embedding_table():
  """+embed: one scale per row in the table's dtype (the model's activation dtype is the table's); rows looked
  up dequantised; iteration smoothing's product over the 8-bit table equals the one over the dequantised
  table; the LM head and the rest unchanged."""
  from dinfer_jax.engine import iteration
  m = dinfer_jax.load(GOLD / "tiny_llada_moe", dtype="float32")
  V, D = m.params["embed"].shape
  qp = quant.quantize_params(m.params, "fp8+embed")
  e = qp["embed"]
  assert quant.is_qarray(e) and e.qvalue.dtype == jnp.float8_e4m3fn and e.scale.shape == (V, 1)
  assert e.dtype == m.params["embed"].dtype and not quant.is_qarray(qp["lm_head"])
  plain = quant.dequantize(e, jnp.float32)
  ids = jnp.asarray([[0, 5, V - 1]])
  np.testing.assert_array_equal(quant.take_rows(e, ids), plain[ids])
  assert 0 < float(jnp.abs(plain - m.params["embed"]).max()) <= 0.07 * float(jnp.abs(m.params["embed"]).max())
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 6, V)) * 3, jnp.float32)
  toks = jnp.asarray(rng.integers(0, V, size=(2, 6)), jnp.int32)
  masked = jnp.asarray(rng.random((2, 6)) < 0.5)
  w = jnp.asarray([0.3, 1.0])
  np.testing.assert_allclose(iteration.soft_embed(e, toks, logits, masked, w),
                             iteration.soft_embed(plain, toks, logits, masked, w), rtol=1e-5, atol=1e-6)
  x = jnp.arange(10)[None] % V
  np.testing.assert_allclose(forward(qp, m.config, x).logits,
                             forward(quant.dequantize_params(qp), m.config, x).logits, atol=1e-5)
  with pytest.raises(ValueError, match="per-channel scales only"):
    quant.QuantConfig.parse("fp8-block+embed")


@pytest.mark.parametrize("path", [("experts", "gate"), ("experts", "down")])
@pytest.mark.parametrize("eight_bit_operand", [False, True])
def test_ragged_dot_applies_the_scales_outside_the_product(path, eight_bit_operand):
  """quant.ragged_dot on per-channel 8-bit expert weights (per output column for gate/up, per input channel for
  the experts' down projection) equals ragged_dot on the dequantised weights, row by row by its group; with
  eight_bit_operand (TPU) the 8-bit values themselves go into the product."""
  G, K, N = 4, 16, 8
  rng = np.random.default_rng(0)
  w = quant.quantize_leaf(path, rng.standard_normal((G, K, N)).astype(np.float32), quant.QuantConfig("int8", "channel"))
  assert w.scale.shape == ((G, K, 1) if path[-1] == "down" else (G, 1, N))
  sizes = jnp.array([3, 0, 5, 2], jnp.int32)
  x = jnp.asarray(rng.standard_normal((10, K)), jnp.float32)
  ref = jax.lax.ragged_dot(x, quant.dequantize(w, jnp.float32), sizes)
  out = jax.jit(lambda x, w, s: quant.ragged_dot(x, w, s, eight_bit_operand=eight_bit_operand))(x, w, sizes)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
  # Each group's rows by hand: x_g @ (q_g * s_g).
  start = 0
  for g, n in enumerate(np.asarray(sizes)):
    wg = np.asarray(w.qvalue[g], np.float32) * np.asarray(w.scale[g], np.float32)
    np.testing.assert_allclose(np.asarray(out[start:start + n]), np.asarray(x[start:start + n]) @ wg, rtol=1e-5, atol=1e-5)
    start += n
