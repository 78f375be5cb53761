"""MoE kernels against the loop reference; config validation; no recompiles; param counts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.config import ConfigError, ModelConfig
from dinfer_jax.model import moe
from dinfer_jax.model.params import count_params, init_params
from dinfer_jax.model.transformer import forward


def tiny(family="llada_moe", **kw):
  base = dict(family=family, vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
              n_experts=8, n_experts_per_tok=2, expert_ffn_dim=16, qk_norm=True, rope_theta=10000.0,
              mask_token_id=63, eos_token_id=62, max_position=128)
  if family == "llada2_moe":
    base.update(ffn_dim=24, n_dense_layers=1, router="sigmoid_grouped", n_groups=4, topk_groups=2,
                routed_scaling_factor=2.5, router_bias=True, shared_expert_ffn_dim=16, rotary_dim=4)
  base.update(kw)
  return ModelConfig(**base)


@pytest.mark.parametrize("family", ["llada_moe", "llada2_moe"])
@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_expert_kernels_match_loop_reference(family, impl):
  cfg = tiny(family)
  p = init_params(cfg, jax.random.PRNGKey(0))
  lp = jax.tree_util.tree_map(lambda x: x[0], p["moe_layers"])
  if cfg.router_bias:
    lp["expert_bias"] = jax.random.normal(jax.random.PRNGKey(3), lp["expert_bias"].shape) * 0.1
  h = jax.random.normal(jax.random.PRNGKey(1), (2, 37, cfg.d_model))
  ref = moe.moe_ffn(h, lp, cfg, "loop")
  out = moe.moe_ffn(h, lp, cfg, impl)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(ref).max()) > 1e-2  # not trivially zero


def test_softmax_router_is_not_renormalised_and_llada2_router_is():
  cfg = tiny()
  lp = {"router": jax.random.normal(jax.random.PRNGKey(0), (cfg.d_model, cfg.n_experts))}
  h = jax.random.normal(jax.random.PRNGKey(1), (5, cfg.d_model))
  w, idx = moe.route(h, lp, cfg)
  probs = jax.nn.softmax(h @ lp["router"], -1)
  np.testing.assert_allclose(w, jnp.take_along_axis(probs, idx, -1), rtol=1e-6)
  assert float(w.sum(-1).max()) < 1.0
  cfg2 = tiny("llada2_moe")
  lp2 = {"router": lp["router"][:, :16] if cfg2.n_experts == 16 else jax.random.normal(
      jax.random.PRNGKey(0), (cfg2.d_model, cfg2.n_experts)), "expert_bias": jnp.zeros(cfg2.n_experts)}
  w2, idx2 = moe.route(h, lp2, cfg2)
  np.testing.assert_allclose(w2.sum(-1), cfg2.routed_scaling_factor, rtol=1e-5)
  # Group limit: all chosen experts lie in at most topk_groups groups.
  groups = np.asarray(idx2) // (cfg2.n_experts // cfg2.n_groups)
  assert max(len(set(g)) for g in groups) <= cfg2.topk_groups


def test_llada2_bias_steers_selection_only():
  cfg = tiny("llada2_moe", n_groups=1, topk_groups=1)
  lp = {"router": jax.random.normal(jax.random.PRNGKey(0), (cfg.d_model, cfg.n_experts)) * 0.1,
        "expert_bias": jnp.zeros(cfg.n_experts).at[5].set(10.0)}
  h = jax.random.normal(jax.random.PRNGKey(1), (4, cfg.d_model))
  w, idx = moe.route(h, lp, cfg)
  assert (np.asarray(idx) == 5).any(axis=1).all()  # the bias forces expert 5 into every selection
  s = jax.nn.sigmoid(h @ lp["router"])
  sel = jnp.take_along_axis(s, idx, -1)
  np.testing.assert_allclose(w, sel / sel.sum(-1, keepdims=True) * cfg.routed_scaling_factor, rtol=1e-5)


def test_second_forward_of_same_shape_does_not_recompile():
  cfg = tiny()
  p = init_params(cfg, jax.random.PRNGKey(0))
  f = jax.jit(lambda p, t: forward(p, cfg, t).logits)
  f(p, jnp.zeros((2, 16), jnp.int32)).block_until_ready()
  n = f._cache_size()
  f(p, jnp.ones((2, 16), jnp.int32)).block_until_ready()
  assert f._cache_size() == n


@pytest.mark.parametrize("preset,total,active", [
    ("llada_moe_7b_a1b", (7.2e9, 7.6e9), (1.2e9, 1.6e9)),
    ("llada_8b", (7.8e9, 8.4e9), (7.0e9, 8.4e9)),
    # Ling/LLaDA2 quote 1.4B active counting the embedding table (ours: 1.11B without it, 1.43B with it).
    ("llada2_mini", (15.5e9, 16.8e9), (1.0e9, 1.2e9)),
])
def test_preset_param_counts(preset, total, active):
  c = count_params(getattr(ModelConfig, preset)())
  assert total[0] <= c["total"] <= total[1], c
  assert active[0] <= c["active"] <= active[1], c


def test_eval_shape_of_7b_forward_needs_no_memory():
  cfg = ModelConfig.llada_moe_7b_a1b()
  from dinfer_jax.model.params import abstract_params
  out = jax.eval_shape(lambda p, t: forward(p, cfg, t).logits, abstract_params(cfg),
                       jax.ShapeDtypeStruct((1, 64), jnp.int32))
  assert out.shape == (1, 64, cfg.vocab_size) and out.dtype == jnp.float32


@pytest.mark.parametrize("hf,field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": "llada"}, "num_experts"),
    ({"model_type": "llada", "num_experts": 8, "hidden_size": 64, "num_attention_heads": 3}, "hidden_size"),
    ({"model_type": "llada", "d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 10, "rope_theta": 1.0,
      "block_type": "sequential"}, "block_type"),
])
def test_bad_hf_configs_name_the_field(hf, field):
  with pytest.raises(ConfigError, match=field):
    ModelConfig.from_hf_config(hf)


def test_inconsistent_config_names_the_field():
  with pytest.raises(ConfigError, match="n_kv_heads"):
    tiny(n_kv_heads=3)
  with pytest.raises(ConfigError, match="n_experts_per_tok"):
    tiny(n_experts_per_tok=9)
  with pytest.raises(ConfigError, match="mask_token_id"):
    tiny(mask_token_id=64)
