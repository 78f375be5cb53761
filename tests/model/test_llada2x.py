"""LLaDA2.1 / 2.2 configs and LLaDA2.2's block routing, against a plain loop reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.config import ConfigError, ModelConfig
from dinfer_jax.model import moe
from dinfer_jax.model.params import init_params
from dinfer_jax.model.transformer import forward

# LLaDA2.0/2.1-mini's config.json keys (the released model cards), and 2.2's changes to them.
LLADA21 = {
    "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "vocab_size": 512, "hidden_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 16, "num_experts_per_tok": 4,
    "num_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "rms_norm_eps": 1e-6, "use_qk_norm": True, "rope_theta": 600000.0,
    "partial_rotary_factor": 0.5, "rotary_dim": 8, "rope_scaling": None, "max_position_embeddings": 256,
    "first_k_dense_replace": 1, "eos_token_id": 506, "pad_token_id": 506, "mask_token_id": 509,
    "tie_word_embeddings": False, "norm_head": False, "norm_topk_prob": True, "router_dtype": "fp32",
    "torch_dtype": "bfloat16", "use_cache": False, "sliding_window": 4096, "transformers_version": "4.57.0",
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig"}, "initializer_range": 0.02,
    "attention_dropout": 0.0, "output_router_logits": False, "hidden_act": "silu"}
LLADA22 = dict(LLADA21, block_size=8, expert_capacity=6, delete_token_id=507, split_token_id=508,
               rope_theta=3000000.0, eos_token_id=[506, 505], transformers_version="5.2.0")
del LLADA22["sliding_window"]


def test_llada21_loads_as_20_and_22_as_block_routing():
  c21 = ModelConfig.from_hf_config(LLADA21)
  assert (c21.router, c21.n_groups, c21.topk_groups, c21.rope_theta) == ("sigmoid_grouped", 4, 2, 600000.0)
  c22 = ModelConfig.from_hf_config(LLADA22)
  assert (c22.router, c22.router_block, c22.expert_capacity, c22.rope_theta) == ("sigmoid_block", 8, 6, 3e6)
  assert c22.eos_token_id == 506 and c22.stop_token_ids == (506, 505)
  assert c22.decoding == "block"


@pytest.mark.parametrize("key,value,text", [
    ("moe_layer_freq", 2, "'moe_layer_freq' is not implemented"),  # an unknown key may change the architecture
    ("use_sliding_window", True, "use_sliding_window=True"),
    ("norm_topk_prob", False, "norm_topk_prob=False"),
    ("tie_word_embeddings", True, "tie_word_embeddings=True"),
    ("rotary_dim", 16, "rotary_dim=16 disagrees"),
    ("expert_capacity", 2, "expert_capacity"),  # fewer than the 4 experts a token takes
])
def test_keys_the_loader_does_not_implement_are_refused(key, value, text):
  with pytest.raises(ConfigError, match=text):
    ModelConfig.from_hf_config(dict(LLADA22, **{key: value}))


def _ref_route(logits, bias, positions, valid, r, cap, k, scale):
  """Block routing one token at a time: per aligned block of a row the experts whose best biased score over
  the block's real tokens ranks in the top `cap` (lower id first on ties), then each token's top k of those by
  its biased score; weights the unbiased sigmoid scores, normalised and scaled."""
  s = 1 / (1 + np.exp(-logits.astype(np.float64)))
  sel = s + bias
  B, Tr = positions.shape
  out = {}
  for b in range(B):
    blocks: dict[int, list[int]] = {}
    for t in range(Tr):
      if valid[b, t]:
        blocks.setdefault(int(positions[b, t]) // r, []).append(b * Tr + t)
    for rows in blocks.values():
      best = sel[rows].max(axis=0)
      admitted = sorted(range(len(best)), key=lambda e: (-best[e], e))[:cap]
      for row in rows:
        ids = sorted(admitted, key=lambda e: (-sel[row, e], e))[:k]
        w = s[row, ids]
        out[row] = (ids, w / (w.sum() + 1e-20) * scale)
  return out


@pytest.mark.parametrize("seed", range(6))
def test_block_routing_matches_the_loop_reference(seed):
  rng = np.random.default_rng(seed)
  cfg = ModelConfig.from_hf_config(LLADA22)
  B, Tr, E = 3, 20, cfg.n_experts
  logits = rng.normal(size=(B * Tr, E)).astype(np.float32) * 2
  if seed % 2:  # exact ties across experts and tokens
    logits[:, 3] = logits[:, 5]
    logits[4] = logits[5]
  bias = rng.normal(size=E).astype(np.float32) * 0.3
  # Row 0 from position 0; row 1 left-padded (its first 5 inputs are not real, their positions clamped to 0); row
  # 2 a window from position 16 (aligned) whose last block is short.
  positions = np.stack([np.arange(Tr), np.maximum(np.arange(Tr) - 5, 0), 16 + np.arange(Tr)]).astype(np.int32)
  valid = np.ones((B, Tr), bool)
  valid[1, :5] = False
  h = jnp.eye(E, dtype=jnp.float32)  # the router weight turns h = logits into the logits
  lp = {"router": h, "expert_bias": jnp.asarray(bias)}
  w, idx = moe.route(jnp.asarray(logits), lp, cfg, jnp.asarray(positions), jnp.asarray(valid))
  want = _ref_route(logits, bias, positions, valid, cfg.router_block, cfg.expert_capacity, cfg.n_experts_per_tok,
                    cfg.routed_scaling_factor)
  assert len(want) == valid.sum()
  for row, (ids, wts) in want.items():
    assert np.asarray(idx[row]).tolist() == ids, row
    np.testing.assert_allclose(np.asarray(w[row]), wts, rtol=1e-5)


def test_a_tiny_22_model_routes_by_blocks():
  """Its forward: every MoE kernel agrees with the loop reference; the logits are not group routing's; a row
  padded in a batch (its routing blocks follow its own positions) equals the row alone."""
  cfg = ModelConfig.from_hf_config(LLADA22)
  params = init_params(cfg, jax.random.PRNGKey(0))
  x = jax.random.randint(jax.random.PRNGKey(1), (1, 24), 0, 500)
  with jax.default_matmul_precision("highest"):
    ref = forward(params, cfg, x, moe_impl="loop").logits
    for impl in ("dense", "ragged"):
      np.testing.assert_allclose(forward(params, cfg, x, moe_impl=impl).logits, ref, rtol=2e-5, atol=2e-5)
    grouped = forward(params, cfg.replace(router="sigmoid_grouped"), x, moe_impl="loop").logits
    assert float(jnp.abs(grouped - ref).max()) > 1e-3
    # The same row behind 8 padding inputs (positions clamped to 0, masked out), in a batch with another row.
    padded = jnp.concatenate([jnp.full((1, 8), 3), x], axis=1)
    other = jax.random.randint(jax.random.PRNGKey(2), (1, 32), 0, 500)
    valid = jnp.concatenate([jnp.arange(32)[None] >= 8, jnp.ones((1, 32), bool)])
    pos = jnp.stack([jnp.maximum(jnp.arange(32) - 8, 0), jnp.arange(32)])
    both = forward(params, cfg, jnp.concatenate([padded, other]), positions=pos, mask=valid, moe_impl="loop").logits
  np.testing.assert_allclose(both[0, 8:], ref[0], rtol=2e-5, atol=2e-5)
