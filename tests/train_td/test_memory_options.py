"""The training memory options for big models: gradient checkpointing (remat) and bf16 compute on fp32
master weights. Checked against the plain fp32 step on the tiny config."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train_td import data as data_lib
from train_td import objective, trainer

TINY = dict(d_model=32, n_layers=2, n_heads=4, n_experts=4, n_experts_per_tok=2, expert_ffn_dim=32,
            batch_size=8, steps=3, warmup_steps=0, lr=1e-2, mix=(("arithmetic", 1.0),))


def _setup():
  tc = trainer.TrainConfig(**TINY)
  params, _ = trainer.init_state(tc)
  _, batch = data_lib.get_batch(tc.data_config(), 0)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  B, T = batch["tokens"].shape
  # trajectory fields for the TD loss: answer positions revealed over 1..4 forwards
  reveal = jnp.where(batch["answer"], (jnp.arange(T)[None, :] % 4) + 1, 0).astype(jnp.int32)
  batch_td = dict(batch, reveal=reveal, n_steps=jnp.full((B,), 4, jnp.int32))
  return tc, params, batch, batch_td


def _value_and_grad(loss_fn, params, batch):
  return jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, jax.random.PRNGKey(5))[0]))(params)


def test_remat_gives_the_same_loss_and_gradients():
  # the TD loss with every term on runs both forwards (transition + masked diffusion) through remat
  tc, params, _, b = _setup()
  cfg = tc.model_config()
  make = lambda **kw: objective.make_td_loss_fn(cfg, mdm_weight=0.5, cf_weight=0.5, moe_impl="ragged", **kw)  # noqa: E731
  plain = _value_and_grad(make(), params, b)
  remat = _value_and_grad(make(remat=True), params, b)
  np.testing.assert_allclose(remat[0], plain[0], rtol=1e-6)
  for x, y in zip(jax.tree_util.tree_leaves(remat[1]), jax.tree_util.tree_leaves(plain[1])):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  # remat really recomputes: the backward pass holds checkpointed layer calls.
  jaxpr = str(jax.make_jaxpr(lambda p: jax.grad(lambda q: make(remat=True)(q, b, jax.random.PRNGKey(5))[0])(p))(params))
  assert "remat" in jaxpr or "checkpoint" in jaxpr


def test_bf16_compute_keeps_fp32_master_weights():
  tc, params, batch, _ = _setup()
  cfg = tc.model_config()
  fp32 = objective.make_loss_fn(cfg, moe_impl="ragged")
  bf16 = objective.make_loss_fn(cfg, moe_impl="ragged", compute_dtype="bfloat16")
  # the matmuls of the bf16 loss take bf16 operands; the fp32 loss has none
  def dot_lines(fn):
    text = str(jax.make_jaxpr(lambda p: fn(p, batch, jax.random.PRNGKey(5))[0])(params))
    return [ln for ln in text.splitlines() if "dot_general" in ln or "ragged_dot" in ln]
  assert any("bf16[" in ln for ln in dot_lines(bf16))
  assert not any("bf16[" in ln for ln in dot_lines(fp32))
  (l32, g32), (l16, g16) = _value_and_grad(fp32, params, batch), _value_and_grad(bf16, params, batch)
  # bf16 has 8 bits of mantissa: the loss agrees to about 1%, the gradient direction closely
  np.testing.assert_allclose(l16, l32, rtol=2e-2)
  flat32 = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g32)])
  flat16 = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g16)])
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(g16))  # gradients in the master dtype
  cos = flat16 @ flat32 / np.linalg.norm(flat16) / np.linalg.norm(flat32)
  assert cos > 0.99, cos
  # a full step updates fp32 weights and moments
  opt = trainer.make_optimizer(tc)
  step = trainer.make_train_step(bf16, opt)
  p, s, m = step(params, opt.init(params), batch, jax.random.PRNGKey(5))
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(p))
  assert np.isfinite(float(m["loss"]))


def test_train_config_options_validated():
  with pytest.raises(ValueError, match="compute_dtype"):
    trainer.TrainConfig(**TINY, compute_dtype="float16")
  with pytest.raises(ValueError, match="remat"):
    trainer.TrainConfig(**TINY, remat="yes")
  with pytest.raises(ValueError, match="compute_dtype"):
    objective.make_loss_fn(trainer.TrainConfig(**TINY).model_config(), compute_dtype="int8")
  tc = trainer.TrainConfig(**TINY, remat=True, compute_dtype="bfloat16")
  assert trainer.TrainConfig.from_json(tc.to_json()) == tc
