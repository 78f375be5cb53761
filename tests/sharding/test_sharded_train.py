"""One train step on a mesh (data parallel + tensor/expert model sharding) equals the single-device step.

Any loss runs through the same sharded step: the masked-diffusion loss with both MoE kernels, and a loss
that reads an extra per-row batch field (as a trajectory-distillation loss adds its own fields).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax import make_mesh
from train_td import data as data_lib
from train_td import objective, trainer

TINY = dict(d_model=32, n_layers=2, n_heads=4, n_experts=4, n_experts_per_tok=2, expert_ffn_dim=32,
            batch_size=8, steps=3, warmup_steps=0, lr=1e-2, mix=(("arithmetic", 1.0),))
MESHES = {"t2e4": dict(tensor=2, expert=4), "d2t4": dict(data=2, tensor=4), "d8": dict(data=8),
          "e4": dict(expert=4)}


def _weighted_loss(cfg):
  """A different loss with its own batch field: per-row weights on the masked-diffusion loss."""
  base = objective.make_loss_fn(cfg, moe_impl="dense")

  def loss_fn(params, batch, rng):
    per = {k: v for k, v in batch.items() if k != "row_weight"}
    t, masked = objective.sample_mask(rng, per["answer"])
    noised = jnp.where(masked, cfg.mask_token_id, per["tokens"])
    from dinfer_jax.model.transformer import forward
    logits = forward(params, cfg, noised, positions=per["positions"], mask=per["valid"]).logits
    rows = objective.masked_diffusion_loss_from_masked(logits, per["tokens"], masked, t, per["answer"].sum(-1))
    loss = (rows * batch["row_weight"]).sum() / batch["row_weight"].sum()
    return loss, {"mdm": base(params, per, rng)[0]}

  return loss_fn


LOSSES = {
    "mdm_ragged": lambda cfg: objective.make_loss_fn(cfg, moe_impl="ragged"),
    "mdm_dense": lambda cfg: objective.make_loss_fn(cfg, moe_impl="dense"),
    "weighted_extra_field": _weighted_loss,
    # Trajectory distillation with every term on: its own batch fields (reveal, n_steps) and two forwards.
    "td_full": lambda cfg: objective.make_td_loss_fn(cfg, mdm_weight=0.5, cf_weight=0.5, moe_impl="ragged"),
    # ... with gradient checkpointing (the 7B option): same numbers, recomputed in the backward pass.
    "td_remat": lambda cfg: objective.make_td_loss_fn(cfg, mdm_weight=0.5, cf_weight=0.5, moe_impl="ragged",
                                                      remat=True),
}


def _trajectory_fields(batch: dict, seed: int = 3) -> dict:
  """A golden-trajectory batch as train_td.td_data builds it: each answer position revealed at a step in
  1..n_steps (several positions per step), other positions 0."""
  rs = np.random.RandomState(seed)
  B = batch["tokens"].shape[0]
  n_steps = rs.randint(2, 6, size=B).astype(np.int32)
  reveal = np.where(batch["answer"], rs.randint(1, 6, size=batch["answer"].shape) % n_steps[:, None] + 1, 0)
  return dict(batch, reveal=reveal.astype(np.int32), n_steps=n_steps)


@functools.cache
def _setup(loss_name):
  tc = trainer.TrainConfig(**TINY)
  cfg = tc.model_config()
  _, batch = data_lib.get_batch(tc.data_config(), 0)
  batch = {k: np.asarray(v) for k, v in batch.items()}
  batch["row_weight"] = np.linspace(0.5, 2.0, tc.batch_size).astype(np.float32)
  if loss_name != "weighted_extra_field":
    del batch["row_weight"]
  if loss_name.startswith("td"):
    batch = _trajectory_fields(batch)
  loss_fn = LOSSES[loss_name](cfg)
  opt = trainer.make_optimizer(tc)
  params, opt_state = trainer.init_state(tc, opt)
  host = jax.tree_util.tree_map(np.asarray, (params, opt_state))
  rng = jax.random.PRNGKey(7)
  ref = trainer.make_train_step(loss_fn, opt)(params, opt_state, batch, rng)
  return tc, cfg, loss_fn, opt, host, batch, rng, jax.tree_util.tree_map(np.asarray, ref)


def _close(a, b, what):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    scale = max(np.abs(y).max(), 1e-30)
    assert np.abs(x - y).max() <= 1e-5 * scale, (what, jax.tree_util.keystr(path), np.abs(x - y).max(), scale)


# The default run keeps one data-parallel and one tensor+expert case (the TD loss with every term); the
# other layouts and losses run with -m slow (the default suite stays under 10 minutes on 2 cores).
@pytest.mark.parametrize("mesh_name,loss_name", [("d8", "mdm_dense"), ("t2e4", "td_full"),
                                                 pytest.param("t2e4", "mdm_ragged", marks=pytest.mark.slow),
                                                 pytest.param("d2t4", "weighted_extra_field", marks=pytest.mark.slow),
                                                 pytest.param("d2t4", "td_remat", marks=pytest.mark.slow),
                                                 pytest.param("e4", "mdm_ragged", marks=pytest.mark.slow),
                                                 pytest.param("d2t4", "mdm_ragged", marks=pytest.mark.slow),
                                                 pytest.param("d8", "weighted_extra_field", marks=pytest.mark.slow)])
def test_sharded_step_equals_single_device(mesh_name, loss_name):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 fake CPU devices (tests/conftest.py)")
  tc, cfg, loss_fn, opt, (params, opt_state), batch, rng, ref = _setup(loss_name)
  mesh = make_mesh(**MESHES[mesh_name])
  step = trainer.make_train_step(loss_fn, opt, mesh=mesh, cfg=cfg)
  p, o = step.place_state(params, opt_state)
  if mesh.shape["tensor"] > 1:
    assert p["moe_layers"]["q"].sharding.spec[2] == "tensor"
  new_p, new_o, metrics = step(p, o, batch, rng)
  assert new_p["moe_layers"]["q"].sharding == p["moe_layers"]["q"].sharding  # stays on its sharding
  _close(metrics, ref[2], "metrics")
  _close(new_p, ref[0], "params")
  _close(new_o, ref[1], "opt_state")


def test_sharded_step_rejects_rows_that_do_not_split():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 fake CPU devices (tests/conftest.py)")
  tc, cfg, loss_fn, opt, (params, opt_state), batch, rng, _ = _setup("mdm_dense")
  step = trainer.make_train_step(loss_fn, opt, mesh=make_mesh(data=8), cfg=cfg)
  p, o = step.place_state(params, opt_state)
  with pytest.raises(ValueError, match="batch field 'tokens' has 4 rows, not a multiple of the mesh's data axis"):
    step(p, o, {k: v[:4] for k, v in batch.items()}, rng)
