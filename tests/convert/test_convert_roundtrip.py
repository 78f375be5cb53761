"""HF -> JAX -> HF on the golden tiny models: param tree, tensor semantics, bit-exact round trips, loading."""
import json

import jax
import ml_dtypes
import numpy as np
import pytest

from ckpt_testlib import MODELS, arrays, raw_tensors
from dinfer_jax import checkpoint as ck
from dinfer_jax.config import ModelConfig
from dinfer_jax.model.params import abstract_params

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16) if x.dtype == BF16 else x


def _same(a, b):
  return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_params_match_abstract_tree(name):
  cfg, _ = ck.read_hf_config(MODELS[name])
  for dtype in ("bfloat16", "float32"):
    params = ck.load_hf_params(MODELS[name], cfg, dtype)
    want = abstract_params(cfg, np.dtype(dtype))
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(want)
    jax.tree.map(lambda p, w: (p.shape == w.shape and p.dtype == w.dtype) or pytest.fail(f"{p.shape} {w}"),
                 params, want)


def test_fused_and_per_expert_give_identical_params():
  a = ck.load_hf_params(MODELS["llada_moe"])
  b = ck.load_hf_params(MODELS["llada_moe_fused"])
  assert jax.tree.all(jax.tree.map(_same, a, b))


def test_tensor_semantics_llada_moe():
  """Checks the transforms against HF tensors by explicit indexing (independent of keymap's code)."""
  hf = arrays(MODELS["llada_moe"])
  p = ck.load_hf_params(MODELS["llada_moe"])
  cfg, _ = ck.read_hf_config(MODELS["llada_moe"])
  N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  L = p["moe_layers"]
  i, n, h, e = 1, 3, 5, 6
  q, k, o = hf[f"model.layers.{i}.self_attn.q_proj.weight"], hf[f"model.layers.{i}.self_attn.k_proj.weight"], \
      hf[f"model.layers.{i}.self_attn.o_proj.weight"]
  assert _same(L["q"][i][:, n, h], q[n * H + h, :])
  assert _same(L["k"][i][:, K - 1, h], k[(K - 1) * H + h, :])
  assert _same(L["o"][i][n, h, :], o[:, n * H + h])
  assert _same(L["router"][i], hf[f"model.layers.{i}.mlp.gate.weight"].T)
  assert _same(L["experts"]["gate"][i, e], hf[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"].T)
  assert _same(L["experts"]["up"][i, e], hf[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"].T)
  assert _same(L["experts"]["down"][i, e], hf[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"].T)
  assert _same(L["q_norm"][i], hf[f"model.layers.{i}.self_attn.q_norm.weight"])
  assert _same(p["lm_head"], hf["lm_head.weight"].T)
  assert _same(p["embed"], hf["model.embed_tokens.weight"])
  # The fused file: w1 rows [0, F) are the gate (SiLU side), [F, 2F) up.
  fu = arrays(MODELS["llada_moe_fused"])
  F = cfg.expert_ffn_dim
  assert _same(fu[f"model.layers.{i}.mlp.w1"][e, :F], hf[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"])
  assert _same(fu[f"model.layers.{i}.mlp.w1"][e, F:], hf[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"])


def test_tensor_semantics_llada2_and_dense():
  hf = arrays(MODELS["llada2_moe"])
  p = ck.load_hf_params(MODELS["llada2_moe"])
  cfg, _ = ck.read_hf_config(MODELS["llada2_moe"])
  N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  qkv = hf["model.layers.2.attention.query_key_value.weight"]
  M = p["moe_layers"]  # HF layer 2 is moe layer 1 (first_k_dense_replace=1)
  assert _same(M["q"][1][:, 2, 3], qkv[2 * H + 3])
  assert _same(M["k"][1][:, 1, 3], qkv[N * H + 1 * H + 3])
  assert _same(M["v"][1][:, 0, 3], qkv[(N + K) * H + 3])
  assert _same(M["expert_bias"][1], hf["model.layers.2.mlp.gate.expert_bias"])
  assert M["expert_bias"].dtype == np.float32
  assert _same(M["shared"]["down"][0], hf["model.layers.1.mlp.shared_experts.down_proj.weight"].T)
  assert _same(p["dense_layers"]["mlp"]["gate"][0], hf["model.layers.0.mlp.gate_proj.weight"].T)
  assert _same(p["dense_layers"]["q_norm"][0], hf["model.layers.0.attention.query_layernorm.weight"])
  hd = arrays(MODELS["llada"])
  pd = ck.load_hf_params(MODELS["llada"])
  assert _same(pd["dense_layers"]["mlp"]["gate"][1], hd["model.transformer.blocks.1.ff_proj.weight"].T)
  assert _same(pd["dense_layers"]["mlp"]["down"][1], hd["model.transformer.blocks.1.ff_out.weight"].T)
  assert _same(pd["lm_head"], hd["model.transformer.ff_out.weight"].T)
  # fp32 conversion keeps the values exactly.
  p32 = ck.load_hf_params(MODELS["llada2_moe"], dtype="float32")
  np.testing.assert_array_equal(p32["moe_layers"]["q"], M["q"].astype(np.float32))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_bit_exact(tmp_path, name, dtype):
  src = MODELS[name]
  jx, back = tmp_path / "jax", tmp_path / "hf"
  s = ck.hf2jax(src, jx, dtype)
  assert ck.is_converted_checkpoint(jx) and not ck.is_hf_checkpoint(jx)
  meta = json.loads((jx / "dinfer_jax.json").read_text())
  assert meta["dtype"] == dtype and meta["source_dtype"] == "bfloat16"
  assert meta["source_layout"] == ("fused" if name.endswith("fused") else "per_expert")
  assert (jx / "config.json").read_bytes() == (src / "config.json").read_bytes()
  assert s["tensors"] == len(raw_tensors(src))
  # default output dtype is the source's (bf16): f32-stored params come back bit-exact too
  ck.jax2hf(jx, back, dtype="bfloat16" if dtype == "float32" else None)
  assert ck.is_hf_checkpoint(back)
  assert raw_tensors(back) == raw_tensors(src)
  assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
  index = json.loads((back / "model.safetensors.index.json").read_text())
  assert set(index["weight_map"]) == set(raw_tensors(src))


def test_jax2hf_fp32_output_and_default_dtype(tmp_path):
  ck.hf2jax(MODELS["llada2_moe"], tmp_path / "j", "float32")
  ck.jax2hf(tmp_path / "j", tmp_path / "h32", dtype="float32")
  a, b = arrays(MODELS["llada2_moe"]), arrays(tmp_path / "h32")
  for k in a:
    assert b[k].dtype == np.float32
    np.testing.assert_array_equal(b[k], a[k].astype(np.float32))
  ck.jax2hf(tmp_path / "j", tmp_path / "hdef")  # default: the source dtype, bf16 (bias fp32)
  assert raw_tensors(tmp_path / "hdef") == raw_tensors(MODELS["llada2_moe"])


def test_layout_switch(tmp_path):
  """per-expert -> fused through JAX reproduces dInfer's fused file byte for byte, and back."""
  ck.hf2jax(MODELS["llada_moe"], tmp_path / "j")
  ck.jax2hf(tmp_path / "j", tmp_path / "fused", layout="fused")
  assert raw_tensors(tmp_path / "fused") == raw_tensors(MODELS["llada_moe_fused"])
  ck.hf2jax(MODELS["llada_moe_fused"], tmp_path / "jf")
  ck.jax2hf(tmp_path / "jf", tmp_path / "per", layout="per_expert")
  assert raw_tensors(tmp_path / "per") == raw_tensors(MODELS["llada_moe"])
  # LLaDA2 pre-fused (mlp.w1/w2): written, read back to the same params.
  ck.hf2jax(MODELS["llada2_moe"], tmp_path / "j2")
  ck.jax2hf(tmp_path / "j2", tmp_path / "f2", layout="fused")
  keys = raw_tensors(tmp_path / "f2")
  assert "model.layers.1.mlp.w1" in keys and not any(".mlp.experts." in k for k in keys)
  a = ck.load_hf_params(MODELS["llada2_moe"])
  b = ck.load_hf_params(tmp_path / "f2")
  assert jax.tree.all(jax.tree.map(_same, a, b))


def test_sharded_output(tmp_path):
  ck.hf2jax(MODELS["llada_moe"], tmp_path / "j")
  s = ck.jax2hf(tmp_path / "j", tmp_path / "h", max_shard_bytes=100_000)
  files = sorted(p.name for p in (tmp_path / "h").glob("*.safetensors"))
  assert s["files"] == len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  assert raw_tensors(tmp_path / "h") == raw_tensors(MODELS["llada_moe"])
  # and an index-sharded input converts the same
  ck.hf2jax(tmp_path / "h", tmp_path / "j2")
  a, _, _ = ck.load_converted(tmp_path / "j")
  b, _, _ = ck.load_converted(tmp_path / "j2")
  assert jax.tree.all(jax.tree.map(lambda x, y: _same(np.asarray(x), np.asarray(y)), a, b))


def test_tokenizer_files_travel(tmp_path):
  from ckpt_testlib import copy_model
  src = copy_model("llada_moe", tmp_path / "src")
  (src / "tokenizer.json").write_text('{"version": "1.0"}')
  (src / "tokenizer_config.json").write_text('{"chat_template": "x"}')
  (src / "extra.bin").write_bytes(b"\0" * 8)  # weight-like: not copied
  ck.hf2jax(src, tmp_path / "j")
  names = {p.name for p in (tmp_path / "j").iterdir()}
  assert {"tokenizer.json", "tokenizer_config.json", "config.json", "dinfer_jax.json", "params"} <= names
  assert "extra.bin" not in names and "model.safetensors" not in names
  ck.jax2hf(tmp_path / "j", tmp_path / "h")
  assert (tmp_path / "h" / "tokenizer.json").read_text() == '{"version": "1.0"}'
  assert not (tmp_path / "h" / "dinfer_jax.json").exists()


def test_load_converted_dtype_and_shardings(tmp_path):
  ck.hf2jax(MODELS["llada2_moe"], tmp_path / "j")
  ref = ck.load_hf_params(MODELS["llada2_moe"])
  params, cfg, raw = ck.load_converted(tmp_path / "j")
  assert cfg == ModelConfig.from_hf_config(raw) and raw["model_type"] == "llada2_moe"
  assert jax.tree.all(jax.tree.map(lambda a, b: _same(np.asarray(a), b), params, ref))
  p32, _, _ = ck.load_converted(tmp_path / "j", dtype="float32")
  assert p32["embed"].dtype == np.float32 and p32["moe_layers"]["expert_bias"].dtype == np.float32
  np.testing.assert_array_equal(np.asarray(p32["embed"]), ref["embed"].astype(np.float32))
  # Sharded restore: experts split over 8 devices on the expert axis, the rest replicated.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
  P = jax.sharding.PartitionSpec
  rep = jax.sharding.NamedSharding(mesh, P())
  shard = jax.tree_util.tree_map(lambda _: rep, abstract_params(cfg))
  ex = jax.sharding.NamedSharding(mesh, P(None, "x"))
  shard["moe_layers"]["experts"] = {k: ex for k in ("gate", "up", "down")}
  ps, _, _ = ck.load_converted(tmp_path / "j", shardings=shard)
  g = ps["moe_layers"]["experts"]["gate"]
  assert g.sharding == ex and len(g.addressable_shards) == 8
  assert g.addressable_shards[0].data.shape == (g.shape[0], g.shape[1] // 8) + g.shape[2:]
  assert _same(np.asarray(g), ref["moe_layers"]["experts"]["gate"])


def test_load_hf_params_with_shardings():
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[1])
  p = ck.load_hf_params(MODELS["llada"], shardings=dev)
  assert all(isinstance(x, jax.Array) and x.sharding == dev for x in jax.tree_util.tree_leaves(p))


def test_inspect_both_formats(tmp_path):
  rows = ck.inspect(MODELS["llada2_moe"])
  assert ("model.layers.1.mlp.gate.expert_bias", (16,), "float32") in rows
  assert ("lm_head.weight", (512, 64), "bfloat16") in rows
  ck.hf2jax(MODELS["llada2_moe"], tmp_path / "j")
  rows = dict((n, (s, d)) for n, s, d in ck.inspect(tmp_path / "j"))
  assert rows["moe_layers.expert_bias"] == ((2, 16), "float32")
  assert rows["lm_head"] == ((64, 512), "bfloat16")
  assert rows["dense_layers.q"] == ((1, 64, 4, 16), "bfloat16")


def test_save_converted_numpy_and_jax_trees(tmp_path):
  """save_converted takes what load_hf_params / load_converted return (numpy or jax arrays)."""
  raw = json.loads((MODELS["llada2_moe"] / "config.json").read_text())
  p = ck.load_hf_params(MODELS["llada2_moe"], dtype="float32")
  s = ck.save_converted(tmp_path / "np", p, raw, layout="per_expert")
  assert s["dtype"] == "float32" and s["n_params"] == 338496
  meta = json.loads((tmp_path / "np" / "dinfer_jax.json").read_text())
  assert meta["source_dtype"] == "float32" and meta["family"] == "llada2_moe"
  q, cfg, raw2 = ck.load_converted(tmp_path / "np")
  assert raw2 == raw and jax.tree.all(jax.tree.map(lambda a, b: _same(np.asarray(a), b), q, p))
  ck.save_converted(tmp_path / "jx", q, raw, layout="fused", source_dtype="bfloat16")
  ck.jax2hf(tmp_path / "jx", tmp_path / "hf")  # fused, bf16: the recorded defaults
  keys = raw_tensors(tmp_path / "hf")
  assert "model.layers.2.mlp.w2" in keys and keys["model.layers.2.mlp.w2"][0] == "BF16"
  assert keys["model.layers.2.mlp.gate.expert_bias"][0] == "F32"
