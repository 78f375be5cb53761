"""The key map on the real presets, without weights: counts, coverage, key names, shapes, full validation."""
import jax
import numpy as np
import pytest

from ckpt_testlib import write_sparse
from dinfer_jax.checkpoint import CheckpointError, expected_hf_keys, keymap
from dinfer_jax.checkpoint.hf import HFCheckpoint
from dinfer_jax.config import ModelConfig
from dinfer_jax.model.params import abstract_params, count_params

# HF config.json contents of the released models (their model cards), as the converter sees them.
HF_CONFIGS = {
    "llada_moe_7b_a1b": {
        "model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "vocab_size": 157184, "hidden_size": 2048,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "expert_intermediate_size": 1024, "dense_intermediate_size": 8192, "shared_expert_intermediate_size": None,
        "num_experts": 64, "num_experts_per_tok": 8, "qk_layernorm": True, "rope_theta": 50000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "partial_rotary_factor": 1.0, "rope_scaling": None,
        "moe_router_enable_expert_bias": False, "eos_token_id": 156892, "pad_token_id": 156892,
        "mask_token_id": 156895, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "llada_8b": {
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": 4096, "n_layers": 32, "n_heads": 32,
        "n_kv_heads": 32, "mlp_hidden_size": 12288, "mlp_ratio": 4, "activation_type": "silu", "block_type": "llama",
        "attention_layer_norm": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "include_bias": False,
        "include_qkv_bias": False, "embedding_size": 126464, "vocab_size": 126464, "weight_tying": False,
        "max_sequence_length": 4096, "block_group_size": 1, "eos_token_id": 126081, "pad_token_id": 126081,
        "mask_token_id": 126336, "torch_dtype": "bfloat16"},
    "llada2_mini": {
        "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "vocab_size": 157184, "hidden_size": 2048,
        "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 5120, "moe_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
        "num_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "rms_norm_eps": 1e-6,
        "use_qk_norm": True, "rope_theta": 600000.0, "partial_rotary_factor": 0.5, "rope_scaling": None,
        "max_position_embeddings": 16384, "first_k_dense_replace": 1, "eos_token_id": 156892,
        "pad_token_id": 156892, "mask_token_id": 156895, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}
PRESETS = {"llada_moe_7b_a1b": ModelConfig.llada_moe_7b_a1b, "llada_8b": ModelConfig.llada_8b,
           "llada2_mini": ModelConfig.llada2_mini}
CASES = [(name, layout) for name in PRESETS for layout in keymap.LAYOUTS if name != "llada_8b" or layout == "per_expert"]


def _leaves(cfg):
  return {tuple(k.key for k in p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]}


def test_7b_a1b_param_count():
  c = count_params(ModelConfig.llada_moe_7b_a1b())
  assert 7.2e9 < c["total"] < 7.6e9, c
  assert 1.2e9 < c["active"] < 1.6e9, c
  # jax.eval_shape of the abstract tree sees the same total.
  shapes = jax.eval_shape(lambda: abstract_params(ModelConfig.llada_moe_7b_a1b()))
  assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)) == c["total"]


def test_other_preset_param_counts():
  c8 = count_params(ModelConfig.llada_8b())
  assert 7.8e9 < c8["total"] < 8.4e9, c8
  c2 = count_params(ModelConfig.llada2_mini())
  assert 15.5e9 < c2["total"] < 17e9, c2  # "16B total, 1.4B active" (Ling-mini-2.0)
  # count_params leaves the embedding table out of "active"; with it (0.32B) this is the quoted 1.4B.
  assert 1.3e9 < c2["active"] + 157184 * 2048 < 1.5e9, c2


@pytest.mark.parametrize("name", PRESETS)
def test_hf_config_gives_preset(name):
  assert ModelConfig.from_hf_config(HF_CONFIGS[name]) == PRESETS[name]()


@pytest.mark.parametrize("name,layout", CASES)
def test_every_key_maps_and_covers_once(name, layout):
  cfg = PRESETS[name]()
  entries = keymap.plan(cfg, layout)  # raises unless every param element is covered exactly once
  keys = expected_hf_keys(cfg, layout)
  assert len(keys) == len(entries)  # no key twice
  leaves = _leaves(cfg)
  covered = {}
  for e in entries:
    rule, i, ex = keymap.match(cfg.family, e.key)  # every key parses back through the table
    assert keymap.TRANSFORMS[rule.transform] is e.transform
    if i is not None:
      assert i < cfg.n_layers and e.pieces[0].index[0] == (i if i < cfg.n_dense_layers else i - cfg.n_dense_layers)
    if ex is not None:
      assert e.pieces[0].index == (e.pieces[0].index[0], ex)
    n_hf = int(np.prod(e.hf_shape))
    n_pieces = sum(int(np.prod(leaves[p.path][len(p.index):])) for p in e.pieces)
    assert n_hf == n_pieces, e.key  # shapes consistent: the HF tensor holds exactly its pieces
    for p in e.pieces:
      covered[p.path] = covered.get(p.path, 0) + int(np.prod(leaves[p.path][len(p.index):]))
  assert covered == {p: int(np.prod(s)) for p, s in leaves.items()}
  assert sum(int(np.prod(s)) for s in keys.values()) == count_params(cfg)["total"]


def test_7b_a1b_key_names_and_shapes():
  k = expected_hf_keys(ModelConfig.llada_moe_7b_a1b(), "per_expert")
  assert len(k) == 3 + 16 * (9 + 64 * 3)
  assert k["model.embed_tokens.weight"] == (157184, 2048)
  assert k["lm_head.weight"] == (157184, 2048)
  assert k["model.layers.15.self_attn.q_proj.weight"] == (2048, 2048)
  assert k["model.layers.15.self_attn.o_proj.weight"] == (2048, 2048)
  assert k["model.layers.0.self_attn.q_norm.weight"] == (128,)
  assert k["model.layers.3.mlp.gate.weight"] == (64, 2048)
  assert k["model.layers.15.mlp.experts.63.gate_proj.weight"] == (1024, 2048)
  assert k["model.layers.15.mlp.experts.63.down_proj.weight"] == (2048, 1024)
  f = expected_hf_keys(ModelConfig.llada_moe_7b_a1b(), "fused")
  assert f["model.layers.0.mlp.w1"] == (64, 2048, 2048) and f["model.layers.0.mlp.w2"] == (64, 2048, 1024)
  assert not any(".experts." in key for key in f)


def test_llada2_mini_key_names_and_shapes():
  k = expected_hf_keys(ModelConfig.llada2_mini(), "per_expert")
  assert k["model.layers.0.attention.query_key_value.weight"] == (3072, 2048)
  assert k["model.layers.0.mlp.gate_proj.weight"] == (5120, 2048)
  assert "model.layers.0.mlp.gate.weight" not in k  # layer 0 is dense
  assert k["model.layers.1.mlp.gate.expert_bias"] == (256,)
  assert k["model.layers.19.mlp.experts.255.up_proj.weight"] == (512, 2048)
  assert k["model.layers.19.mlp.shared_experts.down_proj.weight"] == (2048, 512)
  assert k["model.layers.7.attention.dense.weight"] == (2048, 2048)


def test_llada_8b_key_names():
  k = expected_hf_keys(ModelConfig.llada_8b())
  assert len(k) == 3 + 32 * 9
  assert k["model.transformer.ff_out.weight"] == (126464, 4096)
  assert k["model.transformer.blocks.31.ff_out.weight"] == (4096, 12288)
  assert k["model.transformer.blocks.0.ff_proj.weight"] == (12288, 4096)


@pytest.mark.parametrize("name,layout", CASES)
def test_validation_accepts_full_size_headers(tmp_path, name, layout):
  """The real loader path (headers, key set, shapes, dtypes) on a sparse full-size file of each preset."""
  cfg = PRESETS[name]()
  shapes = expected_hf_keys(cfg, layout)
  dtypes = {k: "F32" for k in shapes if keymap.is_fp32_key(k)}
  d = write_sparse(tmp_path / name, shapes, dtypes, HF_CONFIGS[name])
  ck = HFCheckpoint(d)
  assert ck.layout == layout and ck.cfg == cfg and len(ck.entries) == len(shapes)
  assert ck.source_dtype == "bfloat16"
  lazy = ck.lazy_params("bfloat16")
  got = {tuple(k.key for k in p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(lazy)[0]}
  assert got == _leaves(cfg)
  norm = ck.build_leaf(("final_norm",), "bfloat16")  # reads the (zero) hole: a real read path, no RAM
  assert norm.shape == (cfg.d_model,) and not norm.astype(np.float32).any()


def test_transforms_invert():
  rng = np.random.default_rng(0)
  D, N, K, H, E, F = 8, 4, 2, 3, 5, 6
  cases = {
      "copy": [(D,)], "linear": [(D, F)], "heads_in": [(D, N, H)], "heads_out": [(N, H, D)],
      "qkv": [(D, N, H), (D, K, H), (D, K, H)], "fused_w13": [(E, D, F), (E, D, F)], "fused_w2": [(E, F, D)],
  }
  for name, ps in cases.items():
    t = keymap.TRANSFORMS[name]
    x = rng.standard_normal(t.hf_shape(ps)).astype(np.float32)
    pieces = t.to_jax(x, ps)
    assert [p.shape for p in pieces] == [tuple(s) for s in ps], name
    np.testing.assert_array_equal(t.to_hf(pieces), x, err_msg=name)


def test_unknown_layout_and_unsupported_config():
  with pytest.raises(CheckpointError, match="unknown layout 'packed'"):
    keymap.plan(ModelConfig.llada_8b(), "packed")
  with pytest.raises(CheckpointError, match="attention_layer_norm"):
    keymap.plan(ModelConfig.llada_8b().replace(qk_norm=True))
