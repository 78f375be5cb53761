"""The train step on a (data, tensor, expert) mesh: data parallel over batch rows plus the model sharding of
the logical-axis rules table (dinfer_jax.sharding). Loss-agnostic: any `loss_fn(params, batch, rng) ->
(loss, metrics)` runs through it, with every batch field split by rows on "data".

The step is the same function as trainer.make_train_step's, compiled with explicit in/out shardings:
params and the optimizer moments as the rules place the weights (the moments mirror their params; step
counters replicated), batch rows on "data", rng and metrics replicated. GSPMD turns the batch-mean loss
into per-device partial sums and one all-reduce of the gradients, so a step equals the single-device step
up to float summation order. Params and optimizer state are donated, as in the single-device step.

Every process of a multi-process run (jax.distributed) builds the same global batch from the step index
and copies only its own devices' rows (sharding.put_global).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dinfer_jax import sharding
from dinfer_jax.config import ModelConfig
from dinfer_jax.model import params as params_lib


def state_shardings(cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                    dtype=np.float32) -> tuple[Any, Any]:
  """(param shardings, optimizer-state shardings): moments like their params, everything else replicated."""
  abstract = params_lib.abstract_params(cfg, dtype)
  p_sh = sharding.param_shardings(abstract, params_lib.logical_axes(cfg), mesh)
  repl = NamedSharding(mesh, P())
  opt_abstract = jax.eval_shape(optimizer.init, abstract)
  o_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_abstract, p_sh,
                               transform_non_params=lambda _: repl)
  return p_sh, o_sh


def place(tree: Any, shardings: Any) -> Any:
  """Puts a tree of host (or single-device) arrays onto its shardings; each process copies only its shards."""
  return jax.tree_util.tree_map(lambda x, s: sharding.put_global(np.asarray(x), s), tree, shardings)


class ShardedStep:
  """(params, opt_state, batch, rng) -> (params, opt_state, metrics) under a mesh; same contract as
  trainer.make_train_step's step. Batch fields may be host arrays (placed by rows on "data")."""

  def __init__(self, step_fn, cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh):
    self.mesh = mesh
    self.param_shardings, self.opt_shardings = state_shardings(cfg, optimizer, mesh)
    self._repl = NamedSharding(mesh, P())
    self._rows = NamedSharding(mesh, P("data"))
    self._step_fn = step_fn
    self._compiled: dict[Any, Any] = {}

  def _jitted(self, batch_treedef):
    # Batch fields are a dict whose keys decide the in_shardings tree: one jit per batch structure.
    if batch_treedef not in self._compiled:
      b_sh = jax.tree_util.tree_unflatten(batch_treedef, [self._rows] * batch_treedef.num_leaves)
      self._compiled[batch_treedef] = jax.jit(
          self._step_fn, in_shardings=(self.param_shardings, self.opt_shardings, b_sh, self._repl),
          out_shardings=(self.param_shardings, self.opt_shardings, self._repl), donate_argnums=(0, 1))
    return self._compiled[batch_treedef]

  def place_batch(self, batch: dict) -> dict:
    d = sharding.data_size(self.mesh)
    for k, v in batch.items():
      if np.shape(v)[0] % d:
        raise ValueError(f"train step: batch field {k!r} has {np.shape(v)[0]} rows, not a multiple of the "
                         f"mesh's data axis ({d})")
    return jax.tree_util.tree_map(lambda x: sharding.put_global(np.asarray(x), self._rows), batch)

  def place_state(self, params, opt_state):
    return place(params, self.param_shardings), place(opt_state, self.opt_shardings)

  def __call__(self, params, opt_state, batch, rng):
    batch = self.place_batch(batch)
    rng = sharding.put_global(np.asarray(rng), self._repl)
    with sharding.use_mesh(self.mesh):
      return self._jitted(jax.tree_util.tree_structure(batch))(params, opt_state, batch, rng)
