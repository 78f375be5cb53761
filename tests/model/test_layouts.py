"""The inference layout (per-layer buffers), the unrolled vs scanned layer loop, and batch bucketing: same
numbers, fewer compiled programs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.bench.presets import tiny_config
from dinfer_jax.cache import KVCache
from dinfer_jax.engine import generate as gen_lib
from dinfer_jax.engine.config import GenerationConfig
from dinfer_jax.model import params as params_lib
from dinfer_jax.model.transformer import forward


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config()
  return cfg, params_lib.init_params(cfg, jax.random.PRNGKey(3))


def test_unstack_layers_shapes(model):
  cfg, params = model
  un = params_lib.unstack_layers(params)
  assert params_lib.is_unstacked(un) and not params_lib.is_unstacked(params)
  assert len(un["moe_layers"]) == cfg.n_moe_layers
  np.testing.assert_array_equal(un["moe_layers"][1]["experts"]["down"], params["moe_layers"]["experts"]["down"][1])
  assert params_lib.unstack_layers(un) is not un and params_lib.unstack_layers(un)["moe_layers"] is un["moe_layers"]


@pytest.mark.parametrize("cached", [False, True])
def test_layer_loops_agree(model, cached):
  cfg, params = model
  B, T, S = 2, 8, 24
  tokens = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, 500)
  kw = {}
  if cached:
    kk = jax.random.normal(jax.random.PRNGKey(1), (cfg.n_layers, B, S, cfg.n_kv_heads, cfg.head_dim))
    kw = dict(cache=KVCache(kk, -kk), cache_start=jnp.int32(5), positions=jnp.broadcast_to(jnp.arange(5, 5 + T), (B, T)))
  scan = forward(params, cfg, tokens, unroll_layers=False, **kw)
  unrolled = forward(params, cfg, tokens, unroll_layers=True, **kw)
  per_layer = forward(params_lib.unstack_layers(params), cfg, tokens, **kw)
  for out in (unrolled, per_layer):
    np.testing.assert_allclose(out.logits, scan.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.kv.k, scan.kv.k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.kv.v, scan.kv.v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["moe", "gqa_partial_rope", "no_qk_norm", "int8", "fp8-block"])
def test_joined_queries_keys_match_separate_ones(model, variant, monkeypatch):
  """Queries and keys projected, normed and rotated joined (the default) give the numbers of the two
  separate projections (the path for head-split meshes), with GQA, partial RoPE and 8-bit kernels (their
  scales joined too) as well."""
  import dataclasses
  from dinfer_jax.model import quant, transformer
  cfg, params = model
  if variant == "gqa_partial_rope":
    cfg = dataclasses.replace(cfg, n_kv_heads=2, rotary_dim=8)
  elif variant == "no_qk_norm":
    cfg = dataclasses.replace(cfg, qk_norm=False)
  params = params_lib.init_params(cfg, jax.random.PRNGKey(4))
  if cfg.qk_norm:  # distinct query and key norm weights (init makes both ones)
    lay = dict(params["moe_layers"])
    for i, name in enumerate(("q_norm", "k_norm")):
      lay[name] = 1.0 + 0.5 * jax.random.normal(jax.random.PRNGKey(10 + i), lay[name].shape)
    params = dict(params, moe_layers=lay)
  if variant in ("int8", "fp8-block"):
    w, _, sc = variant.partition("-")
    params = quant.quantize_params(params, quant.QuantConfig(w, sc or "channel", block=16))
  B, T, S = 2, 8, 24
  tokens = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, 500)
  kk = jax.random.normal(jax.random.PRNGKey(1), (cfg.n_layers, B, S, cfg.n_kv_heads, cfg.head_dim))
  kw = dict(cache=KVCache(kk, -kk), cache_start=jnp.int32(5), positions=jnp.broadcast_to(jnp.arange(5, 5 + T), (B, T)))
  assert transformer._joint_qk(params_lib.unstack_layers(params)["moe_layers"][0])
  joined = forward(params, cfg, tokens, **kw)
  monkeypatch.setattr(transformer, "_joint_qk", lambda lp: False)
  separate = forward(params, cfg, tokens, **kw)
  np.testing.assert_allclose(joined.logits, separate.logits, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(joined.kv.k, separate.kv.k, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(joined.kv.v, separate.kv.v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("write_rows", [False, True])
def test_per_layer_cache_in_place_forward_equals_the_stacked_one(model, write_rows):
  """keep_cache: the forward writes its K/V into the per-layer buffers in place and attends: the same logits
  as the stacked cache's copy-and-update, and the buffers it returns hold what that copy attended to (the
  window's fresh K/V where written, the cached ones elsewhere)."""
  cfg, params = model
  B, T, S = 2, 8, 24
  tokens = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, 500)
  kk = jax.random.normal(jax.random.PRNGKey(1), (cfg.n_layers, B, S, cfg.n_kv_heads, cfg.head_dim))
  stacked = KVCache(kk, -kk)
  layers = KVCache(tuple(kk), tuple(-kk))
  assert layers.per_layer and layers.length == S == stacked.length
  kw = dict(cache_start=jnp.int32(5), positions=jnp.broadcast_to(jnp.arange(5, 5 + T), (B, T)))
  if write_rows:  # the engine's fixed-width windows: some inputs keep the cached K/V
    kw["write_mask"] = jnp.arange(T)[None, :] < jnp.array([[3], [8]])
  up = params_lib.unstack_layers(params)
  ref = forward(up, cfg, tokens, cache=stacked, **kw)
  kept = jax.jit(lambda c: forward(up, cfg, tokens, cache=c, keep_cache=True, **kw))(layers)
  fresh = forward(up, cfg, tokens, cache=layers, **kw)
  close = dict(rtol=1e-5, atol=1e-5)  # one program jitted, the other not: float noise only
  np.testing.assert_allclose(kept.logits, ref.logits, **close)
  np.testing.assert_array_equal(fresh.logits, ref.logits)
  np.testing.assert_allclose(np.stack(kept.kv.k), ref.kv.k, **close)
  np.testing.assert_allclose(np.stack(kept.kv.v), ref.kv.v, **close)
  outside = np.ones(S, bool)
  outside[5:5 + T] = False
  np.testing.assert_array_equal(np.stack(kept.kv.k)[:, :, outside], kk[:, :, outside])  # untouched slots
  np.testing.assert_array_equal(fresh.kv.stacked().k, ref.kv.k)
  np.testing.assert_array_equal(fresh.kv.stacked().v, ref.kv.v)
  full = forward(up, cfg, tokens, kv_layers=True)
  np.testing.assert_array_equal(full.kv.stacked().k, forward(up, cfg, tokens).kv.k)
  with pytest.raises(ValueError, match="keep_cache needs a per-layer cache"):
    forward(up, cfg, tokens, cache=stacked, keep_cache=True, **kw)


def test_engine_program_never_copies_a_cache_buffer(model):
  """The dual and prefix caches' cached forwards write into the loop-carried per-layer buffers in place:
  the compiled generate program holds no copy of a [B, S, K, H] cache buffer (before: one per layer and
  cached forward, the whole cache moved to attend to one window). In bf16, the production dtype (the CPU
  compile of an fp32 model still copies them; the GPU one of bf16 does not: roofline bench)."""
  import re
  from dinfer_jax.engine import loop
  from dinfer_jax.engine.program import Knobs
  cfg, params = model
  params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
  for cache, extra in (("dual", {}), ("prefix", {}), ("dual", dict(prefix_look=4, after_look=4, warmup_steps=2))):
    gcfg = GenerationConfig(gen_length=32, block_length=8, cache=cache, threshold=0.9, **extra)
    lay, prog = gen_lib.prepare(cfg, [[3, 17, 42, 99, 7]], gcfg)
    Bsz, Tc = lay.canvas.shape
    args = (jnp.asarray(lay.canvas), jnp.asarray(lay.valid), jnp.asarray(lay.positions), jax.random.PRNGKey(0),
            Knobs.of(gcfg))
    hlo = loop.run_jit().lower(prog, gen_lib.engine_params(params), *args).compile().as_text()
    buf = rf"\[{Bsz},{Tc},{cfg.n_kv_heads},{cfg.head_dim}\]"
    # (copies of a broadcast are the zero-initialised buffers, made once before the loop)
    copies = [l for l in hlo.splitlines() if re.search(rf"= \w+{buf}(\{{[^}}]*\}})? copy\((?!%\w*broadcast)", l)]
    assert not copies, (cache, copies[:3])
    assert re.search(rf"= \w+{buf}", hlo)  # the pattern does match the cache buffers


def test_batch_bucket():
  assert [gen_lib.bucket_rows(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 8, 8, 16, 16, 32, 48]


def test_batch_sizes_share_a_program_and_rows_match_alone(model):
  cfg, params = model
  gcfg = GenerationConfig(gen_length=16, block_length=8, cache="dual", threshold=0.9)
  prompts = [[3, 17, 42, 99, 7], [5, 9, 120], [11, 12, 13, 14]]
  lay3, _ = gen_lib.prepare(cfg, prompts, gcfg)
  lay4, _ = gen_lib.prepare(cfg, prompts + [[8, 8, 8]], gcfg)
  assert lay3.grid == lay4.grid and lay3.grid.batch == 4
  res = gen_lib.generate((params, cfg), prompts, gcfg)
  assert len(res.tokens) == 3
  for i, p in enumerate(prompts):
    alone = gen_lib.generate((params, cfg), [p], gcfg)
    assert alone.canvas[0] == res.canvas[i] and alone.row_nfe[0] == res.row_nfe[i]


@pytest.mark.parametrize("mask_rank", [2, 3])
def test_attention_matches_reference(mask_rank):
  from dinfer_jax.model.attention import attention, attention_mask, attention_reference, mask_bias
  B, T, S, N, K, H = 2, 5, 9, 4, 2, 8
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(ks[0], (B, T, N, H))
  k = jax.random.normal(ks[1], (B, S, K, H))
  v = jax.random.normal(ks[2], (B, S, K, H))
  if mask_rank == 2:
    mask = jax.random.bernoulli(ks[3], 0.7, (B, S)).at[1].set(False)  # row 1: every key masked
  else:
    mask = jax.random.bernoulli(ks[3], 0.7, (B, T, S)).at[0, 2].set(False)
  got = attention(q, k, v, attention_mask(mask, T))
  want = attention_reference(q, k, v, mask_bias(mask, T))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
